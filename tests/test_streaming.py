"""Memory of the corpus-wide trainers bounded by a cap, not by the corpus (tasks.wsss.streaming):
under the cap the trainers compute exactly what they compute in memory; above it they never
hold more rows than the cap (counted by a RowBudget) and still learn the same classifier."""
import os

import numpy as np
import pytest
import torch

from wsseg.tasks.config import FeatureConfig, MILConfig, ProposalConfig
from wsseg.tasks.store import ClassSpec, ImageRecord, Store, sha256_file
from wsseg.tasks.store.files import read_image, read_mask
from wsseg.tasks.wsss import mil
from wsseg.tasks.wsss import proposal_classifier as pc
from wsseg.tasks.wsss import superpixels as spx
from wsseg.tasks.wsss.feature_cache import compute_features, feature_key, load_features, proposal_inputs
from wsseg.tasks.wsss.streaming import RowBudget, RowBuffer, split_images

from conftest import SAMPLE


def _images(n_images, rows=lambda i: 3 + i % 4, d=2):
    """Per image: rows whose values say (image, row), and the image's own number."""
    out = []
    for i in range(n_images):
        n = rows(i)
        x = np.stack([np.full(n, i, np.float32), np.arange(n, dtype=np.float32)], 1)[:, :d]
        out.append(({"x": x, "w": np.arange(n, dtype=np.int64)}, {"tags": np.array([i, -i])}))
    return out


def test_under_the_cap_the_rows_stay_in_memory_as_given():
    data = _images(5)
    budget = RowBudget(100)
    with RowBuffer(100, budget=budget) as rows:
        for r, p in data:
            rows.add(r, p)
        rows.finish()
        assert rows.resident and rows.folder is None and not rows.pieces
        assert all(a is r["x"] for a, (r, _) in zip(rows.lists("x"), data))  # the arrays themselves
        assert [t.tolist() for t in rows.lists("tags")] == [p["tags"].tolist() for _, p in data]
        assert budget.peak == rows.n_rows == sum(len(r["x"]) for r, _ in data)
    assert budget.held == 0


def test_past_the_cap_every_row_is_streamed_once_an_epoch_and_the_cap_holds():
    data = _images(40)
    total = sum(len(r["x"]) for r, _ in data)
    cap = total // 5
    budget = RowBudget(cap)
    with RowBuffer(cap, budget=budget, pieces_per_chunk=4) as rows:
        for r, p in data:
            rows.add(r, p)
            assert budget.held <= cap
        rows.finish()
        folder = rows.folder
        assert not rows.resident and len(rows.pieces) > 5 and budget.held == 0
        with pytest.raises(RuntimeError, match="on disk"):
            rows.lists("x")
        for seed in range(3):
            order = np.random.default_rng(seed).permutation(len(rows.pieces))
            plan = rows.plan(order)
            assert sorted(i for c in plan for i in c) == list(range(len(rows.pieces)))
            seen = {}
            for c in plan:
                assert sum(rows.pieces[i].rows for i in c) <= cap
                with rows.chunk(c, ["x", "w", "tags"]) as got:
                    assert budget.held == len(got["x"]) <= cap
                    for j, x, w, t in zip(got["image_index"], split_images(got, "x"), split_images(got, "w"),
                                          got["tags"]):
                        seen[int(j)] = (x.copy(), w.copy(), t.copy())
            assert sorted(seen) == list(range(len(data)))  # every image once, its rows intact
            for j, (r, p) in enumerate(data):
                assert np.array_equal(seen[j][0], r["x"]) and np.array_equal(seen[j][1], r["w"])
                assert np.array_equal(seen[j][2], p["tags"])
        # a field rewritten piece by piece (the MIL's labels of an iteration)
        for i, piece in enumerate(rows.pieces):
            rows.write(i, "y", np.full(piece.rows, i, np.int32))
        with rows.chunk([2], ["y"]) as got:
            assert (got["y"] == 2).all()
        n, s, q = rows.moments("x")
        allx = np.concatenate([r["x"] for r, _ in data]).astype(np.float64)
        assert n == total and np.allclose(s, allx.sum(0)) and np.allclose(q, (allx ** 2).sum(0))
    assert budget.peak <= cap and budget.held == 0
    assert not os.path.exists(folder)


def test_bad_input_is_named():
    with RowBuffer(4) as rows:
        with pytest.raises(ValueError, match="max_samples"):
            rows.add({"x": np.zeros((5, 1))}, {})
        rows.add({"x": np.zeros((2, 1))}, {"t": np.zeros(1)})
        with pytest.raises(ValueError, match="fields"):
            rows.add({"y": np.zeros((2, 1))}, {"t": np.zeros(1)})
    with RowBuffer(10) as rows, pytest.raises(ValueError, match="lengths"):
        rows.add({"x": np.zeros((2, 1)), "z": np.zeros(3)}, {})
    budget = RowBudget(3)
    budget.hold(3)
    with pytest.raises(MemoryError, match="cap of 3"):
        budget.hold(1)


# ---------------------------------------------------------------------------- the trainers on real images
@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A store of real sample images with their features and a preliminary result made from the
    masks: 0.6 for the right tag, 0.4 for the image's other tags, plus noise."""
    names = (SAMPLE / "classes.txt").read_text().split()
    classes = ClassSpec(tuple(names), None)
    tags = {}
    for line in (SAMPLE / "labels.csv").read_text().splitlines()[1:]:
        iid, _, labels = line.split(",")
        tags[iid] = tuple(labels.split(";"))
    ids = sorted(tags)[::5][:12]  # of different classes
    store = Store(tmp_path_factory.mktemp("stream") / "run")
    records = []
    for iid in ids:
        path = SAMPLE / "images" / f"{iid}.jpg"
        image = read_image(path)
        rec = ImageRecord(iid, image.shape[0], image.shape[1], tags[iid],
                          sha256_file(path), "train", str(path), True)
        store.put_image(iid, image, rec.sha256)
        records.append(rec)
    store.write_corpus(records, classes)
    cfg = FeatureConfig()
    key = feature_key(cfg)
    rng = np.random.default_rng(0)
    for rec in records:
        compute_features(store, rec, cfg, key)
        mask = read_mask(SAMPLE / "masks" / f"{rec.image_id}.png")
        cls = np.array([names.index(t) for t in rec.tags])
        prob = np.where(mask[None] == cls[:, None, None], 0.6, 0.4).astype(np.float32)
        prob += rng.uniform(0, 0.3, prob.shape).astype(np.float32)
        store.write_prelim(0, rec.image_id, prob / prob.sum(0, keepdims=True), cls)
    return store, records, key


def _in_memory_mil(store, records, key, cfg):
    classes = store.classes()
    feats, prelims, tags, areas = [], [], [], []
    for rec in records:
        f = load_features(store, rec, key)
        feats.append(f.sp_features)
        prelims.append(spx.pool(store.prelim(0, rec.image_id, classes.n), f.superpixels, n=len(f.sp_areas),
                                channel_axis=0))
        tags.append(classes.tag_vector(rec.tags))
        areas.append(f.sp_areas)
    res = mil.refine(feats, prelims, tags, areas, iterations=cfg.iterations, prior_weight=cfg.prior_weight,
                     negatives=True, epochs=cfg.epochs,
                     lr=cfg.lr, seed=0)
    return res, feats, prelims, tags


def _fresh(store, kind):
    p = store.checkpoint_path(kind, 0)
    if p.exists():
        p.unlink()


def test_mil_under_the_cap_is_the_in_memory_computation_and_over_it_bounded(corpus, one_torch_thread):
    store, records, key = corpus
    cfg = MILConfig(iterations=2, epochs=4)
    ref, feats, prelims, tags = _in_memory_mil(store, records, key, cfg)
    total = sum(len(x) for x in feats)

    _fresh(store, "mil")
    budget = RowBudget(cfg.max_samples)
    assert mil.train_round(store, 0, records, key, cfg, seed=0, budget=budget)
    got = store.read_classifier("mil", 0)
    assert budget.peak == total <= cfg.max_samples
    ref_state, got_state = ref.model.state_dict(), got["model"].state_dict()
    assert all(torch.equal(ref_state[k], got_state[k]) for k in ref_state)  # bit-identical
    assert got["changed"] == [float(c) for c in ref.changed] and got["losses"] == [float(v) for v in ref.losses]

    cap = total // 4
    _fresh(store, "mil")
    budget = RowBudget(cap)
    mil.train_round(store, 0, records, key, cfg.model_copy(update={"max_samples": cap}), seed=0, budget=budget)
    assert 0 < budget.peak <= cap < total and budget.held == 0
    streamed = store.read_classifier("mil", 0)
    assert len(streamed["changed"]) == cfg.iterations
    # the same classifier, learned a chunk at a time: it labels the superpixels as the in-memory one
    agree = np.mean(np.concatenate([
        mil.evidence(streamed["model"], x, p, t, cfg.prior_weight).argmax(1)
        == mil.evidence(ref.model, x, p, t, cfg.prior_weight).argmax(1) for x, p, t in zip(feats, prelims, tags)]))
    assert agree > 0.8, agree


def test_proposal_classifier_under_the_cap_is_in_memory_and_over_it_bounded(corpus, one_torch_thread):
    store, records, key = corpus
    classes = store.classes()
    cfg = ProposalConfig(epochs=4)
    _fresh(store, "mil")  # no MIL model: targets from the preliminary result alone
    feats, targets, tags = [], [], []
    for rec in records:
        f = load_features(store, rec, key)
        allowed = classes.tag_vector(rec.tags)
        sp_prob = pc.sp_evidence(f, store.prelim(0, rec.image_id, classes.n), allowed, None, 0.3)
        feats.append(proposal_inputs(f))
        targets.append(pc.proposal_targets(f.membership, sp_prob, f.sp_areas, allowed, sharpen=cfg.target_sharpen))
        tags.append(allowed)
    kw = dict(hidden=cfg.hidden, epochs=cfg.epochs, lr=cfg.lr, negatives=True)
    ref, ref_losses = pc.train_proposal_classifier(feats, targets, tags, seed=0, **kw)
    total = sum(len(x) for x in feats)

    _fresh(store, "proposal_classifier")
    budget = RowBudget(cfg.max_samples)
    pc.train_round(store, 0, records, key, cfg, mil_prior_weight=0.3, seed=0, budget=budget)
    got = store.read_classifier("proposal_classifier", 0)
    assert budget.peak == total
    assert all(torch.equal(v, got["model"].state_dict()[k]) for k, v in ref.state_dict().items())
    assert got["losses"] == [float(v) for v in ref_losses]

    cap = total // 4
    _fresh(store, "proposal_classifier")
    budget = RowBudget(cap)
    pc.train_round(store, 0, records, key, cfg.model_copy(update={"max_samples": cap}), mil_prior_weight=0.3,
                   seed=0, budget=budget)
    assert 0 < budget.peak <= cap < total and budget.held == 0
    streamed = store.read_classifier("proposal_classifier", 0)["model"]
    agree = np.mean(np.concatenate([pc.predict_proposals(streamed, x, t).argmax(1)
                                    == pc.predict_proposals(ref, x, t).argmax(1) for x, t in zip(feats, tags)]))
    assert agree > 0.8, agree
