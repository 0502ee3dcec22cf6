"""A person's corrections in (`wsseg ingest --corrections`): a PNG folder is checked file by file
(each refused file named, the others kept), a correction replaces an earlier one, and the rounds
computed afterwards keep the corrected labels as they are (the true masks stand in for a person's
corrections, so the answer is known)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import SAMPLE, TINY

ROOT = Path(__file__).resolve().parents[1]


def _ingest(*argv):
    return subprocess.run([sys.executable, "-m", "wsseg", "ingest", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def _png(path: Path, label: np.ndarray) -> Path:
    im = Image.fromarray(label.astype(np.uint8), mode="P")
    im.putpalette([v for i in range(256) for v in (i, i, i)])
    im.save(path)
    return path


@pytest.mark.command("ingest")
def test_png_corrections_are_checked_per_file_and_replace_earlier_ones(tmp_path, tiny_run):
    from wsseg.tasks.store import Store

    run = shutil.copytree(tiny_run, tmp_path / "run", symlinks=True)
    store = Store(run)
    classes = store.classes()
    recs = store.manifest()
    a, b = recs[0], recs[1]
    folder = tmp_path / "fixes"
    folder.mkdir()
    shutil.copy(SAMPLE / "masks" / f"{a.image_id}.png", folder)  # a person's correction: the true mask
    truth_a = np.asarray(Image.open(SAMPLE / "masks" / f"{a.image_id}.png"))
    _png(folder / "no_such_image.png", truth_a)
    _png(folder / f"{b.image_id}.png", np.zeros((b.height // 2, b.width), np.uint8))  # wrong size
    untagged = next(i for i, n in enumerate(classes.names) if n not in b.tags and i != classes.background)
    wrong_class = np.full((b.height, b.width), 255, np.uint8)
    wrong_class[:10, :10] = untagged
    other = tmp_path / "more"
    other.mkdir()
    _png(other / f"{b.image_id}.png", wrong_class)
    (other / f"{recs[2].image_id}.png").write_bytes(b"not a png at all")
    no_class = np.full((recs[3].height, recs[3].width), 255, np.uint8)
    no_class[:4, :4] = 200  # no class has this index
    _png(other / f"{recs[3].image_id}.png", no_class)

    res = _ingest("--run-dir", str(run), "--corrections", str(folder))
    assert res.returncode == 1, res.stdout + res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("wsseg: error:")]
    assert len(errors) == 2, res.stderr
    assert any("no_such_image.png" in e and "not in the corpus" in e for e in errors)
    assert any(f"{b.image_id}.png" in e and f"{b.width}x{b.height}" in e for e in errors)
    assert "stored 1 correction(s) (0 replacing earlier ones), refused 2; 1 corrected image(s)" in res.stdout
    assert np.array_equal(store.correction(a.image_id), truth_a)
    assert store.correction(b.image_id) is None
    assert set(store.corrections()) == {a.image_id}

    res = _ingest("--run-dir", str(run), "--corrections", str(other))
    assert res.returncode == 1
    assert f"class(es) {classes.names[untagged]} are not among image {b.image_id}'s tags" in res.stderr
    assert f"{recs[2].image_id}.png: unreadable correction" in res.stderr
    assert f"{recs[3].image_id}.png: value(s) [200] are no class index of the {classes.n} classes" in res.stderr
    assert res.stderr.count("wsseg: error:") == 3
    assert set(store.corrections()) == {a.image_id}  # nothing else lost

    # a new correction of the same image replaces the old one
    newer = truth_a.copy()
    newer[:8, :8] = 255
    again = tmp_path / "again"
    again.mkdir()
    _png(again / f"{a.image_id}.png", newer)
    res = _ingest("--run-dir", str(run), "--corrections", str(again))
    assert res.returncode == 0, res.stderr
    assert "stored 1 correction(s) (1 replacing earlier ones), refused 0; 1 corrected image(s)" in res.stdout
    assert np.array_equal(store.correction(a.image_id), newer)

    # the png export's own layout and colours are read back as they were written
    res = subprocess.run([sys.executable, "-m", "wsseg", "export", "--run-dir", str(run), "--out",
                          str(tmp_path / "voc"), "--no-images"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    exported = tmp_path / "voc" / "VOCdevkit" / "VOC2012" / "SegmentationClass" / f"{b.image_id}.png"
    rgb = tmp_path / "rgb"
    rgb.mkdir()
    Image.open(exported).convert("RGB").save(rgb / exported.name)  # as an editor that saves RGB would
    res = _ingest("--run-dir", str(run), "--corrections", str(tmp_path / "voc"))
    assert res.returncode == 0, res.stderr
    res = _ingest("--run-dir", str(run), "--corrections", str(rgb))
    assert res.returncode == 0, res.stderr
    final = store.read_summary()["final_round"]
    assert np.array_equal(store.correction(b.image_id), store.pseudo(final, b.image_id))


@pytest.mark.command("ingest")
def test_rounds_keep_corrected_labels_and_train_on_them(tmp_path, tiny_run, cluster, prefect_harness):
    import torch

    from wsseg.flows.runtime import on_cluster
    from wsseg.flows.wsss import train_wsss
    from wsseg.tasks.config import WSSSConfig
    from wsseg.tasks.store import Store

    run = shutil.copytree(tiny_run, tmp_path / "run", symlinks=True)
    store = Store(run)
    recs = store.manifest("train")
    fixed = recs[:2]
    folder = tmp_path / "fixes"
    folder.mkdir()
    for rec in fixed:
        shutil.copy(SAMPLE / "masks" / f"{rec.image_id}.png", folder)
    before = {rec.image_id: store.pseudo(0, rec.image_id) for rec in recs}
    assert not all(np.array_equal(before[r.image_id], store.mask(r.image_id)) for r in fixed)
    res = _ingest("--run-dir", str(run), "--corrections", str(folder))
    assert res.returncode == 0, res.stderr
    status = subprocess.run([sys.executable, "-m", "wsseg", "status", str(run)], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert "2 image(s) corrected by a person" in status.stdout, status.stdout
    assert "the corrections (0 -> 2 corrected images)" in status.stdout  # `wsseg train` recomputes the rounds

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        summary = on_cluster(train_wsss, cluster)(str(run), WSSSConfig.model_validate(TINY), cluster)
    finally:
        torch.set_num_threads(threads)
    assert summary["corrected_images"] == 2
    r = summary["final_round"]
    assert store.read_round(r)["corrected_images"] == 2
    assert store.round_inputs(r)["corrections"]["images"] == 2
    for rec in fixed:  # kept as corrected, 255 included
        assert np.array_equal(store.pseudo(r, rec.image_id), store.mask(rec.image_id)), rec.image_id
        # and trained on: the preliminary result the MIL and proposal classifiers learn from is the correction
        prelim = store.prelim(r, rec.image_id, store.classes().n).argmax(0)
        known = store.mask(rec.image_id) != 255
        assert np.array_equal(prelim[known], store.mask(rec.image_id)[known])
    # the round's Prefect artifact shows the review queue: uncorrected images first, corrected ones last
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from wsseg.tasks.labels.review import review_table

    queue = review_table(store, r, top=10, measure=False)["rows"]
    assert [x["image_id"] for x in queue[-2:]] == sorted(x.image_id for x in fixed)
    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[f"review-{r}"])))
    art = max(arts, key=lambda a: a.created).data
    assert queue[0]["image_id"] in art and "disagreement" in art and f"wsseg review --run-dir {run}" in art
    # the others were computed again with classifiers that saw the corrections
    others = [rec for rec in recs if rec not in fixed]
    assert any(not np.array_equal(store.pseudo(r, x.image_id), before[x.image_id]) for x in others)


def test_trusted_images_keep_their_targets_through_mil():
    """MIL reassigns each image's superpixel labels every iteration; a corrected (trusted) image's
    stay those of its correction: with every image trusted nothing moves, in memory and streamed."""
    from wsseg.tasks.wsss.mil import refine, refine_streamed
    from wsseg.tasks.wsss.streaming import RowBuffer

    rng = np.random.default_rng(0)
    feats = [rng.normal(size=(30, 5)).astype(np.float32) for _ in range(4)]
    allowed = [np.array([True, True, False])] * 4
    areas = [np.ones(30, np.float32)] * 4
    prelim = [rng.dirichlet([1, 1, 1], 30).astype(np.float32) for _ in range(4)]
    kw = dict(iterations=3, epochs=3, seed=0)
    free = refine(feats, prelim, allowed, areas, **kw)
    assert free.changed[0] > 0.05  # random evidence: MIL moves labels of untrusted images
    assert refine(feats, prelim, allowed, areas, **kw, trusted=[True] * 4).changed == [0.0, 0.0, 0.0]
    some = refine(feats, prelim, allowed, areas, **kw, trusted=[True, True, False, False]).changed
    assert 0 < some[0] < free.changed[0]

    for trusted, moves in ((False, True), (True, False)):
        with RowBuffer(40) as rows:  # 4 x 30 rows over a cap of 40: on disk, streamed
            for x, p, t, a in zip(feats, prelim, allowed, areas):
                rows.add({"x": x, "p": p, "a": a}, {"tags": t, "trusted": np.array(trusted)})
            rows.finish()
            assert not rows.resident
            changed = refine_streamed(rows, **kw).changed
        assert (changed[0] > 0.05) == moves and (changed == [0.0, 0.0, 0.0]) != moves


@pytest.mark.command("bench corrections")
def test_bench_corrections_queue_against_random(tmp_path, tiny_run, cluster, prefect_harness):
    """Two of the six images corrected (their masks), picked by the review queue and at random:
    each pick's run keeps the picked masks as its labels, the main run is left without corrections,
    and the table compares both with the run before."""
    import argparse
    import json

    from wsseg.flows.cli_bench import add_bench_corrections_parser, cmd_bench_corrections
    from wsseg.tasks.labels.review import review_table
    from wsseg.tasks.store import Store

    run = shutil.copytree(tiny_run, tmp_path / "run", symlinks=True)
    ap = argparse.ArgumentParser()
    bench = ap.add_subparsers(dest="cmd").add_parser("bench").add_subparsers(dest="bench")
    add_bench_corrections_parser(bench)
    out = tmp_path / "res" / "c.json"
    args = ap.parse_args(["bench", "corrections", "--run-dir", str(run), "--share", "0.34", "--seeds", "1",
                          "--dask-address", cluster, "--out", str(out)])
    assert args.func is cmd_bench_corrections and args.func(args) == 0

    store = Store(run)
    res = json.loads(out.read_text())
    assert res["images"] == 6 and res["corrected_per_variant"] == 2 and set(res["variants"]) == {"queue", "random-0"}
    queue = [x["image_id"] for x in review_table(store, store.read_summary()["final_round"], measure=False)["rows"]]
    assert res["variants"]["queue"]["images"] == queue[:2]
    assert res["review_spearman"] is not None and -1 <= res["review_spearman"] <= 1
    for name, v in res["variants"].items():
        vstore = Store(v["run_dir"])
        assert set(vstore.corrections()) == set(v["images"])
        for iid in v["images"]:  # the picked images' labels are their masks
            assert np.array_equal(vstore.pseudo(v["final_round"], iid), store.mask(iid)), (name, iid)
        assert all(0.0 <= v[k] <= 1.0 for k in ("others_miou", "others_miou_before", "corpus_miou", "model_miou"))
    assert store.corrections() == {}  # the main run is left as it was
    table = out.with_suffix(".md").read_text()
    for row in ("| none | 0 |", "| queue | 2 |", "| random-0 | 2 |", "| random (mean of 1) | 2 |"):
        assert row in table


def test_a_training_sample_is_seeded_stable_and_keeps_the_corrected_images():
    """``train_images``'s sample (``training_sample``): all images up to the limit; else exactly
    the limit, in the manifest's order, the same for the same seed and another for another; the
    corrected images always in it; an ingest that adds images changes it by at most as many."""
    from wsseg.tasks.store import ImageRecord
    from wsseg.tasks.wsss.pipeline import training_sample

    recs = [ImageRecord(image_id=f"img{i:04d}", height=8, width=8, tags=("cow",), sha256=f"{i:064x}", split="train",
                        source=f"/d/img{i:04d}.jpg", has_mask=False) for i in range(1000)]
    ids = lambda rs: [r.image_id for r in rs]  # noqa: E731
    assert training_sample(recs, None, 0) == recs and training_sample(recs, 1000, 0) == recs
    a = training_sample(recs, 100, 0)
    assert len(a) == 100 and ids(a) == sorted(ids(a)) and a == training_sample(list(recs), 100, 0)
    assert ids(a) != ids(training_sample(recs, 100, 1))
    keep = {"img0999", "img0500"}
    k = training_sample(recs, 100, 0, keep)
    assert len(k) == 100 and keep <= set(ids(k))
    grown = recs + [ImageRecord(**(r.__dict__ | {"image_id": f"new{i:03d}"})) for i, r in enumerate(recs[:50])]
    assert len(set(ids(a)) - set(ids(training_sample(grown, 100, 0)))) <= 50


def test_a_bound_that_does_not_cut_the_split_changes_no_round():
    """The default bound (``train_images``) on a split of at most that many images is no sample:
    the rounds recorded by an older wsseg (``train_images`` None, or absent) are kept, and so is a
    larger bound; a bound below the split's size is a change, and the configuration says so too."""
    from wsseg.tasks.config import TRAIN_IMAGES, WSSSConfig, config_difference, recorded_config
    from wsseg.tasks.corpus.resume import round_inputs, round_view, what_changed
    from wsseg.tasks.store import ClassSpec, ImageRecord

    classes = ClassSpec(("cow", "grass"))
    recs = [ImageRecord(image_id=f"img{i}", height=8, width=8, tags=("cow",), sha256=f"{i:064x}", split="train",
                        source=f"/d/img{i}.jpg", has_mask=False) for i in range(6)]
    older = round_inputs(classes, recs, WSSSConfig(train_images=None))
    assert older["config"]["train_images"] is None
    absent = older | {"config": {k: v for k, v in older["config"].items() if k != "train_images"}}
    for limit in (TRAIN_IMAGES, 6, 1000):
        now = round_inputs(classes, recs, WSSSConfig(train_images=limit))
        assert what_changed(round_view(older, 1), round_view(now, 1)) == []
        assert what_changed(round_view(absent, 1), round_view(now, 1)) == []
        assert config_difference(recorded_config(WSSSConfig(train_images=None)), WSSSConfig(train_images=limit),
                                 images=len(recs)) == []
    cut = round_inputs(classes, recs, WSSSConfig(train_images=5))
    assert cut["config"]["train_images"] == 5 and what_changed(round_view(older, 1), round_view(cut, 1))
    assert config_difference(recorded_config(WSSSConfig(train_images=None)), WSSSConfig(train_images=5),
                             images=len(recs)) == ["train_images"]
    assert WSSSConfig().train_images == TRAIN_IMAGES


def test_the_trainers_learn_from_a_sample_and_every_image_is_labelled(tmp_path, tiny_run, cluster, prefect_harness):
    """``train_images=3`` on six images: the image classifier and every round's trainers learn from
    the same three (the classifier's recorded corpus, the rounds' summaries), and each of the six
    images has its labels in every round."""
    import torch

    from wsseg.flows.runtime import on_cluster
    from wsseg.flows.wsss import train_wsss
    from wsseg.tasks.config import WSSSConfig
    from wsseg.tasks.store import Store

    run = shutil.copytree(tiny_run, tmp_path / "run", symlinks=True)
    store = Store(run)
    recs = store.manifest("train")
    assert len(recs) == 6
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        summary = on_cluster(train_wsss, cluster)(str(run), WSSSConfig.model_validate(TINY | {"train_images": 3}),
                                                  cluster)
    finally:
        torch.set_num_threads(threads)
    assert store.model_meta("classifier")["inputs"]["corpus"]["images"] == 3
    rounds = store.finished_rounds()
    assert rounds and all(store.read_round(r)["trained_images"] == 3 for r in rounds)
    assert all(store.pseudo(r, rec.image_id) is not None for r in rounds for rec in recs)
    assert summary["final_round"] in rounds
