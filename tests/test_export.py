"""wsseg export: a finished run's labels read back by the tools users load them with (pycocotools
for the COCO file; the VOC layout read the way torchvision's VOCSegmentation reads it), equal to
the stored labels pixel for pixel; and refusals in one line that write nothing."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]


def _wsseg(*argv):
    return subprocess.run([sys.executable, "-m", "wsseg", "export", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def _stored(run: Path, r: int) -> dict[str, np.ndarray]:
    from wsseg.tasks.store import Store

    store = Store(run)
    return {rec.image_id: store.pseudo(r, rec.image_id) for rec in store.manifest()}


@pytest.mark.command("export")
def test_coco_and_voc_exports_read_back_equal_the_stored_labels(tmp_path, tiny_run):
    from pycocotools.coco import COCO

    from wsseg.tasks.store import Store, params_key

    store = Store(tiny_run)
    final = store.read_summary()["final_round"]
    labels = _stored(tiny_run, final)
    digest = params_key(store.read_config())

    res = _wsseg("--run-dir", str(tiny_run), "--format", "coco", "--out", str(tmp_path / "coco"))
    assert res.returncode == 0, res.stderr
    assert f"exported round {final}'s labels of {len(labels)} images" in res.stdout and digest in res.stdout
    coco = COCO(str(tmp_path / "coco" / "labels.json"))
    info = json.loads((tmp_path / "coco" / "labels.json").read_text())["info"]
    assert info["round"] == final and info["config_digest"] == digest
    assert [c["name"] for c in coco.loadCats(coco.getCatIds())] == list(store.classes().names)
    assert len(coco.getImgIds()) == len(labels)
    for img in coco.loadImgs(coco.getImgIds()):
        want = labels[img["wsseg_image_id"]]
        assert (img["height"], img["width"]) == want.shape
        assert (tmp_path / "coco" / "images" / img["file_name"]).is_file()
        got = np.full(want.shape, 255, np.uint8)
        anns = coco.loadAnns(coco.getAnnIds(imgIds=[img["id"]]))
        assert sorted(a["category_id"] - 1 for a in anns) == sorted(set(np.unique(want).tolist()) - {255})
        for a in anns:
            m = coco.annToMask(a).astype(bool)
            c = a["category_id"] - 1
            assert np.array_equal(m, want == c), (img["wsseg_image_id"], c)
            assert a["area"] == int(m.sum())
            ys, xs = np.nonzero(m)
            assert a["bbox"] == [xs.min(), ys.min(), xs.max() - xs.min() + 1, ys.max() - ys.min() + 1]
            got[m] = c
        assert np.array_equal(got, want)  # every labelled pixel in exactly one annotation, ignore in none

    res = _wsseg("--run-dir", str(tiny_run), "--out", str(tmp_path / "voc"))
    assert res.returncode == 0, res.stderr
    voc = tmp_path / "voc" / "VOCdevkit" / "VOC2012"  # torchvision: VOCSegmentation(tmp_path / "voc", "2012", ...)
    ids = (voc / "ImageSets" / "Segmentation" / "trainval.txt").read_text().split()
    assert sorted(ids) == sorted(labels)
    assert (voc / "ImageSets" / "Segmentation" / "train.txt").read_text().split() == ids
    for i in ids:  # as torchvision's reader: Image.open of the JPEG and of the palette PNG
        target = Image.open(voc / "SegmentationClass" / f"{i}.png")
        assert target.mode == "P"
        assert np.array_equal(np.asarray(target), labels[i])
        assert Image.open(voc / "JPEGImages" / f"{i}.jpg").convert("RGB").size == labels[i].shape[::-1]
    assert (voc / "classes.txt").read_text().split() == list(store.classes().names)
    meta = json.loads((tmp_path / "voc" / "export.json").read_text())
    assert meta["round"] == final and meta["config_digest"] == digest and meta["images"] == len(labels)
    assert not (tmp_path / "voc.partial").exists()


def test_refusals_are_one_line_and_write_nothing(tmp_path, tiny_run):
    # a round that does not exist
    res = _wsseg("--run-dir", str(tiny_run), "--round", "7", "--out", str(tmp_path / "a"))
    assert res.returncode == 2 and res.stderr.strip().splitlines()[-1] == \
        f"wsseg: error: {tiny_run}: round 7 has no finished labels (finished rounds: 0)"
    assert not (tmp_path / "a").exists() and not (tmp_path / "a.partial").exists()
    # a run whose training has not finished: no round is final yet, a finished round can still go out
    unfinished = tmp_path / "unfinished"
    shutil.copytree(tiny_run, unfinished, ignore=shutil.ignore_patterns(".prefect", "mlflow.db", "dask-scratch"))
    (unfinished / "summary.json").unlink()
    res = _wsseg("--run-dir", str(unfinished), "--out", str(tmp_path / "b"))
    assert res.returncode == 2
    [line] = [x for x in res.stderr.splitlines() if x.startswith("wsseg: error:")]
    assert "the run has not finished (no summary.json)" in line and "--round N" in line
    assert not (tmp_path / "b").exists()
    assert _wsseg("--run-dir", str(unfinished), "--round", "0", "--out", str(tmp_path / "b"),
                  "--no-images").returncode == 0
    assert not (tmp_path / "b" / "VOCdevkit" / "VOC2012" / "JPEGImages").exists()
    # a folder of the user's is never written over; an earlier export only with --force
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    res = _wsseg("--run-dir", str(tiny_run), "--out", str(tmp_path / "mine"))
    assert res.returncode == 2 and "is not an earlier export" in res.stderr
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    res = _wsseg("--run-dir", str(unfinished), "--round", "0", "--out", str(tmp_path / "b"), "--format", "coco")
    assert res.returncode == 2 and "holds an earlier export; --force replaces it" in res.stderr
    assert _wsseg("--run-dir", str(unfinished), "--round", "0", "--out", str(tmp_path / "b"), "--format", "coco",
                  "--force", "--no-images").returncode == 0
    assert (tmp_path / "b" / "labels.json").is_file() and not (tmp_path / "b" / "VOCdevkit").exists()
    # no such run directory: refused, and none is created
    res = _wsseg("--run-dir", str(tmp_path / "nowhere"), "--out", str(tmp_path / "c"))
    assert res.returncode == 2 and not (tmp_path / "nowhere").exists()


def test_export_streams_the_manifest_and_counts_images_without_labels(tmp_path, tiny_run, monkeypatch):
    """An export reads the manifest a batch at a time (its memory does not grow with the corpus):
    the whole-manifest read refuses here, and the exports still hold every labelled image, the
    review queue's too; images a round did not label are counted by split, not listed."""
    from wsseg.tasks.labels.export import export_labels
    from wsseg.tasks.labels.review import review_table
    from wsseg.tasks.store import Store

    store = Store(tiny_run)
    final = store.read_summary()["final_round"]
    labels = _stored(tiny_run, final)
    splits = {rec.image_id: rec.split or "train" for rec in store.manifest()}

    def whole(self, split=None):
        raise AssertionError("export read the whole manifest")

    monkeypatch.setattr(Store, "manifest", whole)
    res = export_labels(Store(tiny_run), tmp_path / "voc", images=False)
    voc = tmp_path / "voc" / "VOCdevkit" / "VOC2012" / "ImageSets" / "Segmentation"
    assert res["images"] == len(labels) and res["images_without_labels"] == len(splits) - len(labels)
    assert sorted((voc / "trainval.txt").read_text().split()) == sorted(labels)
    for split, n in res["splits"].items():
        ids = (voc / f"{split}.txt").read_text().split()
        assert len(ids) == n and {splits[i] for i in ids} == {split}
    res = export_labels(Store(tiny_run), tmp_path / "top", fmt="coco", images=False, review=2)
    queue = [x["image_id"] for x in review_table(Store(tiny_run), final, top=2, measure=False)["rows"]]
    coco = json.loads((tmp_path / "top" / "labels.json").read_text())
    assert [im["wsseg_image_id"] for im in coco["images"]] == queue
