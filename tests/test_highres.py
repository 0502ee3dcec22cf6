"""flows.highres: data helpers with known answers, a tiny end-to-end benchmark and `segment`."""

import argparse
import json

import cv2
import numpy as np
import pytest
import torch
from PIL import Image

import flows.highres as hr

torch.set_num_threads(1)


def _synthetic_hrf(root, n=4, size=(64, 96)):
    """HRF layout: bright 'vessels' (lines) on a dark disc; 255 outside the disc."""
    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    h, w = size
    yy, xx = np.mgrid[:h, :w]
    fov = (yy - h / 2) ** 2 / (h / 2) ** 2 + (xx - w / 2) ** 2 / (w / 2) ** 2 <= 1.0
    ids = []
    for i, kind in enumerate(["h", "g", "dr", "h"][:n]):
        rng = np.random.default_rng(i)
        mask = np.zeros((h, w), np.uint8)
        for _ in range(3):
            r = rng.integers(4, h - 4)
            mask[r:r + 2, :] = 1
            c = rng.integers(4, w - 4)
            mask[:, c:c + 2] = 1
        image = np.full((h, w, 3), (120, 40, 20), np.uint8)
        image[mask == 1] = (40, 10, 5)
        mask[~fov] = 255
        image[~fov] = 0
        image_id = f"{i + 1:02d}_{kind}"
        cv2.imwrite(str(root / "images" / f"{image_id}.jpg"), image[..., ::-1], [cv2.IMWRITE_JPEG_QUALITY, 98])
        Image.fromarray(mask).save(root / "masks" / f"{image_id}.png")
        ids.append(image_id)
    (root / "train.txt").write_text("\n".join(ids) + "\n")
    return ids


def test_reduce_mask_known_answer():
    full = np.array([[1, 1, 0, 0],
                     [0, 0, 0, 1],
                     [255, 255, 255, 0],
                     [255, 1, 0, 0]], np.uint8)
    np.testing.assert_array_equal(hr.reduce_mask(full, (2, 2)), [[1, 0], [255, 0]])


def test_upsample_labels_is_opencv_nearest_and_streams():
    rng = np.random.default_rng(0)
    small = rng.integers(0, 3, (7, 11), dtype=np.uint8)
    want = cv2.resize(small, (30, 17), interpolation=cv2.INTER_NEAREST)
    np.testing.assert_array_equal(hr.upsample_labels(small, 17, 30, band=4), want)
    np.testing.assert_array_equal(hr.upsample_labels(small, 14, 22), np.repeat(np.repeat(small, 2, 0), 2, 1))


def test_vessel_scores_known_iou():
    pred = np.array([[1, 1, 0, 0]], np.uint8)
    mask = np.array([[1, 0, 1, 255]], np.uint8)
    s = hr.vessel_scores([pred, pred], [mask, mask])
    assert (s["tp"], s["fp"], s["fn"]) == (2, 2, 2)
    assert s["iou"] == pytest.approx(1 / 3) and s["f1"] == pytest.approx(0.5)


def test_load_split_takes_one_eval_image_per_group(tmp_path):
    (tmp_path / "train.txt").write_text("01_dr\n02_dr\n01_g\n02_g\n01_h\n02_h\n")
    train, evals = hr.load_split(tmp_path, "train", train_n=3, eval_n=3)
    assert evals == ["02_dr", "02_g", "02_h"] and train == ["01_dr", "01_g", "01_h"]
    with pytest.raises(ValueError, match="train_n"):
        hr.load_split(tmp_path, "train", train_n=5, eval_n=3)


def test_train_highres_balanced_lowers_loss_and_validates():
    from models.global_local import global_local
    rng = np.random.default_rng(0)
    image = rng.integers(100, 130, (48, 64, 3)).astype(np.uint8)
    mask = np.zeros((48, 64), np.uint8)
    mask[20:23] = 1
    image[mask == 1] = 20
    mask[:, :4] = 255
    torch.manual_seed(0)
    model = global_local(2, 3, patch_size=32, width=8, blocks=(1, 1))
    _, losses = hr.train_highres([image], [mask], model=model, patch_size=32, steps=10, batch=2, lr=1e-2,
                                 seed=0, balanced=0.5)
    assert len(losses) == 10 and np.mean(losses[-3:]) < np.mean(losses[:3])
    assert not model.training
    with pytest.raises(ValueError, match="patch_size"):
        hr.train_highres([image], [mask], model=model, patch_size=16, steps=1)
    with pytest.raises(ValueError, match="masks"):
        hr.train_highres([image], [], model=model, patch_size=32, steps=1)


def test_bench_and_segment_end_to_end(tmp_path, monkeypatch):
    ids = _synthetic_hrf(tmp_path / "hrf")
    out = tmp_path / "bench" / "highres.json"
    logs = []
    res = hr.bench_highres(tmp_path / "hrf", "train", out, train_n=3, eval_n=1, patch_size=16, scale=0.5, steps=3,
                           batch=2, width=8, blocks=(1, 1), overlap=4, threads=1, log=logs.append)
    saved = json.loads(out.read_text())
    for key in ("global_local_iou", "global_local_f1", "patch_only_iou", "patch_only_f1", "downsampled_iou",
                "downsampled_f1", "peak_mem_mb_1x", "peak_mem_mb_2x", "peak_mem_ratio_2x", "mpix_per_s",
                "wall_seconds"):
        assert key in saved and np.isfinite(saved[key]), key
        assert saved[key] == res[key]
    for key in ("global_local_iou", "patch_only_f1", "downsampled_iou"):
        assert 0.0 <= saved[key] <= 1.0
    assert saved["peak_mem_mb_1x"] > 50 and saved["peak_mem_ratio_2x"] == pytest.approx(
        saved["peak_mem_mb_2x"] / saved["peak_mem_mb_1x"], rel=1e-3)
    assert saved["probe_size_2x"] == [64, 96] and saved["eval_ids"] == ["03_dr"]
    overlay = cv2.imread(str(out.with_name("highres_overlay.png")))
    assert overlay is not None and overlay.shape[1] == 3 * 1200
    assert any("vessel IoU" in line for line in logs)

    # segment with the saved checkpoint; force the Zarr path with a tiny threshold
    import zarr
    monkeypatch.setattr(hr, "LARGE_OUTPUT_PIXELS", 1000)
    images = [tmp_path / "hrf" / "images" / f"{i}.jpg" for i in ids[:2]]
    pngs = hr.segment(images, out.with_name("highres_global_local.pt"), tmp_path / "seg", batch=3, log=logs.append)
    for png in pngs:
        with Image.open(png) as im:
            assert im.mode == "P" and im.size == (96, 64)
            labels = np.array(im)
        assert set(np.unique(labels)) <= {0, 1}
        np.testing.assert_array_equal(zarr.open_array(str(png.with_suffix(".zarr")), mode="r")[:], labels)
    assert sum("[2/2]" in line for line in logs) == 1
    with pytest.raises(ValueError, match="not found"):
        hr.segment([tmp_path / "nope.jpg"], out.with_name("highres_global_local.pt"), tmp_path / "seg")


def test_parsers_register_commands():
    parser = argparse.ArgumentParser(prog="wsseg")
    sub = parser.add_subparsers(dest="command")
    hr.add_segment_parser(sub)
    bench = sub.add_parser("bench").add_subparsers(dest="bench")
    hr.add_bench_highres_parser(bench)
    a = parser.parse_args(["segment", "x.jpg", "y.jpg", "--checkpoint", "m.pt", "--out-dir", "o", "--overlap", "8"])
    assert a.func is hr._segment_main and a.inputs == ["x.jpg", "y.jpg"] and a.overlap == 8
    b = parser.parse_args(["bench", "highres", "--data-dir", "d", "--out-json", "r.json", "--steps", "5"])
    assert b.func is hr._bench_main and b.steps == 5 and b.patch_size == 256
    assert "global-local" in sub.choices["segment"].format_help()
