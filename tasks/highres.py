"""Method C (METHOD.md C) on fully annotated high-resolution images: data, training, scoring and
the pieces of ``wsseg bench highres``.

* data: :func:`load_split`, :func:`load_images` (images at a working scale, masks reduced by
  area, :func:`reduce_mask`), :func:`upsample_labels`;
* training: :class:`PatchBatches` (random patches of whole images with each image's coarse
  version and the patch's box) through the one training loop :func:`tasks.training.fit`
  (:func:`train_highres`);
* scoring: :func:`predict`, :func:`vessel_scores`;
* the benchmark's steps: :func:`train_variant`, :func:`evaluate_variant`, :func:`save_bench_model`,
  :func:`write_overlay`, :func:`measure_segment_memory` (peak memory of the real ``wsseg segment``
  command in a subprocess).

Working resolution: HRF photographs are 3504 x 2336; the benchmark processes them at
``scale=0.5`` (1752 x 1168, decoded directly at half size by the JPEG decoder), with masks
reduced by area (a working pixel is vessel when at least half of its full-resolution
pixels are, ignore when less than half are inside the field of view).  Predictions are
upsampled back (nearest) and scored against the original full-resolution masks.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from tasks.memory import status_kb
from tasks.store import files
from tasks.training import BatchSource

__all__ = ["reduce_mask", "upsample_labels", "load_split", "load_images", "PatchBatches", "train_highres",
           "vessel_scores", "predict", "BenchData", "load_bench_data", "train_variant", "evaluate_variant",
           "save_bench_model", "write_overlay", "measure_segment_memory", "VARIANTS"]

_ROOT = Path(__file__).resolve().parents[1]

#: the benchmark's variants: (name, use_global, inference mode, trained on the downsampled images)
VARIANTS = (("global_local", True, "patches", False), ("patch_only", False, "patches", False),
            ("downsampled", False, "downsampled", True))


def _say(line: str) -> None:
    """Progress of the benchmark on stderr (stdout is for its result, see ``--json``)."""
    print(line, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------
def reduce_mask(mask: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """Reduce a 0/1/255 vessel mask to ``shape`` (H, W) by area.

    A pixel is ignore (255) when less than half its area is annotated, else vessel (1)
    when at least half of its annotated area is vessel, else 0.
    """
    import cv2
    if mask.shape == tuple(shape):
        return mask.copy()
    size = (shape[1], shape[0])
    valid = cv2.resize((mask != 255).astype(np.float32), size, interpolation=cv2.INTER_AREA)
    vessel = cv2.resize((mask == 1).astype(np.float32), size, interpolation=cv2.INTER_AREA)
    out = (vessel >= 0.5 * np.maximum(valid, 1e-6)).astype(np.uint8)
    out[valid < 0.5] = 255
    return out


def upsample_labels(labels, height: int, width: int, *, out=None, band: int = 1024):
    """Nearest-neighbour resize of an (h, w) label map to (height, width), band by band.

    Source pixel of output (r, c) is ``(floor(r * h / height), floor(c * w / width))``
    (OpenCV's INTER_NEAREST).  ``out`` may be any writable array-like (e.g. zarr).
    """
    h, w = labels.shape
    out = np.empty((height, width), dtype=labels.dtype) if out is None else out
    cols = np.minimum((np.arange(width) * w) // width, w - 1)
    for r0 in range(0, height, band):
        rows = np.minimum((np.arange(r0, min(r0 + band, height)) * h) // height, h - 1)
        src = np.asarray(labels[int(rows[0]):int(rows[-1]) + 1])
        out[r0:r0 + len(rows)] = src[rows - rows[0]][:, cols]
    return out


def load_split(data_dir: str | os.PathLike, split: str = "train", *, train_n: int = 12,
               eval_n: int = 3) -> tuple[list[str], list[str]]:
    """Ids of ``<data_dir>/<split>.txt`` divided into training and evaluation ids.

    Evaluation ids are taken from the end of each id-suffix group in turn (for HRF: the
    last healthy, glaucoma and diabetic image), training ids are the first ``train_n`` of
    the rest.
    """
    ids = files.dataset_ids(data_dir, split)
    if train_n < 1 or eval_n < 1 or train_n + eval_n > len(ids):
        raise ValueError(f"train_n + eval_n must be between 2 and {len(ids)} (the ids in "
                         f"{Path(data_dir) / f'{split}.txt'})")
    groups: dict[str, list[str]] = {}
    for i in ids:
        groups.setdefault(i.rsplit("_", 1)[-1], []).append(i)
    evals: list[str] = []
    while len(evals) < eval_n:
        for g in sorted(groups):
            if groups[g] and len(evals) < eval_n:
                evals.append(groups[g].pop())
    train = [i for i in ids if i not in evals][:train_n]
    return train, sorted(evals)


def load_images(data_dir: str | os.PathLike, ids: Sequence[str], scale: float, full_masks: bool = False):
    """Images at ``scale``, their masks reduced to that size and (``full_masks``) the original masks."""
    images, masks, originals = [], [], []
    for i in ids:
        image = files.read_image(files.dataset_image_path(data_dir, i), scale)
        mask = files.read_mask(files.dataset_mask_path(data_dir, i))
        images.append(image)
        masks.append(reduce_mask(mask, image.shape[:2]))
        if full_masks:
            originals.append(mask)
    return images, masks, originals


# ---------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------
class PatchBatches(BatchSource):
    """Method C's training batches (a :class:`tasks.training.BatchSource`).

    Each step draws ``images_per_batch`` images, flips each at random (horizontally and/or
    vertically; the coarse image is flipped with it), and cuts ``batch`` random
    ``patch_size`` patches from them (``balanced``: that share centred on a random foreground
    pixel); a patch's coarse image is its whole image resized to ``patch_size``
    (:func:`models.global_local.coarse_image`) and its box is its position in coarse pixels.
    A batch is ``({"patches", "coarse", "boxes"}, target)`` (without coarse and boxes when
    ``use_global`` is False), for ``model.forward_patches(**x)``.
    """

    def __init__(self, images: Sequence[np.ndarray], masks: Sequence[np.ndarray], *, patch_size: int, steps: int,
                 batch: int, seed: int, use_global: bool, balanced: float = 0.0, images_per_batch: int = 2):
        from models.global_local import coarse_image
        self.images, self.masks, self.p, self.batch = images, masks, patch_size, batch
        self.steps_per_epoch, self.seed, self.balanced, self.images_per_batch = steps, seed, balanced, images_per_batch
        self.coarse = [coarse_image(im, patch_size) for im in images] if use_global else None
        self.fg = [np.flatnonzero((m > 0) & (m != 255)).astype(np.int64) for m in masks] if balanced > 0 else None

    def batches(self, start_epoch: int, epochs: int):
        import torch

        from models.global_local import normalize
        from models.tiling import extract_patches

        rng = np.random.default_rng(self.seed)
        p, batch, images, masks, fg, coarse = self.p, self.batch, self.images, self.masks, self.fg, self.coarse
        for _ in range(self.steps_per_epoch * (epochs - start_epoch)):
            n_img = min(self.images_per_batch, batch)
            picks = rng.choice(len(images), n_img, replace=len(images) < n_img)
            patches, targets, coarses, boxes = [], [], [], []
            for j, k in enumerate(picks):
                flip_y, flip_x = rng.random(2) < 0.5
                sl = (slice(None, None, -1 if flip_y else 1), slice(None, None, -1 if flip_x else 1))
                image, mask = images[k][sl], masks[k][sl]
                height, width = mask.shape
                for _ in range(len(range(j, batch, n_img))):
                    if fg is not None and len(fg[k]) and rng.random() < self.balanced:
                        cy, cx = divmod(int(fg[k][rng.integers(len(fg[k]))]), masks[k].shape[1])
                        cy = height - 1 - cy if flip_y else cy
                        cx = width - 1 - cx if flip_x else cx
                        y0 = int(np.clip(cy - p // 2, 0, max(height - p, 0)))
                        x0 = int(np.clip(cx - p // 2, 0, max(width - p, 0)))
                    else:
                        y0 = int(rng.integers(max(height - p, 0) + 1))
                        x0 = int(rng.integers(max(width - p, 0) + 1))
                    box = [(y0, x0, y0 + p, x0 + p)]
                    patches.append(extract_patches(image, box)[0])
                    targets.append(extract_patches(mask, box, channel_axis=None, pad_value=255)[0])
                    boxes.append([j, x0 * p / width, y0 * p / height, (x0 + p) * p / width, (y0 + p) * p / height])
                if coarse is not None:
                    coarses.append(coarse[k][sl])
            x = {"patches": normalize(np.stack(patches))}
            if coarse is not None:
                x["coarse"] = normalize(np.stack(coarses))
                x["boxes"] = torch.tensor(boxes, dtype=torch.float32)
            yield x, torch.from_numpy(np.stack(targets).astype(np.int64))


def _forward_patches(model, x: dict):
    return model.forward_patches(**x)


def train_highres(images: Sequence[np.ndarray], masks: Sequence[np.ndarray], *, model, patch_size: int,
                  steps: int, batch: int = 4, lr: float = 2e-3, seed: int = 0, device: str = "cpu",
                  log: Callable[[dict], None] | None = None, balanced: float = 0.0,
                  class_weights: Sequence[float] | None = None, images_per_batch: int = 2,
                  log_every: int = 10):
    """Train a global-local network on random patches of annotated images (:class:`PatchBatches`)
    with :func:`tasks.training.fit`: cross-entropy ignoring 255 (a batch with no annotated pixel
    is skipped), AdamW with 5 % linear warm-up and cosine decay, ``steps`` steps.

    Parameters
    ----------
    images : sequence of (H, W, 3) uint8
        Training images (any sizes; smaller than a patch: padded and ignored).
    masks : sequence of (H, W) uint8
        Class per pixel, 255 = ignore.
    model : GlobalLocalNet
        Trained in place (``model.use_global`` decides whether coarse inputs are used).
    patch_size : int
        Must equal ``model.patch_size``.
    steps, batch : int
        Optimisation steps and patches per step.
    lr : float
        Peak learning rate.
    seed : int
        Seeds patch sampling, flips and torch.
    device : str
        Torch device.
    log : callable(dict), optional
        Receives ``{"step", "loss", "lr", "seconds"}`` every ``log_every`` steps.
    balanced : float
        Fraction of patches centred on a random foreground (class > 0) pixel; the rest
        are placed uniformly.
    class_weights : sequence of float, optional
        Cross-entropy class weights.

    Returns
    -------
    model : GlobalLocalNet
        The trained model, in eval mode.
    losses : list of float
        Loss of every step (NaN for a skipped batch).

    Raises
    ------
    ValueError
        On mismatched inputs or a patch size different from the model's.
    """
    from tasks import training as tr

    if len(images) == 0 or len(images) != len(masks):
        raise ValueError(f"need as many masks as images (> 0), got {len(images)} images, {len(masks)} masks")
    for im, m in zip(images, masks):
        if im.ndim != 3 or im.dtype != np.uint8 or m.shape != im.shape[:2]:
            raise ValueError(f"images must be (H, W, 3) uint8 with (H, W) masks, got {im.shape} {im.dtype} "
                             f"and {m.shape}")
    if patch_size != model.patch_size:
        raise ValueError(f"patch_size={patch_size} differs from model.patch_size={model.patch_size}")
    if steps < 1 or batch < 1:
        raise ValueError(f"steps and batch must be >= 1, got {steps}, {batch}")
    if not 0.0 <= balanced <= 1.0:
        raise ValueError(f"balanced must be a fraction in [0, 1], got {balanced}")

    source = PatchBatches(images, masks, patch_size=patch_size, steps=steps, batch=batch, seed=seed,
                          use_global=model.use_global, balanced=balanced, images_per_batch=images_per_batch)
    cfg = tr.TrainConfig(epochs=1, batch_size=batch, lr=lr, weight_decay=1e-4, seed=seed, device=device,
                         patience=10 ** 9, schedule="warmup_cosine", skip_unlabelled=True,
                         class_weights=class_weights)
    losses: list[float] = []

    def on_step(s: dict) -> None:
        losses.append(s["loss"])
        step = s["step"]
        if log is not None and s["loss"] == s["loss"] and (step % log_every == 0 or step == steps):
            recent = [v for v in losses[-log_every:] if v == v]
            log({"step": step, "loss": float(np.mean(recent)) if recent else float("nan"), "lr": float(s["lr"]),
                 "seconds": round(s["seconds"], 1)})

    tr.fit(model, source, tr.segmentation_loss(class_weights), cfg, on_step=on_step, forward=_forward_patches)
    return model.eval(), losses


# ---------------------------------------------------------------------------------------
# evaluation
# ---------------------------------------------------------------------------------------
def vessel_scores(preds: Sequence[np.ndarray], masks: Sequence[np.ndarray], *, positive: int = 1) -> dict:
    """Pooled IoU and F1 of class ``positive`` over images; mask 255 is ignored.

    Returns ``{"iou", "f1", "tp", "fp", "fn"}`` (counts summed over all images).
    """
    tp = fp = fn = 0
    for pred, mask in zip(preds, masks):
        if pred.shape != mask.shape:
            raise ValueError(f"prediction {pred.shape} and mask {mask.shape} differ in shape")
        valid = mask != 255
        p, t = (pred == positive) & valid, (mask == positive) & valid
        tp += int((p & t).sum())
        fp += int((p & ~t).sum())
        fn += int((~p & t).sum())
    return {"iou": tp / max(tp + fp + fn, 1), "f1": 2 * tp / max(2 * tp + fp + fn, 1), "tp": tp, "fp": fp, "fn": fn}


def predict(model, image: np.ndarray, *, mode: str, overlap: int = 0, batch: int = 4, device: str = "cpu") -> np.ndarray:
    """(H, W) uint8 labels of a working-resolution image.

    ``mode="patches"``: :func:`models.global_local.segment_large` (with or without global
    inputs, as the model says); ``mode="downsampled"``: the whole image resized to
    ``model.patch_size`` square, logits resized back bilinearly, argmax.
    """
    import torch
    import torch.nn.functional as F

    from models.global_local import coarse_image, normalize, segment_large
    if mode == "patches":
        return segment_large(model, image, overlap=overlap, batch=batch, device=device)
    if mode != "downsampled":
        raise ValueError(f"mode must be 'patches' or 'downsampled', got {mode!r}")
    x = normalize(coarse_image(image, model.patch_size))[None].to(device)
    with torch.no_grad():
        logits = model.eval().to(device).forward_patches(x)
        logits = F.interpolate(logits, size=image.shape[:2], mode="bilinear", align_corners=False)
    return logits[0].argmax(0).to(torch.uint8).cpu().numpy()


def overlay_panel(image: np.ndarray, truth: np.ndarray, pred: np.ndarray, width: int = 1200) -> np.ndarray:
    """image | ground truth (ignore grey) | prediction, side by side, each ``width`` px wide (RGB)."""
    import cv2
    h, w = truth.shape
    size = (width, max(1, round(h * width / w)))
    img = cv2.resize(image, size, interpolation=cv2.INTER_AREA)
    gt = np.where(truth == 255, 96, np.where(truth == 1, 255, 0)).astype(np.uint8)
    gt = cv2.resize(gt, size, interpolation=cv2.INTER_AREA)
    pr = cv2.resize((pred == 1).astype(np.uint8) * 255, size, interpolation=cv2.INTER_AREA)
    return np.concatenate([img, np.repeat(gt[..., None], 3, 2), np.repeat(pr[..., None], 3, 2)], axis=1)


# ---------------------------------------------------------------------------------------
# the benchmark's steps
# ---------------------------------------------------------------------------------------
@dataclass
class BenchData:
    train_ids: list[str]
    eval_ids: list[str]
    images: list[np.ndarray]
    masks: list[np.ndarray]
    eval_images: list[np.ndarray]
    eval_full_masks: list[np.ndarray]


def load_bench_data(data_dir: str | os.PathLike, split: str, *, train_n: int, eval_n: int, scale: float) -> BenchData:
    """Training images and masks at ``scale``; evaluation images at ``scale`` with their full masks."""
    train_ids, eval_ids = load_split(data_dir, split, train_n=train_n, eval_n=eval_n)
    images, masks, _ = load_images(data_dir, train_ids, scale)
    ev_images, _, ev_full = load_images(data_dir, eval_ids, scale, full_masks=True)
    return BenchData(train_ids, eval_ids, images, masks, ev_images, ev_full)


def train_variant(name: str, data: BenchData, *, use_global: bool, downsampled: bool, options: dict, steps: int,
                  batch: int, lr: float, seed: int, device: str, balanced: float,
                  class_weights: Sequence[float] | None, log: Callable[[str], None] = _say):
    """Build (seeded) and train one variant; returns (model, {"<name>_train_seconds", "<name>_final_loss"})."""
    import cv2
    import torch

    import models

    images, masks = data.images, data.masks
    if downsampled:
        p = options["patch_size"]
        images = [cv2.resize(im, (p, p), interpolation=cv2.INTER_AREA) for im in images]
        masks = [reduce_mask(m, (p, p)) for m in masks]
    torch.manual_seed(seed)
    model = models.build_model("global_local", 2, in_channels=3, **options, **({} if use_global else {"use_global": False}))
    t = time.perf_counter()
    model, losses = train_highres(images, masks, model=model, patch_size=options["patch_size"], steps=steps,
                                  batch=batch, lr=lr, seed=seed, device=device, balanced=balanced,
                                  class_weights=class_weights, log_every=max(1, steps // 5),
                                  log=lambda d: log(f"  {name} step {d['step']}: loss {d['loss']:.4f} "
                                                    f"({d['seconds']} s)"))
    return model, {f"{name}_train_seconds": round(time.perf_counter() - t, 1),
                   f"{name}_final_loss": float(np.nanmean(losses[-max(1, steps // 10):]))}


def evaluate_variant(name: str, model, data: BenchData, *, mode: str, overlap: int, batch: int, device: str,
                     log: Callable[[str], None] = _say) -> tuple[list[np.ndarray], dict]:
    """Predictions at full resolution on the evaluation images and their pooled vessel IoU / F1."""
    t = time.perf_counter()
    preds = []
    for image, full in zip(data.eval_images, data.eval_full_masks):
        pred = predict(model, image, mode=mode, overlap=overlap, batch=batch, device=device)
        preds.append(upsample_labels(pred, *full.shape))
    scores = vessel_scores(preds, data.eval_full_masks)
    log(f"  {name}: vessel IoU {scores['iou']:.4f}  F1 {scores['f1']:.4f}")
    return preds, {f"{name}_iou": scores["iou"], f"{name}_f1": scores["f1"],
                   f"{name}_eval_seconds": round(time.perf_counter() - t, 1)}


def save_bench_model(out_json: str | os.PathLike, model, *, options: dict, scale: float, overlap: int) -> Path:
    """The global-local checkpoint beside the bench JSON (what ``wsseg segment --model`` reads)."""
    from tasks.store import save_model
    return save_model(files.bench_outputs(out_json)[0], model, builder="global_local", num_classes=2, in_channels=3,
                      options=options, meta={"scale": scale, "overlap": overlap, "classes": ["background", "vessel"]})


def write_overlay(out_json: str | os.PathLike, data_dir: str | os.PathLike, data: BenchData,
                  pred: np.ndarray) -> Path:
    """image | truth | prediction of the first evaluation image, beside the bench JSON."""
    full_image = files.read_image(files.dataset_image_path(data_dir, data.eval_ids[0]), 1.0)
    return files.write_rgb_png(files.bench_outputs(out_json)[1], overlay_panel(full_image, data.eval_full_masks[0], pred))


def run_segment_command(checkpoint: Path, image: Path, out_dir: Path, *, overlap: int, batch: int,
                        threads: int) -> dict:
    """Run ``wsseg segment`` on one image in a fresh process; its report (``segment.json``) plus the
    process's peak resident set size (``VmHWM`` polled from /proc while it runs, in MB)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))}
    api = _prefect_api_url()
    if api:
        env["PREFECT_API_URL"] = api        # the parent's Prefect API: the child starts no server of its own
    cmd = [sys.executable, "-m", "flows.cli", "segment", str(image), "--model", str(checkpoint), "--out",
           str(out_dir), "--overlap", str(overlap), "--batch", str(batch), "--threads", str(threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(_ROOT))
    peak = 0
    while proc.poll() is None:
        hwm = status_kb(proc.pid, "VmHWM")
        peak = max(peak, hwm or 0)
        time.sleep(0.02)
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"memory probe `wsseg segment {image.name}` failed:\n{err[-2000:]}")
    report = files.read_json(Path(out_dir) / "segment.json")
    peak_mb = peak / 1024 if peak else report["peak_rss_mb"]
    return {**report["images"][0], "peak_rss_mb": max(peak_mb, report["peak_rss_mb"]),
            "rss_before_mb": report["rss_before_mb"]}


def _prefect_api_url() -> str | None:
    url = os.environ.get("PREFECT_API_URL")
    if url:
        return url
    try:
        from prefect.settings import get_current_settings
        url = get_current_settings().api.url
    except Exception:  # noqa: BLE001  (no Prefect, or no API configured: the child starts its own)
        return None
    return url or None


def measure_segment_memory(checkpoint: Path, image: Path, *, overlap: int, batch: int, threads: int) -> dict:
    """Peak memory of ``wsseg segment`` on ``image`` (1x) and on a JPEG of twice its side (2x), each in a
    fresh process; CPU throughput of the inference. Returns the benchmark's ``peak_mem_*``,
    ``probe_*``, ``mpix_per_s*`` and ``segment_seconds_*`` figures."""
    import cv2

    with tempfile.TemporaryDirectory() as tmp:
        big = Path(tmp) / f"{image.stem}_2x.jpg"
        src = files.read_image(image)
        files.write_jpeg(big, cv2.resize(src, (2 * src.shape[1], 2 * src.shape[0]), interpolation=cv2.INTER_LINEAR))
        del src
        kw = dict(overlap=overlap, batch=batch, threads=threads)
        one = run_segment_command(checkpoint, image, Path(tmp) / "1x_out", **kw)
        two = run_segment_command(checkpoint, big, Path(tmp) / "2x_out", **kw)
    work_px = lambda r: r["working_size"][0] * r["working_size"][1]
    return {
        "peak_mem_mb_1x": round(one["peak_rss_mb"], 1), "peak_mem_mb_2x": round(two["peak_rss_mb"], 1),
        "peak_mem_ratio_2x": round(two["peak_rss_mb"] / one["peak_rss_mb"], 4),
        "peak_mem_increment_mb_1x": round(one["peak_rss_mb"] - one["rss_before_mb"], 1),
        "peak_mem_increment_mb_2x": round(two["peak_rss_mb"] - two["rss_before_mb"], 1),
        "probe_sizes": {tag: {"image": r["size"], "working": r["working_size"]} for tag, r in (("1x", one), ("2x", two))},
        "probe_fov_share": round(one["fov_share"], 4),
        "mpix_per_s": round(work_px(two) / two["inference_seconds"] / 1e6, 4),
        "mpix_per_s_1x": round(work_px(one) / one["inference_seconds"] / 1e6, 4),
        "segment_seconds_1x": round(one["seconds"], 2), "segment_seconds_2x": round(two["seconds"], 2),
    }
