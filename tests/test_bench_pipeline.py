"""wsseg bench pipeline (flows.bench_pipeline, tasks.bench.pipeline): the replicated corpus, the
figures' bookkeeping, and the command end to end on a tiny replicate of the bundled sample (no
timing assertions: the benchmark prints figures, it does not judge them here)."""
import argparse
import csv
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import copy_sample
from wsseg.tasks.bench import pipeline as tb

IDS = ["1_10_s", "5_26_s", "9_17_s"]  # cow, grass / building, sky / ...: three images, several tags each

TINY = ["--set", "classifier.epochs=1", "--set", "classifier.size=96",
        "--set", "segmentation.crop=96", "--set", "shard_size=4",
        "--set", "proposals.epochs=1", "--set", "mil.epochs=1"]


def test_augment_changes_geometry_and_colour_and_moves_the_mask_alike():
    img = np.zeros((40, 60, 3), np.uint8)
    img[:, :30] = 200  # left half bright
    mask = np.zeros((40, 60), np.uint8)
    mask[:, :30] = 7
    p = dict(flip=True, keep=[1.0, 1.0], offset=[0, 0], scale=1.0, gain=[1.0, 1.0, 1.0], bias=[5, 0, 0])
    a, m = tb.augment(img, mask, p)
    # flipped: the bright half and its class are now on the right, colour offset applied to red only
    assert (m[:, 30:] == 7).all() and (m[:, :30] == 0).all()
    assert (a[:, 35:, 1] == 200).all() and (a[:, :25, 0] == 5).all() and (a[:, :25, 1] == 0).all()
    p = dict(flip=False, keep=[0.5, 0.5], offset=[1.0, 0.0], scale=0.5, gain=[1, 1, 1], bias=[0, 0, 0])
    a, m = tb.augment(img, mask, p)
    assert a.shape == (10, 15, 3) and m.shape == (10, 15)  # bottom-left quarter, halved
    assert set(np.unique(m)) == {7}  # a nearest-neighbour mask keeps class indices
    with pytest.raises(ValueError, match="does not match"):
        tb.augment(img, mask[:10], p)


def test_copy_params_are_seeded_per_copy_and_always_change_the_image():
    assert tb.copy_params(3, 0) == tb.copy_params(3, 0)
    assert tb.copy_params(3, 0) != tb.copy_params(4, 0) != tb.copy_params(3, 1)
    for k in range(50):
        p = tb.copy_params(k)
        assert all(0.8 <= x <= 0.95 for x in p["keep"]) and 0.7 <= p["scale"] <= 1.0


def test_replica_plan_cycles_the_source_and_names_each_copy():
    items = [dict(image_id=i, image_path=f"{i}.jpg", mask_path=None, tags=[t]) for i, t in (("a", "x"), ("b", "y"))]
    plan = tb.replica_plan(items, 5)
    assert [p["image_id"] for p in plan] == ["a-c0000", "b-c0000", "a-c0001", "b-c0001", "a-c0002"]
    assert [p["tags"] for p in plan] == [["x"], ["y"], ["x"], ["y"], ["x"]]
    # a corpus that grows takes the next copies: none of the first ones again
    more = tb.replica_plan(items, 2, start=5)
    assert [p["image_id"] for p in more] == ["b-c0002", "a-c0003"] and [p["k"] for p in more] == [5, 6]
    with pytest.raises(ValueError):
        tb.replica_plan([], 3)


def test_stage_figures_and_worker_peaks():
    shards = [{"cpu_seconds": 0.5, "images": 4, "pid": 1, "peak_rss_mb": 100.0},
              {"cpu_seconds": 1.5, "images": 4, "pid": 2, "peak_rss_mb": 120.0},
              {"cpu_seconds": 2.0, "images": 2, "pid": 1, "peak_rss_mb": 110.0}]
    s = tb.stage_figures(shards, 2.5, 10)
    assert s["images_per_s"] == pytest.approx(4.0) and s["core_ms_per_image"] == pytest.approx(400.0)
    assert s["shards"] == 3 and s["core_seconds"] == pytest.approx(4.0)
    assert tb.worker_peaks(shards) == {1: 110.0, 2: 120.0}
    assert tb.stage_figures([], 0.0, 0)["images_per_s"] is None


def _parse(argv):
    from wsseg.flows.cli_bench import add_bench_pipeline_parser

    ap = argparse.ArgumentParser(prog="wsseg")
    sub = ap.add_subparsers(dest="command")
    bench = sub.add_parser("bench").add_subparsers(dest="bench")
    add_bench_pipeline_parser(bench)
    return ap.parse_args(argv)


def test_bad_sizes_are_refused_before_anything_starts(tmp_path):
    from wsseg.flows.cli_bench import cmd_bench_pipeline

    args = _parse(["bench", "pipeline", "--data", str(tmp_path), "--replicate", "10,x", "--out", str(tmp_path / "o.json")])
    with pytest.raises(ValueError, match="--replicate expects positive whole numbers"):
        cmd_bench_pipeline(args)
    args = _parse(["bench", "pipeline", "--data", str(tmp_path / "none"), "--replicate", "4"])
    with pytest.raises(ValueError, match="no such directory"):
        cmd_bench_pipeline(args)
    assert not (tmp_path / "o.json").exists()


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.command("bench pipeline")
def test_bench_pipeline_end_to_end(tmp_path, prefect_harness, one_torch_thread):
    from wsseg.flows.cli_bench import cmd_bench_pipeline

    data = copy_sample(tmp_path / "data", IDS)
    run, out = tmp_path / "run", tmp_path / "res" / "pipe.json"
    n = 6
    argv = ["bench", "pipeline", "--data", str(data), "--replicate", str(n), "--workers", "1", "--out", str(out),
            "--run-dir", str(run), "--sample", "4", "--listing-k", "3", "--cases", "full"] + TINY
    args = _parse(argv)
    assert args.func is cmd_bench_pipeline and args.func(args) == 0
    res = json.loads(out.read_text())
    assert res["provenance"]["machine"]["cores"] and res["provenance"]["load_average"]["end"] is not None
    for key in ("stages", "overhead_share", "overhead_core_share", "parallel_efficiency", "dcrf_core_ms_per_image", "ours_over_dcrf",
                "peak_rss_mb", "trainer_seconds", "rerun_share", "store_listing", "rerun_identical"):
        assert key in res, key
    # every CPU stage and its steps, with both figures
    for name in ("features", "features.superpixels", "features.edge_map", "features.proposals", "preliminary",
                 "pseudo_labels", "pseudo_labels.filtering", "pseudo_labels.fusion", "pseudo_labels.clustering",
                 "pseudo_labels.seeded_segmentation"):
        s = res["stages"][name]
        assert s["images_per_s"] > 0 and s["core_ms_per_image"] > 0, name
    assert res["stages"]["features"]["images"] == n
    assert res["parallel_efficiency"] is None  # one worker count: nothing to compare
    assert res["overhead_share"] < 1 and res["dcrf_core_ms_per_image"] > 0 and res["ours_over_dcrf"] > 0
    assert set(res["peak_rss_mb"]) == {str(n)} and res["peak_rss_mb"][str(n)]["flow"] > 0
    assert res["peak_rss_mb"][str(n)]["worker"] > 0
    assert set(res["trainer_seconds"][str(n)]) == {"classifier", "mil", "proposal_classifier", "segmenter"}
    listing = res["store_listing"][str(n)]
    assert listing["images"] == n and listing["objects_store"] > n and listing["k"] == 3
    assert all(v > 0 for v in listing["open_ms"].values())
    # the same round again: nothing recomputed, the same pseudo-labels; the sample computed again
    # with one worker and in the plain loop gives them bit for bit
    assert res["rerun_identical"] is True and 0 <= res["rerun_share"] < 1
    assert res["sizes_detail"][str(n)]["rerun"]["stages"]["features"]["shards"] == 0
    assert res["workers_identical"] is True and res["plain_loop_identical"] is True

    # the replicated corpus: N distinct files, none equal to a source image; tags and masks kept
    src = data / "images"
    copies = run / f"n{n}" / "source"
    rows = list(csv.DictReader((copies / "labels.csv").open()))
    assert len(rows) == n and res["distinct_sha256"][str(n)] == n
    shas = {_sha(copies / "images" / f"{r['image_id']}.jpg") for r in rows}
    assert len(shas) == n and not shas & {_sha(p) for p in src.iterdir()}
    tags = {r["image_id"]: r["labels"] for r in csv.DictReader((data / "labels.csv").open())}
    for r in rows:
        origin = r["image_id"].rsplit("-c", 1)[0]
        assert r["labels"] == tags[origin] and r["split"] == "train"
        img = Image.open(copies / "images" / f"{r['image_id']}.jpg")
        mask = np.asarray(Image.open(copies / "masks" / f"{r['image_id']}.png"))
        assert mask.shape == (img.height, img.width)
        assert set(np.unique(mask)) <= set(np.unique(np.asarray(Image.open(data / "masks" / f"{origin}.png"))))

    # the same command again on the same directory: the first run's figures are reported as recorded,
    # the round is run again (nothing recomputed) and the pseudo-labels are the same bits
    first = res["sizes_detail"][str(n)]["rerun"]["pseudo_label_digest"]
    assert args.func(_parse(argv)) == 0
    res2 = json.loads(out.read_text())
    again = res2["sizes_detail"][str(n)]
    assert again["recorded"] == str(run / f"n{n}" / "measured.json") and res2["stages"] == res["stages"]
    assert again["rerun"]["pseudo_label_digest"] == first and res2["rerun_identical"] is True
    assert again["rerun"]["stages"]["features"]["shards"] == 0
    # another configuration on the same directory is refused, naming the record
    with pytest.raises(ValueError, match="measured with other settings"):
        args.func(_parse(argv + ["--set", "proposals.epochs=2"]))
