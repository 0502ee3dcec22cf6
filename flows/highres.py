"""Ultra-high-resolution segmentation (METHOD.md C): training, benchmark and inference.

* :func:`train_highres` trains a :class:`models.global_local.GlobalLocalNet` on random
  patches of fully annotated high-resolution images (each patch with its image's coarse
  version and its box), mask value 255 = ignore.
* :func:`bench_highres` compares, on the same images and step budget, (a) global-local,
  (b) the same network on patches without the global inputs (``use_global=False``) and
  (c) the whole image downsampled to the patch size and the logits upsampled back; it
  measures the peak memory of :func:`segment` on an image at its original size and at
  twice its side, and the CPU throughput, and writes a JSON summary plus an overlay PNG.
* :func:`segment` applies a saved checkpoint (or a run's final model,
  :func:`resolve_checkpoint`) to images of any size: palette PNG per image written band by
  band, plus a Zarr array when the output exceeds 50 megapixels; pixels outside a fundus
  camera's field of view get class 0 (:mod:`tasks.fov`). A ``small`` or ``fusion`` model of
  a ``wsseg train`` run labels each image whole instead (:func:`segment_whole`), gated by the
  run's image classifier, with an overlay picture per image.

Working resolution: HRF photographs are 3504 x 2336; the benchmark processes them at
``scale=0.5`` (1752 x 1168, decoded directly at half size by the JPEG decoder), with masks
reduced by area (a working pixel is vessel when at least half of its full-resolution
pixels are, ignore when less than half are inside the field of view).  Predictions are
upsampled back (nearest) and scored against the original full-resolution masks.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

__all__ = ["read_image", "read_mask", "reduce_mask", "upsample_labels", "load_split", "train_highres",
           "vessel_scores", "predict", "bench_highres", "segment", "segment_whole", "resolve_checkpoint", "write_palette_png",
           "upsampled_class_shares", "add_segment_parser", "add_bench_highres_parser"]

_ROOT = Path(__file__).resolve().parents[1]
LARGE_OUTPUT_PIXELS = 50_000_000
SPILL_PIXELS = 1_000_000        # segment(): working images above this wait on disk (Zarr) during inference


# ---------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------
def read_image(path: str | os.PathLike, scale: float = 1.0) -> np.ndarray:
    """Read an RGB image as (H, W, 3) uint8, optionally reduced by ``scale`` (<= 1).

    JPEGs are decoded directly at 1/2, 1/4 or 1/8 size when ``scale`` is one of those
    (size ``ceil(side * scale)``); for other scales below 1 they are decoded at the
    smallest of those reductions that is still at least ``scale``, then resized (area) to
    ``round(side * scale)``.  The full-size pixels of a JPEG are thus never held in memory
    when ``scale <= 0.5``.  Other formats are decoded whole, then resized.
    """
    import cv2
    flags = {0.5: cv2.IMREAD_REDUCED_COLOR_2, 0.25: cv2.IMREAD_REDUCED_COLOR_4,
             0.125: cv2.IMREAD_REDUCED_COLOR_8}
    if not 0 < scale <= 1:
        raise ValueError(f"scale must lie in (0, 1], got {scale}")
    path = str(path)
    jpeg = path.lower().endswith((".jpg", ".jpeg"))
    fast = jpeg and scale in flags
    flag = cv2.IMREAD_COLOR
    if fast:
        flag = flags[scale]
    elif jpeg and scale < 1:
        reductions = [f for f in sorted(flags) if f >= scale]     # 0.125 < 0.25 < 0.5
        flag = flags[reductions[0]] if reductions else cv2.IMREAD_COLOR
    size = None
    if scale != 1.0 and not fast:
        h, w = _image_size(Path(path))
        size = (max(1, round(w * scale)), max(1, round(h * scale)))
    bgr = cv2.imread(path, flag)
    if bgr is None:
        raise ValueError(f"cannot read image {path!r}; pass a JPEG/PNG/TIFF file path")
    image = cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB, dst=bgr)       # in place: one copy of the pixels
    if size is not None and image.shape[1::-1] != size:
        image = cv2.resize(image, size, interpolation=cv2.INTER_AREA)
    return image


def read_mask(path: str | os.PathLike) -> np.ndarray:
    """Read a label mask PNG (palette or grey) as (H, W) uint8 class indices."""
    from PIL import Image
    with Image.open(path) as im:
        if im.mode not in ("P", "L"):
            raise ValueError(f"{path}: mask must be a palette or greyscale PNG of class indices, got {im.mode}")
        return np.array(im)


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
    listing = Path(data_dir) / f"{split}.txt"
    if not listing.exists():
        raise ValueError(f"{listing} not found; data_dir must hold images/, masks/ and {split}.txt")
    ids = [s.strip() for s in listing.read_text().splitlines() if s.strip()]
    if train_n < 1 or eval_n < 1 or train_n + eval_n > len(ids):
        raise ValueError(f"train_n + eval_n must be between 2 and {len(ids)} (the ids in {listing})")
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


def _load(data_dir: Path, ids: Sequence[str], scale: float, full_masks: bool = False):
    images, masks, originals = [], [], []
    for i in ids:
        image = read_image(data_dir / "images" / f"{i}.jpg", scale)
        mask = read_mask(data_dir / "masks" / f"{i}.png")
        images.append(image)
        masks.append(reduce_mask(mask, image.shape[:2]))
        if full_masks:
            originals.append(mask)
    return images, masks, originals


# ---------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------
def train_highres(images: Sequence[np.ndarray], masks: Sequence[np.ndarray], *, model, patch_size: int,
                  steps: int, batch: int = 4, lr: float = 2e-3, seed: int = 0, device: str = "cpu",
                  log: Callable[[dict], None] | None = None, balanced: float = 0.0,
                  class_weights: Sequence[float] | None = None, images_per_batch: int = 2,
                  log_every: int = 10):
    """Train a global-local network on random patches of annotated images.

    Each step draws ``images_per_batch`` images, flips each at random (horizontally and/or
    vertically; the coarse image is flipped with it), and cuts ``batch`` random
    ``patch_size`` patches from them; a patch's coarse image is its whole image resized to
    ``patch_size`` (:func:`models.global_local.coarse_image`) and its box is its position
    in coarse pixels.  Loss: cross-entropy ignoring 255.  AdamW with 5 % linear warm-up
    and cosine decay.

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
        Loss of every step.

    Raises
    ------
    ValueError
        On mismatched inputs or a patch size different from the model's.
    """
    import torch
    import torch.nn.functional as F

    from models.global_local import coarse_image, normalize
    from tasks.tiling import extract_patches

    # 1. validate
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

    # 2. prepare
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    p = patch_size
    coarse = [coarse_image(im, p) for im in images] if model.use_global else None
    fg = [np.flatnonzero((m > 0) & (m != 255)).astype(np.int64) for m in masks] if balanced > 0 else None
    weight = None if class_weights is None else torch.tensor(class_weights, dtype=torch.float32, device=device)
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + np.cos(np.pi * (s - warm) / max(1, steps - warm))))
    losses: list[float] = []
    t0 = time.perf_counter()

    # 3. optimise
    for step in range(steps):
        n_img = min(images_per_batch, batch)
        picks = rng.choice(len(images), n_img, replace=len(images) < n_img)
        patches, targets, coarses, boxes = [], [], [], []
        for j, k in enumerate(picks):
            flip_y, flip_x = rng.random(2) < 0.5
            sl = (slice(None, None, -1 if flip_y else 1), slice(None, None, -1 if flip_x else 1))
            image, mask = images[k][sl], masks[k][sl]
            height, width = mask.shape
            for _ in range(len(range(j, batch, n_img))):
                if fg is not None and len(fg[k]) and rng.random() < balanced:
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
        x = normalize(np.stack(patches)).to(device)
        y = torch.from_numpy(np.stack(targets).astype(np.int64)).to(device)
        if (y != 255).sum() == 0:
            losses.append(float("nan"))
            continue
        if coarse is not None:
            c = normalize(np.stack(coarses)).to(device)
            b = torch.tensor(boxes, dtype=torch.float32, device=device)
            logits = model.forward_patches(x, c, b)
        else:
            logits = model.forward_patches(x)
        loss = F.cross_entropy(logits, y, weight=weight, ignore_index=255)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if log is not None and ((step + 1) % log_every == 0 or step + 1 == steps):
            recent = [v for v in losses[-log_every:] if v == v]
            log({"step": step + 1, "loss": float(np.mean(recent)) if recent else float("nan"),
                 "lr": float(sched.get_last_lr()[0]), "seconds": round(time.perf_counter() - t0, 1)})
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


def _overlay_png(path: Path, image: np.ndarray, truth: np.ndarray, pred: np.ndarray, width: int = 1200) -> None:
    """image | ground truth (ignore grey) | prediction, side by side, each ``width`` px wide."""
    import cv2
    h, w = truth.shape
    size = (width, max(1, round(h * width / w)))
    img = cv2.resize(image, size, interpolation=cv2.INTER_AREA)
    gt = np.where(truth == 255, 96, np.where(truth == 1, 255, 0)).astype(np.uint8)
    gt = cv2.resize(gt, size, interpolation=cv2.INTER_AREA)
    pr = cv2.resize((pred == 1).astype(np.uint8) * 255, size, interpolation=cv2.INTER_AREA)
    panel = np.concatenate([img, np.repeat(gt[..., None], 3, 2), np.repeat(pr[..., None], 3, 2)], axis=1)
    cv2.imwrite(str(path), np.ascontiguousarray(panel[..., ::-1]))


# ---------------------------------------------------------------------------------------
# memory probe (runs in a subprocess: peak RSS of one streamed inference)
# ---------------------------------------------------------------------------------------
def _rss_mb(field: str = "VmRSS") -> float:
    """This process's resident set size (``VmRSS``) or its peak (``VmHWM``), in MB.

    ``VmHWM`` belongs to the process's own address space; ``getrusage``'s ``ru_maxrss``
    would not do here, because Linux carries it over from the (large) parent through
    fork and exec.
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _probe(checkpoint: str, image: str, out_dir: str, overlap: int, batch: int, threads: int) -> dict:
    """One :func:`segment` call on one image file in this (fresh) process; its peak RSS."""
    import torch

    import models.global_local  # noqa: F401  (imported before the baseline, as segment's code)
    import tasks.fov  # noqa: F401
    torch.set_num_threads(threads)
    rss0 = _rss_mb()
    stats: list[dict] = []
    segment([image], checkpoint, out_dir, overlap=overlap, batch=batch, stats=stats, log=lambda _: None)
    return {"peak_rss_mb": _rss_mb("VmHWM"), "rss_before_mb": rss0, **stats[0]}


def _run_probe(checkpoint: Path, image: Path, tmp: Path, tag: str, *, overlap: int, batch: int,
               threads: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "flows.highres", "_probe", str(checkpoint), str(image), str(tmp / f"{tag}_out"),
           str(overlap), str(batch), str(threads)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(_ROOT))
    if res.returncode != 0:
        raise RuntimeError(f"memory probe on {image} failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _write_doubled_jpeg(src: Path, dst: Path) -> tuple[int, int]:
    """Write ``src`` enlarged to twice its side (bilinear) as a JPEG (quality 95); returns its (H, W)."""
    import cv2
    image = cv2.imread(str(src), cv2.IMREAD_COLOR)
    if image is None:
        raise ValueError(f"cannot read image {src}")
    big = cv2.resize(image, (2 * image.shape[1], 2 * image.shape[0]), interpolation=cv2.INTER_LINEAR)
    del image
    if not cv2.imwrite(str(dst), big, [cv2.IMWRITE_JPEG_QUALITY, 95]):
        raise ValueError(f"cannot write {dst}")
    return big.shape[0], big.shape[1]


# ---------------------------------------------------------------------------------------
# benchmark
# ---------------------------------------------------------------------------------------
def bench_highres(data_dir: str | os.PathLike, split: str, out_json: str | os.PathLike, *, train_n: int = 12,
                  eval_n: int = 3, patch_size: int = 256, scale: float = 0.5, steps: int = 400, batch: int = 4,
                  lr: float = 2e-3, width: int = 16, blocks: Sequence[int] = (1, 1, 1), overlap: int = 32,
                  balanced: float = 0.0, class_weights: Sequence[float] | None = (1.0, 2.0), seed: int = 0,
                  threads: int | None = 2, device: str = "cpu", log: Callable[[str], None] = print) -> dict:
    """Global-local vs. patches without context vs. downsampled whole image, on HRF-style data.

    All three variants use the same network (:func:`models.global_local.global_local`
    with ``width`` and ``blocks``), the same training images, ``steps`` steps of ``batch``
    ``patch_size`` inputs each, and the same seed:

    (a) ``global_local``: patches + coarse image + ROIAlign'd context, inference by
        :func:`models.global_local.segment_large` with ``overlap``;
    (b) ``patch_only``: ``use_global=False``, same patches and inference;
    (c) ``downsampled``: ``use_global=False`` trained on whole images resized to
        ``patch_size`` square; logits resized back bilinearly.

    Images are processed at ``scale`` of their size; predictions are resized back (nearest)
    and scored (vessel IoU and F1, pooled over the evaluation images) at full resolution.

    Memory: two fresh subprocesses each run :func:`segment` (what ``wsseg segment --model
    <checkpoint>`` does: read at the checkpoint's scale, field of view, patches, PNG) on the
    first evaluation image: the original file (``1x``) and a JPEG of twice its side
    (``2x``, bilinear enlargement written to a temporary folder).  ``peak_mem_mb_*`` is
    the subprocess's peak resident set size (``VmHWM``: Python, torch, the model and
    everything the call allocated); ``peak_mem_increment_mb_*`` is that peak minus the RSS
    just before the call; ``probe_sizes`` gives each image's size and working size.
    ``mpix_per_s`` = working pixels / seconds of the 2x inference (patches and stitching,
    :func:`models.global_local.segment_large`) on CPU with ``threads`` threads;
    ``segment_seconds_*`` are the whole calls (reading to PNG).

    Returns the dict written to ``out_json`` (keys ``global_local_iou``,
    ``global_local_f1``, ``patch_only_iou``, ``patch_only_f1``, ``downsampled_iou``,
    ``downsampled_f1``, ``peak_mem_mb_1x``, ``peak_mem_mb_2x``, ``peak_mem_ratio_2x``,
    ``probe_sizes``, ``mpix_per_s``, ``wall_seconds`` and details); the overlay PNG
    ``<out_json stem>_overlay.png`` and the global-local checkpoint
    ``<out_json stem>_global_local.pt`` are written beside it.
    """
    import cv2
    import torch

    from models import save_checkpoint
    from models.global_local import global_local

    t_start = time.perf_counter()
    data_dir, out_json = Path(data_dir), Path(out_json)
    if threads:
        torch.set_num_threads(threads)
    out_json.parent.mkdir(parents=True, exist_ok=True)

    # 1. data at working resolution
    train_ids, eval_ids = load_split(data_dir, split, train_n=train_n, eval_n=eval_n)
    images, masks, _ = _load(data_dir, train_ids, scale)
    ev_images, _, ev_full = _load(data_dir, eval_ids, scale, full_masks=True)
    log(f"highres: {len(train_ids)} training / {len(eval_ids)} evaluation images at {images[0].shape[1]}x"
        f"{images[0].shape[0]} (scale {scale}), patch {patch_size}, {steps} steps x {batch}")
    options = dict(patch_size=patch_size, width=width, blocks=tuple(blocks))
    results: dict = {"train_ids": train_ids, "eval_ids": eval_ids, "scale": scale, "patch_size": patch_size,
                     "steps": steps, "batch": batch, "width": width, "blocks": list(blocks), "overlap": overlap,
                     "threads": threads, "seed": seed}

    def _train(name, model, imgs, msks):
        t = time.perf_counter()
        model, losses = train_highres(imgs, msks, model=model, patch_size=patch_size, steps=steps, batch=batch,
                                      lr=lr, seed=seed, device=device, balanced=balanced,
                                      class_weights=class_weights, log_every=max(1, steps // 5),
                                      log=lambda d: log(f"  {name} step {d['step']}: loss {d['loss']:.4f} "
                                                        f"({d['seconds']} s)"))
        results[f"{name}_train_seconds"] = round(time.perf_counter() - t, 1)
        results[f"{name}_final_loss"] = float(np.nanmean(losses[-max(1, steps // 10):]))
        return model

    def _evaluate(name, model, mode):
        t = time.perf_counter()
        preds = []
        for image, full in zip(ev_images, ev_full):
            pred = predict(model, image, mode=mode, overlap=overlap, batch=batch, device=device)
            preds.append(upsample_labels(pred, *full.shape))
        scores = vessel_scores(preds, ev_full)
        results[f"{name}_iou"], results[f"{name}_f1"] = scores["iou"], scores["f1"]
        results[f"{name}_eval_seconds"] = round(time.perf_counter() - t, 1)
        log(f"  {name}: vessel IoU {scores['iou']:.4f}  F1 {scores['f1']:.4f}")
        return preds

    # 2. (a) global-local
    torch.manual_seed(seed)
    gl = _train("global_local", global_local(2, 3, **options), images, masks)
    gl_preds = _evaluate("global_local", gl, "patches")
    ckpt = out_json.with_name(out_json.stem + "_global_local.pt")
    save_checkpoint(ckpt, gl, builder_ref="global_local", num_classes=2, in_channels=3, options=options,
                    meta={"scale": scale, "overlap": overlap, "classes": ["background", "vessel"]})
    # 3. (b) same network, no global context
    torch.manual_seed(seed)
    po = _train("patch_only", global_local(2, 3, use_global=False, **options), images, masks)
    _evaluate("patch_only", po, "patches")
    # 4. (c) whole image downsampled to the patch size
    small_imgs = [cv2.resize(im, (patch_size, patch_size), interpolation=cv2.INTER_AREA) for im in images]
    small_msks = [reduce_mask(m, (patch_size, patch_size)) for m in masks]
    torch.manual_seed(seed)
    ds = _train("downsampled", global_local(2, 3, use_global=False, **options), small_imgs, small_msks)
    _evaluate("downsampled", ds, "downsampled")

    # 5. overlay of the first evaluation image
    overlay = out_json.with_name(out_json.stem + "_overlay.png")
    full_image = read_image(data_dir / "images" / f"{eval_ids[0]}.jpg", 1.0)
    _overlay_png(overlay, full_image, ev_full[0], gl_preds[0])
    del full_image

    # 6. peak memory of `wsseg segment` on an evaluation image at its original size and at twice
    #    its side (a JPEG written to disk), each in a fresh process; CPU throughput
    with tempfile.TemporaryDirectory() as tmp:
        src = data_dir / "images" / f"{eval_ids[0]}.jpg"
        big = Path(tmp) / f"{eval_ids[0]}_2x.jpg"
        _write_doubled_jpeg(src, big)
        kw = dict(overlap=overlap, batch=batch, threads=threads or torch.get_num_threads())
        one = _run_probe(ckpt, src, Path(tmp), "1x", **kw)
        two = _run_probe(ckpt, big, Path(tmp), "2x", **kw)
    work_px = lambda r: r["working_size"][0] * r["working_size"][1]
    results.update({
        "peak_mem_mb_1x": round(one["peak_rss_mb"], 1), "peak_mem_mb_2x": round(two["peak_rss_mb"], 1),
        "peak_mem_ratio_2x": round(two["peak_rss_mb"] / one["peak_rss_mb"], 4),
        "peak_mem_increment_mb_1x": round(one["peak_rss_mb"] - one["rss_before_mb"], 1),
        "peak_mem_increment_mb_2x": round(two["peak_rss_mb"] - two["rss_before_mb"], 1),
        "probe_sizes": {tag: {"image": r["size"], "working": r["working_size"]}
                        for tag, r in (("1x", one), ("2x", two))},
        "probe_fov_share": round(one["fov_share"], 4),
        "mpix_per_s": round(work_px(two) / two["inference_seconds"] / 1e6, 4),
        "mpix_per_s_1x": round(work_px(one) / one["inference_seconds"] / 1e6, 4),
        "segment_seconds_1x": round(one["seconds"], 2), "segment_seconds_2x": round(two["seconds"], 2),
        "overlay_png": overlay.name, "checkpoint": ckpt.name,
    })
    log(f"  memory of `wsseg segment`: peak {results['peak_mem_mb_1x']} MB ({one['size'][1]}x{one['size'][0]}) / "
        f"{results['peak_mem_mb_2x']} MB ({two['size'][1]}x{two['size'][0]}), ratio {results['peak_mem_ratio_2x']}; "
        f"{results['mpix_per_s']} Mpx/s")
    results["wall_seconds"] = round(time.perf_counter() - t_start, 1)
    out_json.write_text(json.dumps(results, indent=2))
    log(f"highres: wrote {out_json} ({results['wall_seconds']} s)")
    return results


# ---------------------------------------------------------------------------------------
# inference on files
# ---------------------------------------------------------------------------------------
def _palette(num_classes: int) -> list[int]:
    """Flat 768-entry palette: 2 classes black/white, more classes the PASCAL VOC colours."""
    if num_classes <= 2:
        colors = [(0, 0, 0), (255, 255, 255)]
    else:
        colors = []
        for i in range(256):
            r = g = b = 0
            c = i
            for j in range(8):
                r |= ((c >> 0) & 1) << (7 - j)
                g |= ((c >> 1) & 1) << (7 - j)
                b |= ((c >> 2) & 1) << (7 - j)
                c >>= 3
            colors.append((r, g, b))
    flat = [v for c in colors for v in c]
    return (flat + [0] * 768)[:768]


def _image_size(path: Path) -> tuple[int, int]:
    """(height, width) from the file header, without decoding the pixels."""
    from PIL import Image
    limit, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
    try:
        with Image.open(path) as im:
            return im.size[1], im.size[0]
    except OSError:
        return read_image(path).shape[:2]
    finally:
        Image.MAX_IMAGE_PIXELS = limit


def write_palette_png(path: str | os.PathLike, height: int, width: int, bands, palette: Sequence[int], *,
                      level: int = 6) -> None:
    """Write an 8-bit palette PNG from row bands, without holding the whole image.

    Parameters
    ----------
    path : path
        Output file (written to a temporary name, then renamed).
    height, width : int
        Image size.
    bands : iterable of (n, width) uint8 arrays
        Consecutive row bands, top to bottom, ``height`` rows in total.
    palette : sequence of int
        Flat RGB palette, at most 768 values (256 colours).
    level : int
        zlib compression level.

    Raises
    ------
    ValueError
        If a band has the wrong width or dtype, or the bands do not add up to ``height``.
    """
    import struct
    import zlib

    path = Path(path)
    if height < 1 or width < 1:
        raise ValueError(f"height and width must be positive, got {height}x{width}")
    pal = bytes(int(v) for v in list(palette)[:768])
    if len(pal) % 3 or not pal:
        raise ValueError(f"palette must be a flat RGB list (3 values per colour), got {len(pal)} values")

    def chunk(f, kind: bytes, data: bytes) -> None:
        f.write(struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    tmp = path.with_name(f".{path.name}.tmp")
    rows = 0
    comp = zlib.compressobj(level)
    with open(tmp, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n")
        chunk(f, b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 3, 0, 0, 0))
        chunk(f, b"PLTE", pal)
        for band in bands:
            band = np.asarray(band)
            if band.ndim != 2 or band.shape[1] != width or band.dtype != np.uint8:
                raise ValueError(f"{path}: bands must be (n, {width}) uint8, got {band.dtype} {band.shape}")
            if rows + band.shape[0] > height:
                raise ValueError(f"{path}: bands hold more than height={height} rows")
            filtered = np.zeros((band.shape[0], width + 1), np.uint8)     # filter type 0 per row
            filtered[:, 1:] = band
            data = comp.compress(filtered.tobytes())
            if data:
                chunk(f, b"IDAT", data)
            rows += band.shape[0]
        if rows != height:
            raise ValueError(f"{path}: bands hold {rows} rows, expected {height}")
        chunk(f, b"IDAT", comp.flush())
        chunk(f, b"IEND", b"")
    os.replace(tmp, path)


def _label_bands(labels: np.ndarray, height: int, width: int, band: int = 256):
    """(n, width) uint8 bands of ``labels`` resized (nearest, as :func:`upsample_labels`) to height x width."""
    h, w = labels.shape
    cols = np.minimum((np.arange(width) * w) // width, w - 1)
    for r0 in range(0, height, band):
        rows = np.minimum((np.arange(r0, min(r0 + band, height)) * h) // height, h - 1)
        src = np.asarray(labels[int(rows[0]):int(rows[-1]) + 1])
        yield src[rows - rows[0]][:, cols]


def upsampled_class_shares(labels: np.ndarray, height: int, width: int, num_classes: int, band: int = 64) -> np.ndarray:
    """Share of each class in ``labels`` resized (nearest) to height x width, computed on ``labels``.

    Each source pixel counts as many times as the resize repeats it (rows times columns),
    so the result equals ``np.bincount(upsample_labels(labels, height, width).ravel()) /
    (height * width)`` without building the large array.
    """
    h, w = labels.shape
    row_n = np.bincount(np.minimum((np.arange(height) * h) // height, h - 1), minlength=h).astype(np.float64)
    col_n = np.bincount(np.minimum((np.arange(width) * w) // width, w - 1), minlength=w).astype(np.float64)
    counts = np.zeros(num_classes, np.float64)
    for r0 in range(0, h, band):
        part = np.asarray(labels[r0:r0 + band])
        for k in range(num_classes):
            counts[k] += row_n[r0:r0 + band] @ ((part == k) @ col_n)
    return counts / (float(height) * width)


def resolve_checkpoint(model: str | os.PathLike) -> Path:
    """The checkpoint file meant by ``wsseg segment --model``.

    Parameters
    ----------
    model : path
        One of

        * a checkpoint file (``*.pt``);
        * the JSON of a ``wsseg bench highres`` run (``<stem>_global_local.pt`` beside it),
          or the folder holding it (exactly one ``*_global_local.pt`` there);
        * a ``wsseg train`` run directory (``summary.json``'s ``final_model``; if that file
          moved with the run directory, ``rounds/<round>/model.pt`` under it), or its
          ``summary.json``;
        * a round directory holding ``model.pt``.

    Returns
    -------
    path : Path
        An existing checkpoint file.

    Raises
    ------
    ValueError
        Naming the path and what was looked for, when nothing usable is found.
    """
    path = Path(model)
    if not path.exists():
        raise ValueError(f"--model {path}: no such file or directory; pass a checkpoint (.pt), a `wsseg train` "
                         "run directory or a `wsseg bench highres` output")
    if path.is_file() and path.suffix.lower() != ".json":
        return path
    folder, summary = (path.parent, path) if path.is_file() else (path, path / "summary.json")
    tried = []
    if summary.name == "summary.json" and summary.is_file():
        try:
            final = json.loads(summary.read_text()).get("final_model")
        except (json.JSONDecodeError, AttributeError) as e:
            raise ValueError(f"{summary}: not a readable `wsseg train` summary ({e})") from e
        if final:
            final = Path(final)
            moved = folder / "rounds" / final.parent.name / final.name
            for candidate in (final, moved):
                if candidate.is_file():
                    return candidate
            raise ValueError(f"{summary}: final_model {final} not found (nor {moved})")
        tried.append(f"{summary} has no final_model")
    if path.is_file():                          # a bench JSON: its checkpoint lies beside it
        candidate = path.with_name(path.stem + "_global_local.pt")
        if candidate.is_file():
            return candidate
        raise ValueError(f"{path}: no checkpoint {candidate.name} beside it; pass the checkpoint file itself")
    benches = sorted(folder.glob("*_global_local.pt"))
    if len(benches) == 1:
        return benches[0]
    if len(benches) > 1:
        raise ValueError(f"{folder}: several `wsseg bench highres` checkpoints ({', '.join(b.name for b in benches)}); "
                         "pass one of them as --model")
    if (folder / "model.pt").is_file():
        return folder / "model.pt"
    raise ValueError(f"{folder}: no checkpoint found: looked for summary.json with final_model (a `wsseg train` run "
                     "directory), *_global_local.pt (a `wsseg bench highres` output) and model.pt"
                     + (f"; {tried[0]}" if tried else ""))


def _edge_params(checkpoint: Path, meta: dict) -> dict:
    """Edge-map parameters of a 4-channel checkpoint: its meta, else its run's config.json."""
    if "edges" in meta:
        return dict(meta["edges"])
    for folder in list(checkpoint.resolve().parents)[:3]:
        config = folder / "config.json"
        if config.is_file():
            features = json.loads(config.read_text()).get("features", {})
            if "edge_sigma" in features:
                return {"sigma": features["edge_sigma"], "tau": features["edge_tau"]}
    raise ValueError(f"{checkpoint}: the model takes an edge-map channel (4 inputs) but neither the checkpoint's "
                     "meta nor a config.json of its run directory gives the edge parameters")


def segment(inputs: Sequence[str | os.PathLike], model: str | os.PathLike, out_dir: str | os.PathLike, *,
            patch_size: int | None = None, overlap: int | None = None, batch: int = 4, device: str = "cpu",
            fov: str = "auto", stats: list | None = None, log: Callable[[str], None] = print,
            gate: bool | None = None) -> list[Path]:
    """Segment image files with a global-local checkpoint, with memory bounded by patch and batch.

    Any other checkpoint (the ``small`` or ``fusion`` network of a ``wsseg train`` run) labels
    each image whole: :func:`segment_whole`.

    For each image:

    1. read it at the checkpoint's working ``scale`` (``meta["scale"]``, 1 if absent): a
       JPEG is decoded directly at that size (:func:`read_image`), so the full-size pixels
       are never in memory when the scale is 1/2, 1/4 or 1/8; for a model with an edge
       channel (4 inputs, a ``wsseg train`` model), the feature-region map of the whole
       working image is added (its filters' memory grows with the image);
    2. ``fov="auto"``: estimate the camera's field of view (:func:`tasks.fov.fov_or_all`,
       kept as one bit per pixel); when the image has a dark surround (fundus
       photographs), pixels outside it get class 0, else all pixels are kept;
       ``fov="none"``: keep all pixels;
    3. segment patch by patch with the coarse image (:func:`models.global_local.segment_large`);
       a working image above ``SPILL_PIXELS`` is first moved to a temporary Zarr array in
       ``out_dir`` (and the labels go to one), so that during inference only patches,
       bands of rows and the model are in memory;
    4. resize the labels back to the image's size (nearest) band by band, writing
       ``<out_dir>/<stem>.png`` (palette PNG of class indices) row band by row band
       (:func:`write_palette_png`) and, for outputs above 50 megapixels, also
       ``<out_dir>/<stem>.zarr`` (uint8 (H, W)).

    Parameters
    ----------
    inputs : sequence of paths
        Image files.
    model : path
        Checkpoint, run directory or bench output (:func:`resolve_checkpoint`).
    out_dir : path
        Output folder (created).
    patch_size, overlap : int, optional
        Default: the model's patch size and the checkpoint's overlap (0 if absent).
    batch : int
        Patches per forward pass.
    device : str
        Torch device.
    fov : {"auto", "none"}
        Field-of-view masking.
    stats : list, optional
        Receives one dict per image (``image``, ``size``, ``working_size``, ``seconds``,
        ``inference_seconds``, ``fov_found``, ``fov_share``, ``class_shares``, ``png``).
    log : callable(str)
        Progress, one line per image.
    gate : bool, optional
        Whole-image models only (:func:`segment_whole`).

    Returns
    -------
    pngs : list of Path
        The written PNGs.

    Raises
    ------
    ValueError
        On missing inputs, an unusable ``model``, or bad options.
    """
    from models import load_checkpoint
    from models.global_local import GlobalLocalNet, IMAGENET_MEAN, IMAGENET_STD, segment_large
    from tasks.fov import fov_or_all

    paths = [Path(p) for p in inputs]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise ValueError(f"input images not found: {', '.join(missing)}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if fov not in ("auto", "none"):
        raise ValueError(f"fov must be 'auto' or 'none', got {fov!r}")
    checkpoint = resolve_checkpoint(model)
    net, state = load_checkpoint(checkpoint, device=device)
    if not isinstance(net, GlobalLocalNet):
        if patch_size is not None or overlap is not None:
            raise ValueError(f"{checkpoint}: a {state.get('builder')!r} model labels whole images; --patch-size and "
                             "--overlap apply to global_local models only")
        return segment_whole(paths, checkpoint, net, state, out_dir, gate=gate, stats=stats, log=log)
    meta = state.get("meta", {})
    scale = float(meta.get("scale", 1.0))
    overlap = int(meta.get("overlap", 0) if overlap is None else overlap)
    in_ch = int(state["in_channels"])
    if in_ch not in (3, 4):
        raise ValueError(f"{checkpoint}: model takes {in_ch} input channels; segment supports RGB (3) or RGB + "
                         "edge map (4)")
    edges = _edge_params(checkpoint, meta) if in_ch == 4 else None
    mean, std = IMAGENET_MEAN + ((0.5,) if edges else ()), IMAGENET_STD + ((1.0,) if edges else ())
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    palette = _palette(net.num_classes)
    written = []
    for n, path in enumerate(paths, 1):
        t0 = time.perf_counter()
        height, width = _image_size(path)
        with tempfile.TemporaryDirectory(prefix=f".{path.stem}.", dir=out_dir) as tmp:
            work = read_image(path, scale)
            h, w = work.shape[:2]
            # 2. field of view, at working scale, kept as one bit per pixel
            packed, found, fov_share = None, False, 1.0
            if fov == "auto":
                mask, found = fov_or_all(work)
                if found:
                    fov_share = float(mask.mean())
                    packed = np.packbits(mask, axis=1)
                del mask
            if edges is not None:
                from tasks.edges import feature_region_map
                region = feature_region_map(work, sigma=edges["sigma"], tau=edges["tau"])
                work = np.concatenate([work, (region * 255).astype(np.uint8)[..., None]], axis=2)
                del region
            # a large working image waits on disk: inference reads it patch by patch and band by band
            labels = np.empty((h, w), np.uint8)
            if h * w > SPILL_PIXELS:
                import zarr
                src = zarr.create_array(store=str(Path(tmp) / "image.zarr"), shape=work.shape, dtype="uint8",
                                        chunks=(128, min(w, 512), work.shape[2]))
                src[:] = work
                del work
                work = src
                labels = zarr.create_array(store=str(Path(tmp) / "labels.zarr"), shape=(h, w), dtype="uint8",
                                           chunks=(256, w))
            # 3. patches + coarse image
            t1 = time.perf_counter()
            segment_large(net, work, patch_size=patch_size, overlap=overlap, batch=batch, device=device,
                          mean=mean, std=std, out=labels)
            t_inf = time.perf_counter() - t1
            del work
            if packed is not None:                          # outside the field of view: class 0
                for r0 in range(0, h, 256):
                    part = np.asarray(labels[r0:r0 + 256])
                    part *= np.unpackbits(packed[r0:r0 + 256], axis=1, count=w).astype(bool)
                    labels[r0:r0 + 256] = part
                del packed
            # 4. back to the image's size, band by band
            png = out_dir / f"{path.stem}.png"
            large = height * width > LARGE_OUTPUT_PIXELS
            z = None
            if large:
                import zarr
                z = zarr.create_array(store=str(out_dir / f"{path.stem}.zarr"), shape=(height, width),
                                      chunks=(1024, 1024), dtype="uint8", overwrite=True)

            def bands():
                r0 = 0
                for part in _label_bands(labels, height, width, band=256 if z is None else 1024):
                    if z is not None:
                        z[r0:r0 + part.shape[0]] = part
                    r0 += part.shape[0]
                    yield part

            write_palette_png(png, height, width, bands(), palette)
            shares = upsampled_class_shares(labels, height, width, net.num_classes)
            del labels
        written.append(png)
        work_size = [h, w]
        seconds = time.perf_counter() - t0
        if stats is not None:
            stats.append({"image": str(path), "size": [height, width], "working_size": work_size,
                          "seconds": seconds, "inference_seconds": t_inf, "fov_found": found,
                          "fov_share": fov_share, "class_shares": shares.tolist(), "png": str(png)})
        at = f" (at {work_size[1]}x{work_size[0]})" if scale != 1.0 else ""
        fov_note = f", field of view {fov_share:.3f}" if found else (", no dark surround" if fov == "auto" else "")
        log(f"[{n}/{len(paths)}] {path.name}: {width}x{height}{at}{fov_note}, {seconds:.1f} s, "
            f"{png}{' + .zarr' if large else ''}, class shares " + " ".join(f"{v:.3f}" for v in shares))
    return written


def _run_config(checkpoint: Path) -> tuple[Path, dict] | None:
    """The run directory of a ``wsseg train`` checkpoint and its config.json, or None."""
    for folder in list(checkpoint.resolve().parents)[:3]:
        if (folder / "config.json").is_file():
            try:
                return folder, json.loads((folder / "config.json").read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"{folder / 'config.json'}: not readable JSON ({e})") from e
    return None


def segment_whole(paths: Sequence[Path], checkpoint: Path, net, state: dict, out_dir: str | os.PathLike, *,
                  gate: bool | None = None, stats: list | None = None,
                  log: Callable[[str], None] = print) -> list[Path]:
    """Label whole images with a ``wsseg train`` segmenter (``small``, ``fusion``), as ``bench
    quality`` measures it: flip-averaged class probabilities, weighted by the run's image
    classifier (``RUN/classifier.pt``) when ``gate`` (default: the run's ``inference.gate``).

    Writes ``<out_dir>/<stem>.png`` (palette PNG of class indices) and ``<stem>_overlay.png``
    (the labels coloured over the image). ``stats`` receives one dict per image (``image``,
    ``size``, ``seconds``, ``gated``, ``class_shares``, ``png``, ``overlay``).
    """
    from models.small import ImageClassifier
    from tasks import training as tr
    from tasks.overlay import overlay, write_png
    from tasks.pipeline import ClassifierGate

    if isinstance(net, ImageClassifier):
        raise ValueError(f"{checkpoint}: a {state.get('builder')!r} model is not a segmentation network; pass a "
                         "segmenter checkpoint (a run's rounds/rNNN/model.pt), the run directory, or a global_local "
                         "checkpoint")
    run = _run_config(checkpoint)
    run_gate = bool(run[1].get("inference", {}).get("gate", True)) if run else False
    gate = run_gate if gate is None else gate
    clf = None
    if gate:
        if run is None or not (run[0] / "classifier.pt").is_file():
            raise ValueError(f"{checkpoint}: gating needs the run's image classifier (classifier.pt in the run "
                             "directory, beside config.json), which was not found; pass --no-gate")
        clf = ClassifierGate(run[0] / "classifier.pt", run[1].get("classifier", {}).get("cam_scales", (1.0,)))
    edges = _edge_params(checkpoint, state.get("meta", {})) if int(state["in_channels"]) == 4 else None
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    n_classes = int(state["num_classes"])
    names = list(state.get("meta", {}).get("classes", []))
    palette = _palette(n_classes)
    written = []
    for n, path in enumerate(paths, 1):
        t0 = time.perf_counter()
        image = read_image(path)  # a ValueError naming the file when it is not a readable image
        edge = None
        if edges is not None:
            from tasks.edges import feature_region_map
            edge = feature_region_map(image, sigma=edges["sigma"], tau=edges["tau"])
        prob = tr.predict_probs(net, image, edge)
        if clf is not None:
            prob = clf(prob, image)
        labels = prob.argmax(0).astype(np.uint8)
        h, w = labels.shape
        png, picture = out_dir / f"{path.stem}.png", out_dir / f"{path.stem}_overlay.png"
        write_palette_png(png, h, w, iter([labels]), palette)
        write_png(picture, overlay(image, labels))
        shares = np.bincount(labels.ravel(), minlength=n_classes) / labels.size
        written.append(png)
        seconds = time.perf_counter() - t0
        if stats is not None:
            stats.append({"image": str(path), "size": [h, w], "seconds": seconds, "gated": clf is not None,
                          "class_shares": shares.tolist(), "png": str(png), "overlay": str(picture)})
        top = [c for c in np.argsort(-shares)[:3] if shares[c] > 0]
        log(f"[{n}/{len(paths)}] {path.name}: {w}x{h}, {seconds:.1f} s{', gated' if clf is not None else ''}, "
            f"{png}, largest classes " + ", ".join(f"{names[c] if c < len(names) else c} {shares[c]:.2f}" for c in top))
    return written


# ---------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------
def _segment_main(args: argparse.Namespace) -> int:
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        t0 = time.perf_counter()
        pngs = segment(args.inputs, args.model, args.out, patch_size=args.patch_size, overlap=args.overlap,
                       batch=args.batch, device=args.device, fov=args.fov, gate=args.gate)
    except ValueError as e:
        print(f"wsseg segment: error: {e}", file=sys.stderr)
        return 2
    print(f"{len(pngs)} label map{'s' if len(pngs) != 1 else ''} in {time.perf_counter() - t0:.1f} s: "
          f"{Path(args.out).resolve()}")
    return 0


def add_segment_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``segment``: label images with a trained checkpoint (global-local: any size)."""
    p = subparsers.add_parser(
        "segment", help="label images with a trained model (global-local: any size, patch by patch)",
        description="Label images with a trained model. A global-local model (METHOD.md C) works patch by patch "
                    "with the whole image's coarse context, stitched with bounded memory, and writes "
                    "<out>/<stem>.png (palette PNG of class indices) and, above 50 megapixels, <out>/<stem>.zarr; "
                    "outside the camera's field of view (a dark surround, as in fundus photographs) pixels get "
                    "class 0. The small or fusion model of a `wsseg train` run labels each image whole, its class "
                    "probabilities weighted by the run's image classifier (see --gate), and writes <stem>.png and "
                    "<stem>_overlay.png.")
    p.add_argument("inputs", nargs="+", help="image files (JPEG/PNG/TIFF)")
    p.add_argument("--model", "--checkpoint", dest="model", required=True, metavar="RUN_OR_CHECKPOINT",
                   help="a checkpoint (.pt), a `wsseg train` run directory (its final model), or a `wsseg bench "
                        "highres` output (its JSON or folder: the *_global_local.pt beside it); --checkpoint is an "
                        "alias")
    p.add_argument("--out", "--out-dir", dest="out", required=True, metavar="DIR",
                   help="folder for the label PNGs (created); --out-dir is an alias")
    p.add_argument("--fov", choices=["auto", "none"], default="auto",
                   help="auto (default): estimate the field of view where the image has a dark surround and give "
                        "the pixels outside it class 0; none: keep every pixel")
    p.add_argument("--patch-size", type=int, default=None, help="patch side (default: the model's)")
    p.add_argument("--overlap", type=int, default=None, help="patch overlap in pixels (default: the checkpoint's)")
    p.add_argument("--batch", type=int, default=4, help="patches per forward pass (default 4)")
    p.add_argument("--gate", action=argparse.BooleanOptionalAction, default=None,
                   help="whole-image models: weight each class by the run's image classifier (default: the run's "
                        "inference.gate, on unless changed; what `bench quality` measures)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.set_defaults(func=_segment_main)
    return p


def _bench_main(args: argparse.Namespace) -> int:
    try:
        bench_highres(args.data, args.split, args.out, train_n=args.train_n, eval_n=args.eval_n,
                      patch_size=args.patch_size, scale=args.scale, steps=args.steps, batch=args.batch, lr=args.lr,
                      width=args.width, overlap=args.overlap, balanced=args.balanced, seed=args.seed,
                      threads=args.threads, device=args.device)
    except ValueError as e:
        print(f"wsseg bench highres: error: {e}", file=sys.stderr)
        return 2
    return 0


def add_bench_highres_parser(bench_subparsers) -> argparse.ArgumentParser:
    """Register ``highres`` under ``bench``: global-local vs. patch-only vs. downsampled."""
    p = bench_subparsers.add_parser(
        "highres", help="global-local vs. patches without context vs. downsampled image, with memory and speed",
        description="Train and score, on the same images and step budget, (a) the global-local network, (b) the "
                    "same network on patches without global context, (c) the whole image downsampled to the "
                    "patch size; measure the peak memory of `wsseg segment` on an evaluation image at its original "
                    "size and at twice its side, and CPU megapixels per second. Writes the JSON, an overlay PNG "
                    "and the global-local checkpoint.")
    p.add_argument("--data", "--data-dir", dest="data", required=True, metavar="DIR",
                   help="folder with images/<id>.jpg, masks/<id>.png, <split>.txt (masks: 0 background, 1 vessel, "
                        "255 ignore); --data-dir is an alias")
    p.add_argument("--split", default="train", help="id list to draw train and eval images from (default train)")
    p.add_argument("--out", "--out-json", dest="out", required=True, metavar="FILE.json",
                   help="result JSON (overlay PNG and checkpoint go beside it); --out-json is an alias")
    p.add_argument("--train-n", type=int, default=12, help="training images (default 12)")
    p.add_argument("--eval-n", type=int, default=3, help="evaluation images (default 3)")
    p.add_argument("--patch-size", type=int, default=256, help="patch side at working resolution (default 256)")
    p.add_argument("--scale", type=float, default=0.5, help="working resolution / original (default 0.5)")
    p.add_argument("--steps", type=int, default=400, help="training steps per variant (default 400)")
    p.add_argument("--batch", type=int, default=4, help="patches per step (default 4)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default 2e-3)")
    p.add_argument("--width", type=int, default=16, help="backbone channels (default 16)")
    p.add_argument("--overlap", type=int, default=32, help="patch overlap at inference (default 32)")
    p.add_argument("--balanced", type=float, default=0.0, help="fraction of patches centred on vessels (default 0)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.set_defaults(func=_bench_main)
    return p


if __name__ == "__main__":
    if len(sys.argv) == 8 and sys.argv[1] == "_probe":
        _a = sys.argv[2:]
        print(json.dumps(_probe(_a[0], _a[1], _a[2], int(_a[3]), int(_a[4]), int(_a[5]))))
    else:
        print("usage: python -m flows.highres _probe CKPT IMAGE OUT_DIR OVERLAP BATCH THREADS "
              "(internal; use `wsseg bench highres` / `wsseg segment`)", file=sys.stderr)
        sys.exit(2)
