"""Incremental refresh and resume keyed by content, on real images under prefect_test_harness.

* The reported bug: after re-ingesting a corpus with another class list into the same run
  directory, `train` reused the 8-class classifier and round on the 21-class corpus. Now it
  says what changed, recomputes, and ends with what a fresh run directory gives.
* `ingest` again on a grown and changed source decodes only the new and changed images, and
  `refresh` labels them with the last round's models, as the round itself would have, without
  training anything.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import SAMPLE, copy_sample

FULL = (SAMPLE / "classes.txt").read_text().split()
FIRST = ["12_25_s", "12_27_s", "12_33_s", "12_6_s", "1_10_s", "1_29_s", "2_18_s", "18_20_s"]
MORE = ["14_13_s", "15_14_s", "16_19_s", "8_16_s"]  # chair, cat, dog, bicycle, road: not among FIRST's
TINY = {"classifier": {"epochs": 4, "size": 160, "width": 16, "stride": 16, "batch_size": 8},
        "mil": {"iterations": 1}, "proposals": {"epochs": 5},
        "segmentation": {"epochs": 2, "min_steps": 8, "crop": 160, "batch_size": 4,
                         "num_workers": 0},
        "max_rounds": 1, "shard_size": 4}


def _fewer_classes(src: Path) -> list[str]:
    """Make ``src`` a source with only the classes its images are tagged with (classes.txt in the
    full list's order, masks re-indexed, other classes void)."""
    tags = {t for line in (src / "labels.csv").read_text().splitlines()[1:] for t in line.split(",")[2].split(";")}
    names = [c for c in FULL if c in tags]
    (src / "classes.txt").write_text("\n".join(names) + "\n")
    lut = np.full(256, 255, np.uint8)
    for i, c in enumerate(FULL):
        if c in names:
            lut[i] = names.index(c)
    for m in (src / "masks").glob("*.png"):
        Image.fromarray(lut[np.asarray(Image.open(m))]).save(m)
    return names


def _config():
    from wsseg.tasks.config import WSSSConfig

    return WSSSConfig.model_validate(TINY)


def _train(run: Path, config=None) -> dict:
    from wsseg.flows.wsss import train_wsss

    return train_wsss(str(run), config or _config())


def test_another_class_list_recomputes_and_equals_a_fresh_run(tmp_path, prefect_harness, one_torch_thread, capfd):
    from wsseg.flows.wsss import ingest
    from wsseg.tasks.store import Store

    small = copy_sample(tmp_path / "small", FIRST)
    names = _fewer_classes(small)
    assert len(names) == 8
    big = copy_sample(tmp_path / "big", FIRST + MORE)
    run, fresh = tmp_path / "run", tmp_path / "fresh"

    ingest(str(small), str(run))
    first = _train(run)
    assert Store(run).classes().n == 8 and first["rounds"][-1]["round"] == 0
    capfd.readouterr()

    # the same run directory, a corpus with 21 classes and 4 more images
    s = ingest(str(big), str(run))
    assert s["changes"]["classes"] == {"before": names, "now": FULL}
    assert s["changes"]["added"] == 4 and s["changes"]["unchanged"] == 8 and s["changes"]["decoded"] == 4
    again = _train(run)
    said = capfd.readouterr().err
    print(said)
    assert "classifier.pt: the class list (8 -> 21 classes; added" in said and "training again" in said
    assert "the class list (8 -> 21 classes" in said and "round(s) 0 are computed again" in said
    assert "the corpus content (8 -> 12 images" in said

    ingest(str(big), str(fresh))
    ref = _train(fresh)
    a, b = Store(run), Store(fresh)
    assert a.model_meta("classifier")["inputs"] == b.model_meta("classifier")["inputs"]
    assert a.model_meta("segmenter", 0)["classes"] == FULL
    for rec in b.manifest():
        assert np.array_equal(a.pseudo(0, rec.image_id), b.pseudo(0, rec.image_id)), rec.image_id
    miou = [r["pseudo_label_miou"] for r in again["rounds"]]
    assert miou == [r["pseudo_label_miou"] for r in ref["rounds"]] and all(m is not None for m in miou)
    assert a.round_inputs(0) == b.round_inputs(0)

    # the same inputs again: nothing is recomputed
    stamp = (run / "rounds" / "r000" / "round.json").stat().st_mtime_ns
    cls_stamp = (run / "classifier.pt").stat().st_mtime_ns
    _train(run)
    assert (run / "rounds" / "r000" / "round.json").stat().st_mtime_ns == stamp
    capfd.readouterr()

    # another configuration of the rounds' model: it is trained again; the classifier and round 0's
    # pseudo-labels (which do not depend on it) are kept, not one shard of them computed again
    def stamps(stage: str) -> dict[str, int]:
        return {p.name: p.stat().st_mtime_ns for p in (run / "rounds" / "r000" / "done").glob(f"{stage}-*.json")}

    labels_stamp, prelim_stamp = stamps("pseudo"), stamps("prelim")
    model_stamp = (run / "rounds" / "r000" / "model.pt").stat().st_mtime_ns
    cfg = _config().model_copy(update={"segmentation": _config().segmentation.model_copy(update={"epochs": 3})})
    _train(run, cfg)
    said = capfd.readouterr().err
    assert ("the configuration (differs in: segmentation) changed since round 0 was computed: its pseudo-labels "
            "do not depend on it and are kept; its model is computed again") in said
    assert (run / "classifier.pt").stat().st_mtime_ns == cls_stamp
    assert stamps("pseudo") == labels_stamp and stamps("prelim") == prelim_stamp and labels_stamp
    assert (run / "rounds" / "r000" / "model.pt").stat().st_mtime_ns != model_stamp
    assert (run / "rounds" / "r000" / "round.json").stat().st_mtime_ns != stamp
    assert Store(run).model_meta("segmenter", 0)["epochs_run"] == 3
    assert json.loads((run / "config.json").read_text())["segmentation"]["epochs"] == 3
    model_stamp = (run / "rounds" / "r000" / "model.pt").stat().st_mtime_ns

    # the run taken further: round 0 (the budget's last round before) is decided again and round 1 runs
    further = _train(run, cfg.model_copy(update={"max_rounds": 2}))
    said = capfd.readouterr().err
    # (round 0's model is the same as the last round or not: kept)
    assert "the round budget is 2 now: round 0 is no longer the last; its labels and model are kept" in said
    assert (run / "rounds" / "r000" / "model.pt").stat().st_mtime_ns == model_stamp
    assert [r["round"] for r in further["rounds"] if r["round"] != "cam"] == [0, 1]
    assert stamps("pseudo") == labels_stamp and Store(run).finished_rounds() == [0, 1]



def _mtimes(run: Path, ids: list[str]) -> dict[str, tuple]:
    """Where each image lies (its pack, offset) and when that pack was written: what a rewrite changes."""
    from wsseg.tasks.store import packs

    group = run / "corpus" / "images"
    packs.forget(group)
    out = {}
    for i in ids:
        pack, offset = packs.index_of(group).lookup(i)[:2]
        out[i] = (pack, offset, (group / "packs" / pack).stat().st_mtime_ns)
    return out


def _corpus_files(run: Path) -> dict[str, bytes]:
    corpus = run / "corpus"
    return {str(p.relative_to(corpus)): p.read_bytes() for p in sorted(corpus.rglob("*")) if p.is_file()}


def test_ingest_again_and_refresh_label_only_what_is_new(tmp_path, prefect_harness, one_torch_thread):
    from wsseg.flows.wsss import evaluate, ingest, refresh
    from wsseg.tasks.report.status import run_status
    from wsseg.tasks.store import Store

    src = copy_sample(tmp_path / "src", FIRST)
    run = tmp_path / "run"
    first = ingest(str(src), str(run))
    assert first["changes"]["added"] == len(FIRST) and first["changes"]["unchanged"] == 0
    # a first ingest adds every image: its report lists no ids (10^7 of them would be the report)
    assert json.loads((run / "corpus" / "ingest_report.json").read_text())["changed_images"] == {}
    _train(run)
    store = Store(run)
    model_stamp = (run / "rounds" / "r000" / "model.pt").stat().st_mtime_ns
    before = {i: store.pseudo(0, i) for i in FIRST}
    kept = [i for i in FIRST if i not in ("12_27_s", "2_18_s")]
    stamps = _mtimes(run, kept)

    # the source grows by two images, loses one, one image is re-encoded (other bytes) and one retagged
    extra = copy_sample(tmp_path / "extra", ["9_17_s", "5_26_s"])
    for f in ("images", "masks"):
        for p in (extra / f).iterdir():
            shutil.copy(p, src / f)
    lines = (src / "labels.csv").read_text().splitlines()
    lines = [ln for ln in lines if not ln.startswith("2_18_s,")] + (extra / "labels.csv").read_text().splitlines()[1:]
    lines = [ln.replace("1_29_s,train,grass;sheep", "1_29_s,train,sheep") for ln in lines]
    (src / "labels.csv").write_text("\n".join(lines) + "\n")
    (src / "images" / "2_18_s.jpg").unlink()
    (src / "masks" / "2_18_s.png").unlink()
    Image.open(src / "images" / "12_27_s.jpg").save(src / "images" / "12_27_s.jpg", quality=80)

    s = ingest(str(src), str(run))
    assert {k: s["changes"][k] for k in ("added", "removed", "changed", "retagged", "unchanged", "decoded")} == \
        {"added": 2, "removed": 1, "changed": 1, "retagged": 1, "unchanged": 5, "decoded": 3}
    report = json.loads((run / "corpus" / "ingest_report.json").read_text())
    assert report["changed_images"] == {"added": ["9_17_s", "5_26_s"], "removed": ["2_18_s"],
                                        "changed": ["12_27_s"], "retagged": ["1_29_s"]}
    assert _mtimes(run, kept) == stamps  # unchanged images: not decoded, not rewritten
    assert not Store(run).has_stored_image("2_18_s") and Store(run).mask("2_18_s") is None
    for i in ("12_27_s", "1_29_s", "2_18_s"):  # stale labels are gone from the round
        assert not store.has_pseudo(0, i)
    st = run_status(store)
    assert st["refresh_pending"] == {"round": 0, "images": 4}

    # refresh: the new, changed and retagged images get round 0's labels, nothing is trained
    out = refresh(str(run))
    assert out["round"] == 0 and out["labelled"] == 4 and out["images"] == 9
    assert out["pseudo_label_miou"] is not None and out["core_ms_per_image"] > 0
    assert (run / "rounds" / "r000" / "model.pt").stat().st_mtime_ns == model_stamp
    for i in kept:
        if i != "1_29_s":  # retagged: labelled again
            assert np.array_equal(store.pseudo(0, i), before[i])  # the others keep theirs
    for rec in store.manifest():
        lab = store.pseudo(0, rec.image_id)
        assert lab.shape == (rec.height, rec.width)
        assert set(np.unique(lab).tolist()) <= {store.classes().index(t) for t in rec.tags} | {255}
    st = run_status(store)
    assert st["refresh_pending"] is None and st["refresh"]["labelled"] == 4
    assert evaluate(str(run))["miou"] > 0  # the round's labels, the refreshed ones among them

    # refreshing an image gives it the label the round gave it (same models, same functions)
    store.drop_labels(["12_25_s"])
    assert refresh(str(run))["labelled"] == 1
    assert np.array_equal(store.pseudo(0, "12_25_s"), before["12_25_s"])
    assert refresh(str(run))["labelled"] == 0  # nothing left: resumes, does nothing


def test_refresh_refuses_another_class_list(tmp_path, prefect_harness):
    from wsseg.flows.wsss import refresh
    from wsseg.tasks.corpus.resume import classes_entry, round_inputs
    from wsseg.tasks.store import ClassSpec, ImageRecord, Store

    store = Store(tmp_path / "run")
    recs = [ImageRecord("a", 4, 4, ("x",), "0" * 64, "train", "a.jpg", False)]
    store.write_corpus(recs, ClassSpec(("x", "y", "z")))
    store.write_config(_config().model_dump(mode="json"))
    store.write_round_inputs(0, dict(round_inputs(ClassSpec(("x", "y")), recs, _config())))
    store.write_round(0, {"round": 0})
    assert store.round_inputs(0)["classes"] == classes_entry(ClassSpec(("x", "y")))
    with pytest.raises(ValueError, match=r"class list changed since round 0 was trained \(2 -> 3 classes\).*"
                                         r"run `wsseg train`"):
        refresh(str(store.root))


def test_a_refused_ingest_again_keeps_the_stored_images(tmp_path, prefect_harness):
    """An ingest again that is refused (one unreadable new image) changes nothing: the image it
    re-read (other bytes) keeps its stored array, mask and manifest row; accepted, the new
    array replaces it."""
    from wsseg.flows.wsss import ingest
    from wsseg.tasks.corpus.ingest import IngestError, decode_image
    from wsseg.tasks.store import Store

    ids = ["12_25_s", "12_27_s", "1_10_s"]
    src = copy_sample(tmp_path / "src", ids)
    run = tmp_path / "run"
    ingest(str(src), str(run), shard_size=2)
    store = Store(run)
    old = {i: (store.image(i), store.mask(i)) for i in ids}
    manifest, files = store.manifest(), _corpus_files(run)
    # one image re-encoded (other pixels), one new image that cannot be read
    Image.open(src / "images" / "12_27_s.jpg").save(src / "images" / "12_27_s.jpg", quality=40)
    shutil.copy(src / "images" / "12_25_s.jpg", src / "images" / "zz_new.jpg")
    bad = np.asarray(Image.open(src / "masks" / "12_25_s.png")).copy()
    bad[:4, :4] = 200  # no class has index 200 (and it is not void, 255): found when the shard reads it
    Image.fromarray(bad).save(src / "masks" / "zz_new.png")
    (src / "labels.csv").write_text((src / "labels.csv").read_text() + "zz_new,train,grass\n")
    with pytest.raises(IngestError, match=r"zz_new\.png"):
        ingest(str(src), str(run), shard_size=2)
    assert store.manifest() == manifest
    for i in ids:
        assert np.array_equal(store.image(i), old[i][0]) and np.array_equal(store.mask(i), old[i][1]), i
    assert _corpus_files(run) == files  # every file of the corpus as it was, none added
    assert not Store(run).has_stored_image("zz_new")
    # the source fixed: the re-encoded image replaces the stored one
    (src / "images" / "zz_new.jpg").unlink()
    (src / "masks" / "zz_new.png").unlink()
    (src / "labels.csv").write_text((src / "labels.csv").read_text().replace("zz_new,train,grass\n", ""))
    s = ingest(str(src), str(run), shard_size=2)
    assert s["changes"]["changed"] == 1 and s["changes"]["decoded"] == 1
    new = decode_image(src / "images" / "12_27_s.jpg")[0]
    assert np.array_equal(store.image("12_27_s"), new) and not np.array_equal(new, old["12_27_s"][0])
    assert np.array_equal(store.mask("12_27_s"), old["12_27_s"][1])
    assert not (run / "corpus" / Store.STAGING).exists()


def _as_older_corpus(run: Path) -> None:
    """Rewrite ``run``'s corpus as a wsseg before the corpus packs wrote it: one single-chunk
    array per image and mask (``images.zarr/<id>``, ``masks.zarr/<id>``), the same attributes."""
    from wsseg.tasks.store import Store, chunked, packs

    store = Store(run)
    for kind in ("images", "masks"):
        legacy = run / "corpus" / f"{kind}.zarr"
        legacy.mkdir()
        (legacy / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}))
        for rec in store.manifest():
            got = (store.image(rec.image_id) if kind == "images" else store.mask(rec.image_id))
            if got is not None:
                attrs = store._corpus_entry(kind, rec.image_id)[1]
                chunked.write(legacy / rec.image_id, got, {**attrs, "complete": True})
        shutil.rmtree(run / "corpus" / kind)
        packs.forget(run / "corpus" / kind)
    store.record_corpus_usage()


def test_an_older_run_directorys_corpus_reads_and_takes_a_changed_image_as_a_pack(tmp_path, prefect_harness):
    """A corpus of one array per image (an older wsseg's) reads as it did; an ingest again writes
    the changed image (and its mask) as packs beside it, which win, removes the removed image's
    arrays and the changed one's old ones, and leaves the unchanged images' arrays as they are."""
    from wsseg.flows.wsss import ingest
    from wsseg.tasks.corpus.ingest import decode_image
    from wsseg.tasks.store import Store
    from wsseg.tasks.store.check import check_run

    ids = ["12_25_s", "12_27_s", "1_10_s"]
    src = copy_sample(tmp_path / "src", ids)
    run = tmp_path / "run"
    ingest(str(src), str(run), shard_size=2)
    before = {i: (Store(run).image(i), Store(run).mask(i)) for i in ids}
    _as_older_corpus(run)
    assert not (run / "corpus" / "images").exists() and (run / "corpus" / "images.zarr" / "12_25_s").is_dir()
    store = Store(run)
    for rec in store.manifest():
        i = rec.image_id
        assert np.array_equal(store.image(i), before[i][0]) and np.array_equal(store.mask(i), before[i][1])
        assert store.has_image(i, rec.sha256) and store.image_shape(i) == before[i][0].shape
        assert store.has_stored_mask(i, json.loads((run / "corpus" / "masks.zarr" / i / "zarr.json").read_text())
                                     ["attributes"]["sha256"])
    assert check_run(store)["ok"]

    # one image re-encoded (other pixels), one removed from the source
    Image.open(src / "images" / "12_27_s.jpg").save(src / "images" / "12_27_s.jpg", quality=40)
    (src / "images" / "1_10_s.jpg").unlink()
    (src / "masks" / "1_10_s.png").unlink()
    (src / "labels.csv").write_text("".join(ln for ln in (src / "labels.csv").read_text().splitlines(True)
                                            if not ln.startswith("1_10_s,")))
    s = ingest(str(src), str(run), shard_size=2)
    assert {k: s["changes"][k] for k in ("changed", "removed", "unchanged", "decoded")} == \
        {"changed": 1, "removed": 1, "unchanged": 1, "decoded": 1}
    store = Store(run)
    new = decode_image(src / "images" / "12_27_s.jpg")[0]
    assert np.array_equal(store.image("12_27_s"), new) and not np.array_equal(new, before["12_27_s"][0])
    assert np.array_equal(store.mask("12_27_s"), before["12_27_s"][1])
    assert np.array_equal(store.image("12_25_s"), before["12_25_s"][0])
    assert not store.has_stored_image("1_10_s") and store.mask("1_10_s") is None
    corpus = run / "corpus"
    assert sorted(p.name for p in (corpus / "images.zarr").iterdir()) == ["12_25_s", "zarr.json"]
    assert sorted(p.name for p in (corpus / "masks.zarr").iterdir()) == ["12_25_s", "zarr.json"]
    assert len(list((corpus / "images" / "packs").glob("*.pack"))) == 1
    assert check_run(store)["ok"]
    files = [p for p in corpus.rglob("*") if p.is_file() and p.name != "usage.json"]
    assert json.loads((corpus / "usage.json").read_text())["files"] == len(files)


def test_refresh_of_a_later_round_first_gives_the_image_its_round_0_label(tmp_path, prefect_harness, one_torch_thread):
    """Rounds >= 1 mix round 0's pseudo-label into their preliminary result (since
    the option prior_source went, always): refreshing an image with round 1's models computes its round-0 label
    first, and both equal what the rounds gave it."""
    from wsseg.flows.wsss import ingest, refresh
    from wsseg.tasks.config import WSSSConfig
    from wsseg.tasks.store import Store

    src = copy_sample(tmp_path / "src", FIRST)
    run = tmp_path / "run"
    ingest(str(src), str(run))
    config = WSSSConfig.model_validate({**TINY, "max_rounds": 2, "stopping": "budget"})
    assert config.prior_weight > 0
    _train(run, config)
    store = Store(run)
    assert store.finished_rounds() == [0, 1]
    before = {r: store.pseudo(r, "12_25_s") for r in (0, 1)}
    store.drop_labels(["12_25_s"])
    assert not store.has_pseudo(0, "12_25_s") and not store.has_pseudo(1, "12_25_s")
    out = refresh(str(run))
    assert out["round"] == 1 and out["labelled"] == 1
    for r in (0, 1):
        assert np.array_equal(store.pseudo(r, "12_25_s"), before[r]), r


def test_an_option_of_the_later_rounds_keeps_round_0_whole(tmp_path, prefect_harness, one_torch_thread, capfd):
    """prior_weight acts on the preliminary result of rounds >= 1 only: a run resumed with another
    value computes round 1 again and keeps round 0 (its labels, its model and its record)."""
    from wsseg.flows.wsss import ingest
    from wsseg.tasks.config import WSSSConfig
    from wsseg.tasks.store import Store

    src = copy_sample(tmp_path / "src", FIRST)
    run = tmp_path / "run"
    ingest(str(src), str(run))
    config = WSSSConfig.model_validate({**TINY, "max_rounds": 2, "stopping": "budget"})
    _train(run, config)
    r0 = {name: (run / "rounds" / "r000" / name).stat().st_mtime_ns for name in ("round.json", "model.pt")}
    r1 = (run / "rounds" / "r001" / "round.json").stat().st_mtime_ns
    capfd.readouterr()
    again = _train(run, config.model_copy(update={"prior_weight": 0.3}))
    said = capfd.readouterr().err
    assert "the configuration (differs in: prior_weight) changed since round 1 was computed: round(s) 1" in said
    assert "since round 0" not in said
    assert {name: (run / "rounds" / "r000" / name).stat().st_mtime_ns for name in r0} == r0
    assert (run / "rounds" / "r001" / "round.json").stat().st_mtime_ns != r1
    assert Store(run).finished_rounds() == [0, 1] and [r["round"] for r in again["rounds"] if r["round"] != "cam"] == [0, 1]


def test_another_stopping_rule_decides_the_finished_rounds_again(tmp_path, prefect_harness, one_torch_thread, capfd):
    """The stopping rule (epsilon, stopping) acts only on the decision after each round: a run
    resumed with another rule takes each finished round's decision again from its record. Where it
    stands the round is kept whole, model included; where it changes, the round keeps its labels
    and trains its model for the new decision, and the rounds after it go."""
    from wsseg.flows.wsss import ingest
    from wsseg.tasks.config import WSSSConfig
    from wsseg.tasks.store import Store

    src = copy_sample(tmp_path / "src", FIRST)
    run = tmp_path / "run"
    ingest(str(src), str(run))
    config = WSSSConfig.model_validate({**TINY, "max_rounds": 3, "stopping": "budget", "epsilon": 0.0})
    _train(run, config)
    store = Store(run)
    assert store.finished_rounds() == [0, 1, 2]

    def stamps(r: int) -> dict[str, int]:
        return {p.name: p.stat().st_mtime_ns for p in (run / "rounds" / f"r{r:03d}").rglob("*")
                if p.is_file() and p.name not in ("inputs.json", "round.json", "overlay.png")}  # records, a picture

    before = {r: stamps(r) for r in (0, 1, 2)}
    assert store.model_meta("segmenter", 1)["trained_on"]["init_round"] == 0  # fine-tuned from round 0's

    def weights(r: int) -> float:  # the class weights a round's model was trained with
        return store.model_meta("segmenter", r)["trained_on"]["segmentation"]["class_balance"]

    # the rounds' own segmenters unweighted, the final model weighted (the defaults)
    seg = config.segmentation
    assert (weights(0), weights(1), weights(2)) == (seg.rounds_class_balance, seg.rounds_class_balance,
                                                     seg.class_balance) and seg.class_balance != seg.rounds_class_balance
    capfd.readouterr()
    # epsilon above 1: every round from 1 on has converged (less than all of its pixels changed)
    out = _train(run, config.model_copy(update={"epsilon": 1.5}))
    said = capfd.readouterr().err
    assert "changed since round 0 was computed: its decision stands (the rounds go on); its labels and model are " \
           "kept" in said
    assert "changed since round 1 was computed: its pseudo-labels do not depend on it and are kept; its model " \
           "and round(s) 2 are computed again" in said
    assert stamps(0) == before[0]  # round 0 whole, its model included
    after = stamps(1)
    assert {k: v for k, v in after.items() if "model" not in k} == {k: v for k, v in before[1].items()
                                                                   if "model" not in k}
    assert after["model.pt"] != before[1]["model.pt"]
    # round 1 is final now: its model is the final one, the whole budget of two rounds from the start
    assert store.finished_rounds() == [0, 1] and out["final_round"] == 1 and out["converged"]
    recipe = store.model_meta("segmenter", 1)["trained_on"]
    assert recipe["init_round"] is None and recipe["segmentation"]["epochs"] == 2 * config.segmentation.epochs
    assert weights(1) == seg.class_balance
    assert store.read_round(1)["stop_reason"].startswith("converged")

    # another epsilon above 1: the same decisions, nothing trained again
    capfd.readouterr()
    kept = {r: stamps(r) for r in (0, 1)}
    again = _train(run, config.model_copy(update={"epsilon": 2.0}))
    said = capfd.readouterr().err
    assert "its decision stands (converged: round 1 changed" in said
    assert not [line for line in said.splitlines() if line.strip().startswith("[r") and "computed again" in line]
    assert {r: stamps(r) for r in (0, 1)} == kept and again["final_round"] == 1
    assert "epsilon 2.0" in store.read_round(1)["stop_reason"]

    # and back to epsilon 0: round 1 no longer stops, so its model is the fine-tuned one again and round 2 runs
    back = _train(run, config)
    said = capfd.readouterr().err
    assert "changed since round 0 was computed: its decision stands" in said
    assert "changed since round 1 was computed: its pseudo-labels do not depend on it and are kept" in said
    assert store.finished_rounds() == [0, 1, 2] and back["final_round"] == 2
    assert store.model_meta("segmenter", 1)["trained_on"]["init_round"] == 0 and weights(1) == seg.rounds_class_balance

    # what only the final model reads (its class weights, its label boundaries' band): every round
    # before the last is kept whole; the last keeps its labels and trains its model again
    capfd.readouterr()
    kept = {r: stamps(r) for r in (0, 1, 2)}
    final_seg = seg.model_copy(update={"class_balance": 0.25, "boundary_ignore": seg.boundary_ignore + 2})
    tuned = _train(run, config.model_copy(update={"segmentation": final_seg}))
    said = capfd.readouterr().err
    for r in (0, 1):
        assert f"changed since round {r} was computed: it acts on the final model only; this round is kept" in said
        assert stamps(r) == kept[r]
    assert "changed since round 2 was computed: its pseudo-labels do not depend on it and are kept; its model is " \
           "computed again" in said
    after = stamps(2)
    assert {k: v for k, v in after.items() if "model" not in k} == {k: v for k, v in kept[2].items()
                                                                   if "model" not in k}
    assert after["model.pt"] != kept[2]["model.pt"] and tuned["final_round"] == 2
    final_recipe = store.model_meta("segmenter", 2)["trained_on"]["segmentation"]
    assert (final_recipe["class_balance"], final_recipe["boundary_ignore"]) == (0.25, seg.boundary_ignore + 2)
    assert "boundary_ignore" not in store.model_meta("segmenter", 1)["trained_on"]["segmentation"]  # a round's: no band


def test_another_background_score_computes_round_0_again_with_the_same_classifier(tmp_path, prefect_harness,
                                                                                   one_torch_thread, capfd):
    """How the CAMs are read (scope CAM_READING of tasks.config.OPTIONS: here the implicit background's
    score, classifier.background_threshold) is not how the classifier was trained: a run resumed with
    a higher score keeps classifier.pt and computes round 0 again, whose CAM labels then leave at least
    as much background on every image (the background's score rose everywhere), and more on some."""
    from wsseg.flows.wsss import ingest
    from wsseg.tasks.store import Store

    src = copy_sample(tmp_path / "src", FIRST)
    rows = (src / "labels.csv").read_text().splitlines()
    (src / "labels.csv").write_text("\n".join(rows[:1] + [  # grass untagged, the implicit background: 1-2 objects
        ",".join(r.split(",")[:2] + [";".join(t for t in r.split(",")[2].split(";") if t != "grass")])
        for r in rows[1:]]) + "\n")
    run = tmp_path / "run"
    ingest(str(src), str(run), background="grass")
    config = _config()
    _train(run, config)
    store = Store(run)
    classes = store.classes()
    stamp = (run / "classifier.pt").stat().st_mtime_ns
    before = {r.image_id: store.pseudo(0, r.image_id, "cam") for r in store.manifest("train")}
    capfd.readouterr()
    higher = config.classifier.background_threshold + 0.25
    _train(run, config.model_copy(update={"classifier": config.classifier.model_copy(
        update={"background_threshold": higher})}))
    said = capfd.readouterr().err
    assert "training again" not in said and (run / "classifier.pt").stat().st_mtime_ns == stamp
    assert "differs in: classifier" in said
    more = 0
    for rec in store.manifest("train"):
        after = store.pseudo(0, rec.image_id, "cam")
        was = before[rec.image_id] == classes.background
        assert (after[was] == classes.background).all()
        more += np.mean(after == classes.background) > np.mean(was)
    assert more >= 1
