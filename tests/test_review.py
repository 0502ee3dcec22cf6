"""The review queue: per-image signals with answers known by construction, the score's ranks, and
`wsseg review` on a finished run (every image of the round, worst first, the true IoU beside it
where masks exist)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from wsseg.tasks.labels.review import image_iou, image_signals, ranks, scores, spearman

ROOT = Path(__file__).resolve().parents[1]


def _review(*argv):
    return subprocess.run([sys.executable, "-m", "wsseg", "review", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_image_signals_count_what_they_say():
    label = np.zeros((10, 10), np.uint8)
    label[:, 5:] = 1
    label[0, :] = 255                     # 10 undecided pixels
    prelim = np.zeros((3, 10, 10), np.float32)
    prelim[0] = 0.8                       # the network says class 0 everywhere, 0.8 sure ...
    prelim[1] = 0.2
    prelim[2] = 0.9                       # ... class 2 is not among the tags: never counted
    allowed = np.array([True, True, False])
    previous = label.copy()
    previous[5:, :] = 0                   # rows 5-9, columns 5-9 were class 0: 25 pixels changed
    s = image_signals(label, prelim, allowed, previous, tags=[1])
    assert s["disagreement"] == pytest.approx(45 / 90)  # labelled class-1 pixels (9 rows x 5) against 90 labelled
    assert s["uncertainty"] == pytest.approx(0.2, abs=1e-6)  # float32 probabilities
    assert s["changed"] == pytest.approx(0.25)
    assert s["ignore"] == pytest.approx(0.10)
    assert s["missing_tags"] == 0.0
    s = image_signals(np.zeros((10, 10), np.uint8), prelim, allowed, None, tags=[1])
    assert s["missing_tags"] == 1.0 and s["changed"] == 0.0 and s["disagreement"] == 0.0


def test_ranks_scores_and_spearman():
    assert ranks([3.0, 1.0, 2.0]).tolist() == [1.0, 0.0, 0.5]
    assert ranks([1.0, 1.0, 2.0]).tolist() == [0.25, 0.25, 1.0]  # ties share their mean rank
    rows = [{"a": 0.1, "b": 5.0}, {"a": 0.9, "b": 1.0}, {"a": 0.5, "b": 9.0}]
    assert scores(rows, ("a", "b")).tolist() == pytest.approx([0.25, 0.5, 0.75])
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    mask = np.array([[0, 0], [1, 255]], np.uint8)
    assert image_iou(np.array([[0, 0], [1, 1]], np.uint8), mask) == 1.0  # void pixels left out
    assert image_iou(np.array([[0, 1], [1, 0]], np.uint8), mask) == pytest.approx((1 / 2 + 1 / 2) / 2)


@pytest.mark.command("review")
def test_review_lists_every_image_of_the_round_worst_first(tmp_path, tiny_run):
    from wsseg.tasks.store import Store

    store = Store(tiny_run)
    final = store.read_summary()["final_round"]
    train = {rec.image_id for rec in store.manifest("train")}
    res = _review("--run-dir", str(tiny_run), "--json", "--top", "0")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["round"] == final and out["images"] == len(train)
    assert {x["image_id"] for x in out["rows"]} == train
    got = [x["score"] for x in out["rows"]]
    assert got == sorted(got, reverse=True) and all(0.0 <= v <= 1.0 for v in got)
    for x in out["rows"]:  # the IoU shown is the stored labels' against the mask
        assert x["iou"] == pytest.approx(image_iou(store.pseudo(final, x["image_id"]), store.mask(x["image_id"])))
    assert out["spearman"] is not None and -1.0 <= out["spearman"] <= 1.0

    res = _review("--run-dir", str(tiny_run), "--top", "2")
    assert res.returncode == 0, res.stderr
    assert f"review queue of round {final}: {len(train)} images" in res.stdout
    assert out["rows"][0]["image_id"] in res.stdout and "Spearman" in res.stdout
    assert out["rows"][-1]["image_id"] not in res.stdout or len(train) <= 2

    # `wsseg export --review N`: the top N of the queue, nothing else
    res = subprocess.run([sys.executable, "-m", "wsseg", "export", "--run-dir", str(tiny_run), "--review", "2",
                          "--no-images", "--out", str(tmp_path / "top2")], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    assert "labels of the review queue's top 2 images (png" in res.stdout
    listed = (tmp_path / "top2" / "VOCdevkit" / "VOC2012" / "ImageSets" / "Segmentation" / "trainval.txt").read_text()
    assert listed.split() == [x["image_id"] for x in out["rows"][:2]]
    assert json.loads((tmp_path / "top2" / "export.json").read_text())["review_top"] == 2

    res = _review("--run-dir", str(tiny_run), "--round", "7")
    assert res.returncode == 2 and res.stderr.strip().splitlines()[-1] == \
        f"wsseg: error: {tiny_run}: round 7 has no finished labels (finished rounds: {final})"

    # a round computed before the queue existed: the signals come from its stored arrays, the same ones
    old = shutil.copytree(tiny_run, tmp_path / "old", symlinks=True)
    shutil.rmtree(Store(old).round_dir(final) / "review")
    res = _review("--run-dir", str(old), "--json", "--top", "0")
    assert res.returncode == 0, res.stderr
    assert "computed without the review queue" in res.stderr
    assert json.loads(res.stdout)["rows"] == out["rows"]
    assert (Store(old).round_dir(final) / "review" / "backfill.parquet").is_file()
