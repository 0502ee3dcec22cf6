"""tasks.highres.train, tasks.highres.segment, tasks.store.files and the flows of flows.highres: data helpers with known
answers, a tiny end-to-end benchmark and `segment`."""

import argparse
import json
import re

import cv2
import numpy as np
import pytest
import torch
from PIL import Image

from wsseg.tasks.highres import segment as sg
from wsseg.tasks.highres import train as hr
from wsseg.tasks.store import files
from tests.conftest import load_tool

torch.set_num_threads(1)


def _synthetic_hrf(root, n=4, size=(64, 96)):
    """HRF layout: dark 'vessels' (lines) on a reddish disc; black and mask 255 outside the disc."""
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
        image[mask == 1] = (75, 20, 10)       # darker than the retina, brighter than the surround
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
    from wsseg.models.global_local import global_local
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


@pytest.mark.command("bench highres", "segment")
def test_bench_and_segment_end_to_end(tmp_path, monkeypatch, capsys):
    from wsseg.flows.highres import bench_highres
    ids = _synthetic_hrf(tmp_path / "hrf")
    out = tmp_path / "bench" / "highres.json"
    monkeypatch.chdir(tmp_path)  # relative paths, as the README's command gives them: the probes still find both
    res = bench_highres("hrf", "train", "bench/highres.json", train_n=3, eval_n=1, patch_size=16, scale=0.5,
                        steps=3, batch=2, width=8, blocks=(1, 1), overlap=4, threads=1)
    logs = capsys.readouterr().err.splitlines()  # progress goes to stderr; stdout is for --json
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
    # the probes ran `segment` on the original file (64x96, worked at scale 0.5) and on a JPEG of twice its side
    assert saved["probe_sizes"] == {"1x": {"image": [64, 96], "working": [32, 48]},
                                    "2x": {"image": [128, 192], "working": [64, 96]}}
    assert saved["eval_ids"] == ["03_dr"] and 0.6 < saved["probe_fov_share"] < 0.9, saved["probe_fov_share"]
    overlay = cv2.imread(str(out.with_name("highres_overlay.png")))
    assert overlay is not None and overlay.shape[1] == 3 * 1200
    assert any("vessel IoU" in line for line in logs)

    # segment with the saved checkpoint; force the Zarr output and the on-disk working image with tiny thresholds
    import zarr
    monkeypatch.setattr(sg, "LARGE_OUTPUT_PIXELS", 1000)
    images = [tmp_path / "hrf" / "images" / f"{i}.jpg" for i in ids[:2]]
    ckpt = out.with_name("highres_global_local.pt")
    stats = []
    pngs = sg.segment(images, ckpt, tmp_path / "seg", batch=3, log=logs.append, stats=stats)
    for png, st in zip(pngs, stats):
        with Image.open(png) as im:
            assert im.mode == "P" and im.size == (96, 64)
            labels = np.array(im)
        assert set(np.unique(labels)) <= {0, 1}
        np.testing.assert_array_equal(zarr.open_array(str(png.with_suffix(".zarr")), mode="r")[:], labels)
        # the synthetic images are black outside an ellipse: found as field of view, class 0 outside it
        assert st["fov_found"] and 0.6 < st["fov_share"] < 0.9
        np.testing.assert_allclose(st["class_shares"], np.bincount(labels.ravel(), minlength=2) / labels.size)
        yy, xx = np.mgrid[:64, :96]
        outside = (yy - 32) ** 2 / 32 ** 2 + (xx - 48) ** 2 / 48 ** 2 > 1.25
        assert (labels[outside] == 0).all()
    assert sum("[2/2]" in line for line in logs) == 1
    assert not list((tmp_path / "seg").glob(".*"))              # temporary working arrays are gone
    monkeypatch.setattr(sg, "SPILL_PIXELS", 100)
    spilled = sg.segment(images, ckpt, tmp_path / "seg_spilled", batch=3, log=logs.append)
    for a, b in zip(pngs, spilled):
        np.testing.assert_array_equal(np.array(Image.open(a)), np.array(Image.open(b)))
    # --fov none keeps every pixel's prediction
    kept = sg.segment(images[:1], ckpt, tmp_path / "seg_nofov", fov="none", log=logs.append)
    whole = np.array(Image.open(kept[0]))
    with_fov = np.array(Image.open(spilled[0]))
    # well inside the field of view the two agree; near its edge the FOV run's class 0 may be a vessel here
    deep = (yy - 32) ** 2 / 32 ** 2 + (xx - 48) ** 2 / 48 ** 2 < 0.64
    np.testing.assert_array_equal(whole[deep], with_fov[deep])
    assert (whole[with_fov == 1] == 1).all()
    with pytest.raises(ValueError, match="not found"):
        sg.segment([tmp_path / "nope.jpg"], ckpt, tmp_path / "seg")
    with pytest.raises(ValueError, match="fov"):
        sg.segment(images[:1], ckpt, tmp_path / "seg", fov="maybe")

    # --model accepts the bench's JSON, its folder, and a `wsseg train` run directory
    assert files.resolve_checkpoint(out) == ckpt and files.resolve_checkpoint(out.parent) == ckpt
    run = tmp_path / "run"
    (run / "rounds" / "r001").mkdir(parents=True)
    (run / "rounds" / "r001" / "model.pt").write_bytes(ckpt.read_bytes())
    (run / "summary.json").write_text(json.dumps({"final_model": "/moved/away/rounds/r001/model.pt"}))
    assert files.resolve_checkpoint(run) == run / "rounds" / "r001" / "model.pt"      # run dir moved: found under it
    assert files.resolve_checkpoint(run / "summary.json") == run / "rounds" / "r001" / "model.pt"
    # the real command, in its own process (it starts its Prefect API and MLflow store in --out)
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    cli = subprocess.run([sys.executable, "-m", "wsseg", "segment", str(images[0]), "--model", str(run), "--out",
                          str(tmp_path / "seg_cli"), "--threads", "1"], cwd=root, capture_output=True, text=True,
                         env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert cli.returncode == 0, cli.stderr[-2000:]
    np.testing.assert_array_equal(np.array(Image.open(tmp_path / "seg_cli" / f"{ids[0]}.png")),
                                  np.array(Image.open(pngs[0])))


def test_resolve_checkpoint_errors_name_the_path(tmp_path):
    with pytest.raises(ValueError, match=r"nowhere.*no such file"):
        files.resolve_checkpoint(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty: no checkpoint found.*summary\.json.*_global_local\.pt"):
        files.resolve_checkpoint(tmp_path / "empty")
    (tmp_path / "two").mkdir()
    for name in ("a_global_local.pt", "b_global_local.pt"):
        (tmp_path / "two" / name).write_bytes(b"")
    with pytest.raises(ValueError, match=r"two: several.*a_global_local\.pt, b_global_local\.pt"):
        files.resolve_checkpoint(tmp_path / "two")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "summary.json").write_text(json.dumps({"final_model": str(tmp_path / "gone" / "model.pt")}))
    with pytest.raises(ValueError, match=r"summary\.json: final_model .*gone.*not found"):
        files.resolve_checkpoint(tmp_path / "run")
    (tmp_path / "b.json").write_text("{}")
    with pytest.raises(ValueError, match=r"b\.json: no checkpoint b_global_local\.pt beside it"):
        files.resolve_checkpoint(tmp_path / "b.json")


def test_write_palette_png_streams_bands_and_checks_rows(tmp_path):
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 21, (37, 53), dtype=np.uint8)
    palette = files.palette(21)
    files.write_palette_png(tmp_path / "a.png", 37, 53, (labels[i:i + 10] for i in range(0, 37, 10)), palette)
    with Image.open(tmp_path / "a.png") as im:
        assert im.mode == "P" and im.size == (53, 37)
        np.testing.assert_array_equal(np.array(im), labels)
        assert im.getpalette()[:63] == palette[:63]
    with pytest.raises(ValueError, match="bands hold 30 rows, expected 37"):
        files.write_palette_png(tmp_path / "b.png", 37, 53, (labels[i:i + 10] for i in range(0, 30, 10)), palette)
    with pytest.raises(ValueError, match=r"bands must be \(n, 53\) uint8"):
        files.write_palette_png(tmp_path / "c.png", 37, 53, [labels[:, :50]], palette)
    assert not (tmp_path / "b.png").exists() and not (tmp_path / "c.png").exists()


def test_upsampled_class_shares_equal_counts_of_the_upsampled_map():
    rng = np.random.default_rng(1)
    small = rng.integers(0, 4, (13, 17), dtype=np.uint8)
    for height, width in ((13, 17), (40, 29), (101, 170)):
        want = np.bincount(hr.upsample_labels(small, height, width).ravel(), minlength=4) / (height * width)
        np.testing.assert_allclose(sg.upsampled_class_shares(small, height, width, 4, band=5), want, atol=1e-12)


def test_read_image_reduced_decode_matches_full_decode(tmp_path):
    rng = np.random.default_rng(2)
    image = cv2.GaussianBlur(rng.integers(0, 256, (120, 200, 3), dtype=np.uint8), (9, 9), 3)
    path = tmp_path / "x.jpg"
    cv2.imwrite(str(path), image[..., ::-1], [cv2.IMWRITE_JPEG_QUALITY, 98])
    full = files.read_image(path)
    np.testing.assert_allclose(full.astype(float), image, atol=12)         # RGB order kept
    for scale in (0.5, 0.3, 0.2):
        got = files.read_image(path, scale)
        want = cv2.resize(full, (round(200 * scale), round(120 * scale)), interpolation=cv2.INTER_AREA)
        assert got.shape == want.shape
        assert np.abs(got.astype(int) - want).mean() < 3
    with pytest.raises(ValueError, match="scale"):
        files.read_image(path, 1.5)


def test_parsers_register_commands():
    parser = argparse.ArgumentParser(prog="wsseg")
    sub = parser.add_subparsers(dest="command")
    from wsseg.flows import cli_bench, commands
    commands.add_segment_parser(sub)
    bench = sub.add_parser("bench").add_subparsers(dest="bench")
    cli_bench.add_bench_highres_parser(bench)
    # the names of the issue ...
    a = parser.parse_args(["segment", "x.jpg", "y.jpg", "--model", "runs/r", "--out", "o", "--overlap", "8"])
    assert a.func is commands.cmd_segment and a.inputs == ["x.jpg", "y.jpg"] and a.overlap == 8
    assert (a.model, a.out, a.fov) == ("runs/r", "o", "auto")
    b = parser.parse_args(["bench", "highres", "--data", "d", "--split", "val", "--out", "r.json", "--steps", "5"])
    assert b.func is cli_bench.cmd_bench_highres
    assert (b.data, b.split, b.out, b.steps, b.patch_size) == ("d", "val", "r.json", 5, 256)
    # ... and the earlier ones, as aliases
    a = parser.parse_args(["segment", "x.jpg", "--checkpoint", "m.pt", "--out-dir", "o2", "--fov", "none"])
    assert (a.model, a.out, a.fov) == ("m.pt", "o2", "none")
    b = parser.parse_args(["bench", "highres", "--data-dir", "d2", "--out-json", "r2.json"])
    assert (b.data, b.out) == ("d2", "r2.json")
    with pytest.raises(SystemExit):
        parser.parse_args(["segment", "x.jpg", "--out", "o"])                  # a model is required
    with pytest.raises(SystemExit):
        parser.parse_args(["segment", "x.jpg", "--model", "m.pt", "--out", "o", "--fov", "sometimes"])
    help_text = sub.choices["segment"].format_help()
    assert "global-local" in help_text and "--checkpoint" in help_text and "--out-dir" in help_text


# ---------------------------------------------------------------------------------------------- multi-class corpus
def test_reduce_mask_many_classes_takes_the_largest_area():
    full = np.array([[3, 3, 0, 2],
                     [3, 0, 2, 2],
                     [255, 255, 5, 255],
                     [255, 4, 255, 255]], np.uint8)
    np.testing.assert_array_equal(hr.reduce_mask(full, (2, 2)), [[3, 2], [255, 255]])
    # a tie goes to the lower index; a block half annotated is kept
    np.testing.assert_array_equal(hr.reduce_mask(np.array([[7, 2], [255, 255]], np.uint8), (1, 1)), [[2]])


def test_confusion_and_class_scores_known_answer():
    pred = np.array([[0, 0, 1, 2, 2]], np.uint8)
    mask = np.array([[0, 1, 1, 2, 255]], np.uint8)
    conf = hr.confusion(pred, mask, 4)
    assert conf.sum() == 4 and conf[0, 0] == 1 and conf[1, 0] == 1 and conf[1, 1] == 1 and conf[2, 2] == 1
    s = hr.class_scores(conf, ["a", "b", "c", "d"])
    # a: tp 1 / (1 + 1 fp); b: 1 / (2 + 0); c: 1 / 1; d absent everywhere: not scored
    assert s["class_iou"] == {"a": 0.5, "b": 0.5, "c": 1.0}
    assert s["miou"] == pytest.approx(2 / 3) and s["pixel_accuracy"] == 0.75 and s["classes_evaluated"] == 3
    # a class only predicted has IoU 0 but does not count in the mean over the classes of the masks
    s = hr.class_scores(hr.confusion(np.array([[3, 0]], np.uint8), np.array([[0, 0]], np.uint8), 4), list("abcd"))
    assert s["class_iou"] == {"a": 0.5, "d": 0.0} and s["miou"] == 0.5
    with pytest.raises(ValueError, match="differ in shape"):
        hr.confusion(pred, mask[:, :3], 4)


def test_load_split_folds_leave_every_image_out_once(tmp_path):
    """Fold 0 is the single split; folds 0..K-1 evaluate every id once, one per group each, and train on the
    rest; a fold past the ids, or a fold with an evaluation split of its own, is a one-line error."""
    ids = [f"{n:02d}_{g}" for g in ("dr", "g", "h") for n in (1, 2, 3)]
    (tmp_path / "train.txt").write_text("\n".join(ids) + "\n")
    (tmp_path / "val.txt").write_text("x\n")
    assert hr.load_split(tmp_path, "train", train_n=6, eval_n=3, fold=0) == hr.load_split(tmp_path, "train",
                                                                                         train_n=6, eval_n=3)
    seen = []
    for fold, number in enumerate(("03", "02", "01")):
        train, evals = hr.load_split(tmp_path, "train", train_n=6, eval_n=3, fold=fold)
        assert evals == [f"{number}_dr", f"{number}_g", f"{number}_h"]
        assert train == [i for i in ids if i not in evals]
        seen += evals
    assert sorted(seen) == sorted(ids)
    with pytest.raises(ValueError, match=r"fold 3 of 3 evaluation images needs 12 ids.*train\.txt has 9: folds 0 to 2"):
        hr.load_split(tmp_path, "train", train_n=6, eval_n=3, fold=3)
    with pytest.raises(ValueError, match="only fold 0"):
        hr.load_split(tmp_path, "train", eval_split="val", fold=1)


def test_scores_from_confusion_are_the_vessel_and_class_scores():
    pred = np.array([[1, 1, 0, 0], [0, 1, 1, 0]], np.uint8)
    mask = np.array([[1, 0, 1, 255], [0, 1, 1, 1]], np.uint8)
    conf = hr.confusion(pred, mask, 2)
    s, want = hr.scores_from_confusion("v", conf, ["background", "vessel"]), hr.vessel_scores([pred], [mask])
    assert s == {"v_iou": want["iou"], "v_f1": want["f1"]} and want["iou"] == pytest.approx(3 / 6)
    three = hr.scores_from_confusion("v", hr.confusion(pred, mask, 3), ["a", "b", "c"])
    assert three["v_miou"] == pytest.approx(hr.class_scores(hr.confusion(pred, mask, 3), ["a", "b", "c"])["miou"])


def test_load_split_with_an_eval_split(tmp_path):
    (tmp_path / "train.txt").write_text("a\nb\nc\n")
    (tmp_path / "val.txt").write_text("x\ny\n")
    assert hr.load_split(tmp_path, "train", train_n=None, eval_n=None, eval_split="val") == (["a", "b", "c"],
                                                                                             ["x", "y"])
    assert hr.load_split(tmp_path, "train", train_n=2, eval_n=1, eval_split="val") == (["a", "b"], ["x"])
    with pytest.raises(ValueError, match=r"between 1 and 2 .*val\.txt"):
        hr.load_split(tmp_path, "train", train_n=2, eval_n=3, eval_split="val")
    with pytest.raises(ValueError, match="test.txt not found"):
        hr.load_split(tmp_path, "train", eval_split="test")


def _tool():
    return load_tool("msrc_highres")


def _msrc_source(tmp_path, n_train=3, n_val=2):
    from conftest import SAMPLE, copy_sample
    ids = sorted(p.stem for p in (SAMPLE / "images").glob("*.jpg"))[:n_train + n_val]
    src = copy_sample(tmp_path / "src", ids)
    (src / "train.txt").write_text("\n".join(ids[:n_train]) + "\n")
    (src / "val.txt").write_text("\n".join(ids[n_train:]) + "\n")
    return src, ids


def test_msrc_highres_tool_upscales_images_and_masks(tmp_path):
    tool = _tool()
    src, ids = _msrc_source(tmp_path, 2, 1)
    out = tmp_path / "x3"
    assert tool.main(["--src", str(src), "--out", str(out), "--upscale", "3"]) == 0
    for i in ids:
        image, big = files.read_image(src / "images" / f"{i}.jpg"), files.read_image(out / "images" / f"{i}.jpg")
        mask, big_mask = files.read_mask(src / "masks" / f"{i}.png"), files.read_mask(out / "masks" / f"{i}.png")
        assert big.shape == (3 * image.shape[0], 3 * image.shape[1], 3)
        np.testing.assert_array_equal(big_mask, np.repeat(np.repeat(mask, 3, 0), 3, 1))   # void 255 kept exactly
        small = cv2.resize(big, image.shape[1::-1], interpolation=cv2.INTER_AREA)
        assert np.abs(small.astype(int) - image).mean() < 6                                 # the same photo
    assert (out / "train.txt").read_text().split() == ids[:2] and (out / "val.txt").read_text().split() == ids[2:]
    assert (out / "classes.txt").read_text() == (src / "classes.txt").read_text()
    assert [r.split(",")[0] for r in (out / "labels.csv").read_text().splitlines()[1:]] == ids
    assert json.loads((out / "corpus.json").read_text())["upscale"] == 3
    # the same options again: resumes (nothing to do); other options on the same folder: refused
    assert tool.main(["--src", str(src), "--out", str(out), "--upscale", "3"]) == 0
    assert tool.main(["--src", str(src), "--out", str(out), "--upscale", "2"]) == 2


def test_bench_on_an_upscaled_multiclass_corpus(tmp_path, capsys):
    from wsseg.flows.highres import bench_highres
    src, ids = _msrc_source(tmp_path, 3, 2)
    data = tmp_path / "x2"
    assert _tool().main(["--src", str(src), "--out", str(data), "--upscale", "2"]) == 0
    out = tmp_path / "bench" / "msrc.json"
    res = bench_highres(str(data), "train", str(out), eval_split="val", train_n=None, eval_n=None, patch_size=64,
                        scale=1.0, steps=3, batch=2, width=8, blocks=(1, 1), overlap=8, threads=1,
                        variants=("global_local", "downsampled", "gl_method_c"),
                        memory_probe=False)
    saved = json.loads(out.read_text())
    classes = (data / "classes.txt").read_text().split()
    assert saved["train_ids"] == ids[:3] and saved["eval_ids"] == ids[3:] and saved["classes"] == classes
    assert saved["budget"]["steps"] == 3 and saved["budget"]["patches_per_step"] == 2
    truth = set()
    for i in ids[3:]:
        m = files.read_mask(data / "masks" / f"{i}.png")
        truth |= {classes[k] for k in np.unique(m) if k != 255}
    for name in ("global_local", "downsampled", "gl_method_c"):
        assert 0.0 <= saved[f"{name}_miou"] <= 1.0 and saved[f"{name}_miou"] == res[f"{name}_miou"]
        assert truth <= set(saved[f"{name}_class_iou"]) <= set(classes)
        assert f"{name}_iou" not in saved                          # the vessel keys belong to two-class corpora
    # the checkpoint is the first global-local network's, with the corpus's classes; segment reads it
    ckpt = out.with_name("msrc_global_local.pt")
    from wsseg.tasks.store import load_model
    net, state = load_model(ckpt)
    assert net.num_classes == len(classes) and state["meta"]["classes"] == classes
    # a photo with a dark surround: a multi-class model whose class 0 is no background keeps every pixel
    photo = files.read_image(data / "images" / f"{ids[3]}.jpg")
    h, w = photo.shape[:2]
    yy, xx = np.mgrid[:h, :w]
    photo[(yy - h / 2) ** 2 / (h / 2) ** 2 + (xx - w / 2) ** 2 / (w / 2) ** 2 > 1] = 0
    files.write_jpeg(tmp_path / "dark.jpg", photo)
    stats = []
    pngs = sg.segment([tmp_path / "dark.jpg"], ckpt, tmp_path / "seg", log=lambda s: None, stats=stats)
    assert classes[0] != "background" and not stats[0]["fov_found"] and stats[0]["fov_share"] == 1.0
    with Image.open(pngs[0]) as im:
        assert im.size == (w, h)
    assert "mIoU" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown variants"):
        bench_highres(str(data), "train", str(out), eval_split="val", variants=("global_local", "nope"))


def test_bench_cross_validates_in_folds(tmp_path, capsys):
    """--folds 2 on four synthetic retinas: each fold's evaluation image is unseen by that fold's networks, the
    two folds' images differ, and the figures are those of the confusions summed over both, which count every
    annotated pixel of both evaluation masks once; the checkpoint is fold 0's."""
    from wsseg.flows.highres import bench_highres
    _synthetic_hrf(tmp_path / "hrf")
    out = tmp_path / "bench" / "cv.json"
    res = bench_highres(str(tmp_path / "hrf"), "train", str(out), train_n=3, eval_n=1, patch_size=16, scale=0.5,
                        steps=2, batch=2, width=8, blocks=(1, 1), overlap=4, threads=1, backbone="hrnet",
                        variants=("global_local", "patch_only"), memory_probe=False, folds=2)
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(res, default=str))
    folds = saved["folds"]
    assert [f["eval_ids"] for f in folds] == [["03_dr"], ["02_g"]] and saved["eval_ids"] == ["03_dr"]
    for f in folds:
        assert not set(f["eval_ids"]) & set(f["train_ids"]) and len(f["train_ids"]) == 3
    annotated = sum(int((files.read_mask(tmp_path / "hrf" / "masks" / f"{i}.png") != 255).sum())
                    for i in ("03_dr", "02_g"))
    for name in ("global_local", "patch_only"):
        summed = np.sum([f[f"{name}_confusion"] for f in folds], axis=0)
        assert saved[f"{name}_confusion"] == summed.tolist() and summed.sum() == annotated
        assert saved[f"{name}_iou"] == hr.scores_from_confusion(name, summed, ["background", "vessel"])[f"{name}_iou"]
        assert saved[f"{name}_fold_iou"] == [f[f"{name}_iou"] for f in folds]
    assert saved["cross_validation"]["folds"] == 2 and saved["cross_validation"]["eval_images"] == 2
    assert out.with_name("cv_global_local.pt").exists()
    err = capsys.readouterr().err
    assert "fold 2/2: evaluation images 02_g" in err and "global_local: vessel IoU" in err and "in 2 folds" in err
    with pytest.raises(ValueError, match=r"fold 4 .*train\.txt has 4"):      # before any training
        bench_highres(str(tmp_path / "hrf"), "train", str(out), train_n=3, eval_n=1, folds=5)


def test_bench_highres_refuses_bad_folds_in_one_line_before_prefect(tmp_path):
    """A fold past the images, or folds with an evaluation split, are the command's one error line (no
    Prefect traceback) and leave no result behind."""
    import subprocess
    import sys
    from pathlib import Path

    _synthetic_hrf(tmp_path / "hrf")
    (tmp_path / "hrf" / "val.txt").write_text("01_h\n")
    root = Path(__file__).resolve().parents[1]
    for extra, said in ((["--folds", "5"], "fold 4 of 1 evaluation images needs 5 ids"),
                        (["--folds", "2", "--eval-split", "val"], "there is only fold 0")):
        out = subprocess.run([sys.executable, "-m", "wsseg", "bench", "highres", "--data", str(tmp_path / "hrf"),
                              "--eval-n", "1", "--train-n", "3", "--out", str(tmp_path / "b" / "x.json"), *extra],
                             cwd=root, capture_output=True, text=True, timeout=300)
        errors = [line for line in out.stderr.splitlines() if "error" in line.lower()]
        assert out.returncode == 2 and len(errors) == 1 and said in errors[0], out.stderr
        assert "Traceback" not in out.stderr and not (tmp_path / "b" / "x.json").exists()


def test_reduce_fractions_keeps_a_class_thinner_than_a_reduced_pixel():
    """A one-pixel line in a 4x4 block is 1/4 of the block's area: the hard reduction loses it
    (background covers most of the block), the fractions keep its share; void-heavy blocks are
    all zero (ignored) and every other block's fractions sum to 1."""
    full = np.zeros((8, 8), np.uint8)
    full[:, 1] = 1                   # a vertical line, one pixel wide
    full[4:, 4:] = 255               # one block all void
    full[0:2, 4:8] = 2               # half of the top-right block is class 2
    np.testing.assert_array_equal(hr.reduce_mask(full, (2, 2)), [[0, 0], [0, 255]])
    q = hr.reduce_fractions(full, (2, 2), 3)
    assert q.shape == (3, 2, 2) and q.dtype == np.float32
    np.testing.assert_allclose(q[:, 0, 0], [0.75, 0.25, 0.0])
    np.testing.assert_allclose(q[:, 0, 1], [0.5, 0.0, 0.5])
    np.testing.assert_allclose(q[:, 1, 0], [0.75, 0.25, 0.0])
    np.testing.assert_array_equal(q[:, 1, 1], 0.0)


def test_soft_cross_entropy_of_one_hot_fractions_is_the_weighted_cross_entropy():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 5, 5, generator=g)
    y = torch.randint(0, 3, (2, 5, 5), generator=g)
    weights = [1.0, 2.0, 0.5]
    one_hot = torch.nn.functional.one_hot(y, 3).permute(0, 3, 1, 2).float()
    one_hot[0, :, 0, 0] = 0.0        # an ignored pixel
    y[0, 0, 0] = 255
    want = torch.nn.functional.cross_entropy(logits, y, weight=torch.tensor(weights), ignore_index=255)
    assert torch.allclose(hr.soft_cross_entropy(logits, one_hot, weights), want, atol=1e-6)
    # the loss is smallest when the predicted probabilities equal the fractions
    q = torch.tensor([0.8, 0.2, 0.0]).view(1, 3, 1, 1)
    at = lambda p: hr.soft_cross_entropy(torch.log(torch.tensor(p)).view(1, 3, 1, 1), q).item()
    assert at([0.8, 0.2, 1e-9]) < at([0.95, 0.05, 1e-9]) and at([0.8, 0.2, 1e-9]) < at([0.6, 0.4, 1e-9])


def test_training_against_soft_coarse_targets_learns_the_coarse_image():
    """train_highres with a coarse loss: the coarse head is trained on the class fractions,
    so after training its prediction on each coarse image follows the two halves of the mask."""
    from conftest import two_colour_images
    from wsseg.models.global_local import coarse_image, global_local, normalize
    images, masks = two_colour_images()
    torch.manual_seed(0)
    model = global_local(3, patch_size=32, width=8, blocks=(1, 1), coarse_head=True)
    _, losses = hr.train_highres(images, masks, model=model, patch_size=32, steps=30, batch=2, lr=1e-2, seed=0,
                                 coarse_loss=0.5)
    assert np.mean(losses[-3:]) < np.mean(losses[:3])
    with torch.no_grad():
        pred = model.coarse_logits(normalize(coarse_image(images[1], 32))[None]).argmax(1)[0].numpy()
    assert (pred[8:, :12] == 0).mean() > 0.9 and (pred[8:, 20:] == 2).mean() > 0.9
    with pytest.raises(ValueError, match="num_classes"):
        hr.PatchBatches(images, masks, patch_size=32, steps=1, batch=2, seed=0, use_global=True, coarse_targets=True)


def test_every_benchmark_variant_trains_evaluates_and_rebuilds_from_its_options():
    """Every name `bench highres --variants` lists builds from its options, trains a few steps to a finite
    loss, scores an IoU in [0, 1], and rebuilds from the options its checkpoint keeps into the same
    network (what `wsseg segment --model` does)."""
    from wsseg.tasks.store import build_network

    rng = np.random.default_rng(0)
    images, masks = [], []
    for _ in range(2):
        image = rng.integers(100, 130, (48, 64, 3)).astype(np.uint8)
        mask = np.zeros((48, 64), np.uint8)
        mask[20:23] = 1
        image[mask == 1] = 20
        images.append(image), masks.append(mask)
    data = hr.BenchData(["a", "b"], ["a"], images, masks, images[:1], masks[:1])
    options = dict(patch_size=32, width=8, blocks=(1, 1), backbone="hrnet")
    x = torch.from_numpy(rng.standard_normal((1, 3, 32, 32)).astype(np.float32))
    for name, variant in hr.VARIANTS.items():
        model, opts, figures = hr.train_variant(name, data, options=options, steps=3, batch=2, lr=1e-3, seed=0,
                                                device="cpu", balanced=0.0, class_weights=None,
                                                log=lambda line: None)
        assert np.isfinite(figures[f"{name}_final_loss"]), name
        _, scores = hr.evaluate_variant(name, model, data, mode=variant.mode, overlap=0, batch=2, device="cpu",
                                        log=lambda line: None)
        assert 0.0 <= scores[f"{name}_iou"] <= 1.0, name
        again = build_network("global_local", 2, in_channels=3, **opts,
                              **({} if variant.use_global else {"use_global": False})).eval()
        again.load_state_dict(model.state_dict())          # strict: the same modules from the same options
        assert again.coarse_detach == model.coarse_detach == bool(variant.options.get("coarse_detach")), name
        run = (lambda net: net(x)) if variant.use_global else (lambda net: net.forward_patches(x))
        with torch.no_grad():
            torch.testing.assert_close(run(again), run(model))


def test_bench_highres_help_names_every_variant():
    """`wsseg bench highres --help` says what each network of ``--variants`` is: every name of
    ``VARIANTS`` appears in it (a variant added without a word of help fails here)."""
    from wsseg.flows import cli_bench

    highres = cli_bench.add_bench_highres_parser(argparse.ArgumentParser(prog="wsseg bench").add_subparsers())
    text = " ".join(highres.format_help().split())
    missing = [name for name in hr.VARIANTS if not re.search(rf"\b{name}\b", text)]
    assert not missing, f"--variants help does not name {missing}"
