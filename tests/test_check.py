"""`wsseg check`: every file of a run directory read and verified against what was recorded when it
was written; each damaged or missing file named with what it holds and what to do; `--repair` then
`wsseg train` gives the undamaged run's labels and model bit for bit; a command that meets a
damaged file says so in one line naming it and `wsseg check`."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import TINY, command_threads, run_outputs

from wsseg.tasks.store import DamagedFileError, Store, packs
from wsseg.tasks.store.check import check_run, visible_damage
from wsseg.tasks.store.checkpoints import DamagedCheckpointError

ROOT = Path(__file__).resolve().parents[1]


def _wsseg(*argv):
    return subprocess.run([sys.executable, "-m", "wsseg", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"))


def _flip(path: Path, at: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if at is None else at] ^= 0x55
    path.write_bytes(bytes(data))


def _pack(group: Path, first: str) -> Path:
    return next((group / "packs").glob(f"{first}.*.pack"))


def _small_run(root: Path, older_corpus: bool = False) -> Store:
    """A run directory written through the store by hand: two images (a pack each, or with
    ``older_corpus`` an array each, as a wsseg before the corpus packs wrote them), a round of two
    one-image shards (packs, markers, a review table, checkpoints), a feature cache."""
    from wsseg.models import build_model
    from wsseg.tasks.store import ClassSpec, ImageRecord, chunked

    store = Store(root)
    rng = np.random.default_rng(0)
    recs = []
    for iid in ("a", "b"):
        image = rng.integers(0, 255, (20, 30, 3), np.uint8)
        if older_corpus:
            group = store.corpus_dir / "images.zarr"
            group.mkdir(parents=True, exist_ok=True)
            (group / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}))
            chunked.write(group / iid, image, {"sha256": iid * 64, "complete": True})
        else:
            store.put_image(iid, image, iid * 64)
        recs.append(ImageRecord(iid, 20, 30, ("cow",), iid * 64, "train", f"{iid}.jpg", False))
    store.write_corpus(recs, ClassSpec(("cow", "grass")))
    store.write_config({"split": "train"})
    for iid in ("a", "b"):
        shard = Store.shard_name([iid])
        with store.packing(shard):
            store.write_prelim(0, iid, rng.random((1, 20, 30)).astype(np.float32), np.array([0]))
            store.write_pseudo(0, iid, rng.integers(0, 2, (20, 30), np.uint8))
            store.put_cached("features", "k", iid * 64, {"edges": rng.random((20, 30)).astype(np.float32)})
        store.mark_shard_done(0, "prelim", shard, {"images": 1})
        store.mark_shard_done(0, "pseudo", shard, {"images": 1})
        store.write_review(0, shard, [{"image_id": iid, "changed": 0.5}])
    torch.manual_seed(0)
    store.write_model("segmenter", build_model("small", 2, in_channels=3, width=8), 0, builder="small",
                      num_classes=2, in_channels=3, options={"width": 8})
    store.write_classifier("proposal_classifier", 0, None)
    store.write_classifier("mil", 0, None)
    store.write_round_inputs(0, {"config": {"split": "train", "mil": {"iterations": 1}}})
    store.write_round(0, {"round": 0, "train_epochs": 2})
    packs.forget()
    return store


def test_each_kind_of_damage_is_named_by_check_and_by_the_reader_that_meets_it(tmp_path):
    store = _small_run(tmp_path / "run")
    res = check_run(store)
    assert res["ok"] and res["damaged"] == [] and res["files"] >= 20 and res["bytes"] > 0

    root = store.root
    pseudo_a = _pack(store.round_dir(0) / "pseudo", "a")
    _flip(pseudo_a)  # a changed byte: the pack's digest and the entry's zstd checksum
    prelim_b = _pack(store.round_dir(0) / "prelim", "b")
    prelim_b.write_bytes(prelim_b.read_bytes()[:-7])  # cut short
    cache_a = _pack(store.cache_dir("features", "k"), "a")
    _flip(cache_a)
    image_b = _pack(store.corpus_dir / "images", "b")
    _flip(image_b)
    model = store.checkpoint_path("segmenter", 0)
    _flip(model)  # a byte of a tensor or the archive: the zip CRC fails
    store.checkpoint_path("mil", 0).unlink()  # a finished round's checkpoint missing
    (store.round_dir(0) / "review" / f"{Store.shard_name(['b'])}.parquet").write_bytes(b"PAR1 cut")
    (root / "config.json").write_text('{"split": ')
    packs.forget()

    # each reader names the file it meets
    for read, path in ((lambda: store.pseudo(0, "a"), pseudo_a), (lambda: store.prelim(0, "b", 2), prelim_b),
                       (lambda: store.cached("features", "k", "a" * 64), cache_a),
                       (lambda: store.image("b"), image_b),
                       (lambda: store.read_model("segmenter", 0), model), (store.read_config, root / "config.json")):
        with pytest.raises(DamagedFileError) as e:
            read()
        msg = str(e.value)
        assert e.value.path == str(path) and msg.startswith(f"{path}: ") and "\n" not in msg
        assert f"`wsseg check --run-dir {root}`" in msg
    with pytest.raises(DamagedCheckpointError):  # a CheckpointError too: its maker computes it again
        store.read_model("segmenter", 0)
    assert np.array_equal(store.pseudo(0, "b"), store.pseudo(0, "b"))  # the undamaged ones still read

    res = check_run(store)
    got = {d["path"]: d for d in res["damaged"]}
    rel = lambda p: Path(p).relative_to(root).as_posix()  # noqa: E731
    review = f"rounds/r000/review/{Store.shard_name(['b'])}.parquet"
    assert set(got) == {rel(pseudo_a), rel(prelim_b), rel(cache_a), rel(image_b), rel(model),
                        "rounds/r000/mil.pt", review, "config.json"}
    assert got[rel(pseudo_a)]["holds"] == "round 0's pseudo-labels of 1 image(s): a"
    assert "digest recorded when it was written" in got[rel(pseudo_a)]["problem"]
    assert got[rel(prelim_b)]["problem"].startswith("damaged: cut short")
    assert got[rel(cache_a)]["holds"].endswith("of 1 image(s): a")
    assert got[rel(image_b)]["holds"] == "the corpus's images of 1 image(s): b"
    assert "digest recorded when it was written" in got[rel(image_b)]["problem"]
    assert "`wsseg ingest SOURCE --run-dir" in got[rel(image_b)]["action"]
    assert "CRC-32" in got[rel(model)]["problem"] and got["rounds/r000/mil.pt"]["problem"] == "missing"
    assert [d["path"] for d in res["from_source"]] == [rel(image_b)] and not res["ok"]
    # what status sees without reading every byte: the records and the checkpoints' presence
    assert {d["path"] for d in visible_damage(store)} == {"config.json", "rounds/r000/mil.pt"}

    res = check_run(store, repair=True)
    assert {d["path"] for d in res["repaired"]} == set(got) - {rel(image_b)}
    assert not pseudo_a.exists() and not prelim_b.exists() and not cache_a.exists() and not model.exists()
    assert image_b.with_name(image_b.name + ".damaged").is_file() and not image_b.exists()
    assert not Store(root).has_image("b", "b" * 64) and Store(root).has_image("a", "a" * 64)
    # the shards of the removed packs are computed again, the round and the run finished again
    assert store.shard_markers(0, "pseudo") == [] and store.shard_markers(0, "prelim") == [
        f"prelim-{Store.shard_name(['a'])}.json"]
    assert not (store.round_dir(0) / "round.json").exists() and store.pseudo(0, "a") is None
    assert not store.has_cached("features", "k", "a" * 64) and store.has_cached("features", "k", "b" * 64)
    res = check_run(store)
    assert [(d["path"], d["problem"], d["holds"]) for d in res["damaged"]] == [("corpus/images/b", "missing",
                                                                                   "image b")]


def test_an_older_run_directorys_corpus_arrays_are_checked(tmp_path):
    """A corpus of one array per image (a wsseg before the corpus packs): each array decoded; a
    damaged one named with its image, moved aside by repair, then missing."""
    store = _small_run(tmp_path / "run", older_corpus=True)
    assert check_run(store)["ok"] and store.image("a").shape == (20, 30, 3)
    chunk = store.corpus_dir / "images.zarr" / "b" / "c" / "0" / "0" / "0"
    _flip(chunk)
    with pytest.raises(DamagedFileError) as e:
        Store(store.root).image("b")
    assert e.value.path == str(chunk)
    res = check_run(store)
    assert [(d["path"], d["holds"]) for d in res["damaged"]] == [("corpus/images.zarr/b/c/0/0/0", "image b")]
    assert [d["path"] for d in res["from_source"]] == ["corpus/images.zarr/b/c/0/0/0"]
    check_run(store, repair=True)
    assert (store.corpus_dir / "images.zarr" / "b.damaged").is_dir() and not Store(store.root).has_image("b", "b" * 64)
    res = check_run(store)
    assert [(d["path"], d["problem"]) for d in res["damaged"]] == [("corpus/images.zarr/b", "missing")]


def test_packs_and_arrays_of_an_older_wsseg_are_checked_as_far_as_they_tell(tmp_path):
    """Packs without digests or zstd checksums (an older wsseg's) are decoded entry by entry: a pack
    cut short is named, and so is an array whose bytes no longer decode."""
    from numcodecs import Zstd

    store = _small_run(tmp_path / "run")
    group = store.round_dir(0) / "pseudo"
    for meta in (group / "packs").glob("*.json"):  # as an older wsseg wrote them
        d = json.loads(meta.read_text())
        data, entries, offset = b"", {}, 0
        for name, (off, length, dt, shape, attrs) in d["entries"].items():
            raw = Zstd(level=0).decode((group / "packs" / d["pack"]).read_bytes()[off:off + length])
            raw = Zstd(level=0).encode(raw)  # a frame without a checksum
            entries[name] = [offset, len(raw), dt, shape, attrs]
            data, offset = data + raw, offset + len(raw)
        (group / "packs" / d["pack"]).write_bytes(data)
        meta.write_text(json.dumps({"pack": d["pack"], "written": d["written"], "bytes": offset,
                                    "entries": entries}))
    packs.forget()
    assert check_run(store)["ok"] and store.pseudo(0, "a").shape == (20, 30)
    cut = _pack(group, "a")
    cut.write_bytes(cut.read_bytes()[:-3])
    res = check_run(store)
    assert [d["path"] for d in res["damaged"]] == [cut.relative_to(store.root).as_posix()]
    assert "cut short" in res["damaged"][0]["problem"]


@pytest.mark.command("check")
def test_check_repair_then_train_gives_the_undamaged_runs_labels_bit_for_bit(tmp_path, tiny_run, tiny_reference,
                                                                            cluster):
    """The tiny run with a flipped byte in a pseudo-label pack, a preliminary-result pack cut short,
    its round's model missing and an image array damaged: `wsseg check` names each (exit 1),
    `wsseg export` and `wsseg status` say so, `--repair` removes the derived ones, `wsseg ingest`
    of the source brings the image back, and `train` ends with every pseudo-label and the model
    weights of the run that was never damaged."""
    from wsseg.flows.runtime import on_cluster
    from wsseg.flows.wsss import ingest, train_wsss
    from wsseg.tasks.config import WSSSConfig

    run = shutil.copytree(tiny_run, tmp_path / "run", symlinks=True, ignore=shutil.ignore_patterns(
        ".prefect", "mlflow.db", "mlartifacts", "dask-scratch", ".wsseg.lock"))
    res = _wsseg("check", "--run-dir", str(run))
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("all is well: ") and f"of {run} read and verified" in res.stdout

    store = Store(run)
    records = store.manifest()
    pseudo = sorted((store.round_dir(0) / "pseudo" / "packs").glob("*.pack"))[0]  # the first shard's labels
    _flip(pseudo)
    prelim = sorted((store.round_dir(0) / "prelim" / "packs").glob("*.pack"))[-1]  # the last shard's
    prelim.write_bytes(prelim.read_bytes()[:len(prelim.read_bytes()) // 2])
    model = store.checkpoint_path("segmenter", 0)
    model.unlink()
    image = records[2].image_id
    chunk = store.corpus_dir / "images" / "packs" / packs.index_of(store.corpus_dir / "images").lookup(image)[0]
    _flip(chunk)  # the pack of the corpus's images that holds it
    damaged = {p.relative_to(run).as_posix() for p in (pseudo, prelim, model, chunk)}

    res = _wsseg("check", "--run-dir", str(run))
    assert res.returncode == 1
    lines = res.stdout.strip().splitlines()
    assert len(lines) == len(damaged) + 1 and "4 damaged or missing" in lines[-1]
    for rel, what in ((pseudo, "round 0's pseudo-labels of 2 image(s)"), (prelim, "round 0's preliminary results"),
                      (model, "round 0's segmentation model"), (chunk, "the corpus's images of ")):
        line = next(x for x in lines if x.startswith(f"{rel}: "))
        assert what in line
    assert "`wsseg ingest SOURCE --run-dir" in next(x for x in lines if x.startswith(f"{chunk}: "))

    # a command meeting a damaged file: one line naming it and `wsseg check`, nothing written
    out = tmp_path / "voc"
    res = _wsseg("export", "--run-dir", str(run), "--out", str(out), "--no-images")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    err = res.stderr.strip().splitlines()[-1]
    assert err.startswith(f"wsseg: error: {pseudo}: damaged") and f"`wsseg check --run-dir {run}`" in err
    assert not out.exists() and not out.with_name("voc.partial").exists()
    res = _wsseg("status", str(run))
    assert res.returncode == 0 and "damaged: rounds/r000/model.pt: missing (round 0's segmentation model)" in \
        res.stdout and f"`wsseg check --run-dir {run}`" in res.stdout

    res = _wsseg("check", "--run-dir", str(run), "--repair", "--json")
    assert res.returncode == 1  # the image is left for the source to bring back
    got = json.loads(res.stdout)
    assert {d["path"] for d in got["damaged"]} == damaged
    assert {d["path"] for d in got["repaired"]} == damaged - {chunk.relative_to(run).as_posix()}
    assert [d["path"] for d in got["from_source"]] == [chunk.relative_to(run).as_posix()]

    on_cluster(ingest, cluster)(str(tiny_run.parent / "src"), str(run), shard_size=8)
    assert check_run(store)["ok"]
    before = torch.get_num_threads()  # as tiny_run trained: a command's thread count
    torch.set_num_threads(command_threads(dict(os.environ, OMP_WAIT_POLICY="PASSIVE")))
    try:
        on_cluster(train_wsss, cluster)(str(run), WSSSConfig.model_validate(TINY), cluster)
    finally:
        torch.set_num_threads(before)
    got = run_outputs(run)
    assert got.keys() == tiny_reference.keys() and all(got[k] == tiny_reference[k] for k in tiny_reference)
    res = _wsseg("check", "--run-dir", str(run))
    assert res.returncode == 0 and res.stdout.startswith("all is well")


def test_train_computes_a_damaged_pack_again_without_being_asked(tmp_path, tiny_run, tiny_reference):
    """`wsseg train` that meets a damaged pack (round 0's model is missing, so its training reads the
    round's labels, one pack of which has a flipped byte) says so, removes the damaged derived data
    as `check --repair` would, computes it again and ends with the undamaged run's labels and model
    bit for bit; a plain `train` resumes with the run's own (tiny) configuration."""
    run = shutil.copytree(tiny_run, tmp_path / "run", symlinks=True, ignore=shutil.ignore_patterns(
        ".prefect", "mlflow.db", "mlartifacts", "dask-scratch", ".wsseg.lock"))
    store = Store(run)
    pseudo = sorted((store.round_dir(0) / "pseudo" / "packs").glob("*.pack"))[0]
    _flip(pseudo)
    store.checkpoint_path("segmenter", 0).unlink()
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    env.pop("PREFECT_API_URL", None)
    res = subprocess.run([sys.executable, "-m", "wsseg", "train", "--run-dir", str(run)], cwd=ROOT,
                         capture_output=True, text=True, timeout=1200, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"{pseudo}: damaged" in res.stderr and "computing the damaged derived data again" in res.stderr
    got = run_outputs(run)
    assert got.keys() == tiny_reference.keys() and all(got[k] == tiny_reference[k] for k in tiny_reference)
    assert check_run(store)["ok"]
