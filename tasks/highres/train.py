"""Method C (METHOD.md C) on fully annotated high-resolution images: data, training, scoring and
the pieces of ``wsseg bench highres``.

* data: :func:`load_split`, :func:`load_images` (images at a working scale, masks reduced by
  area, :func:`reduce_mask`), :func:`upsample_labels`, :func:`dataset_classes`;
* training: :class:`PatchBatches` (random patches of whole images with each image's coarse
  version and the patch's box) through the one training loop :func:`tasks.common.training.fit`
  (:func:`train_highres`);
* scoring: :func:`predict`, :func:`confusion`, :func:`vessel_scores` (two classes),
  :func:`class_scores` (per-class IoU and mIoU);
* the benchmark's steps: :data:`VARIANTS`, :func:`train_variant`, :func:`evaluate_variant`,
  :func:`scores_from_confusion` (also of confusions pooled over folds), :func:`save_bench_model`,
  :func:`write_overlay`, :func:`measure_segment_memory` (peak memory of the real ``wsseg segment``
  command in a subprocess).

Working resolution: HRF photographs are 3504 x 2336; the benchmark processes them at
``scale=0.5`` (1752 x 1168, decoded directly at half size by the JPEG decoder), with masks
reduced by area (a working pixel is vessel when at least half of its full-resolution
pixels are, ignore when less than half are inside the field of view).  Predictions are
upsampled back (nearest) and scored against the original full-resolution masks.

Two kinds of corpus.  Two classes (``classes.txt`` with two lines, or none: HRF's background
and vessel) are scored by the vessel keys (``<variant>_iou``, ``<variant>_f1``).  More classes
(the msrc21 photographs upscaled 6x by ``tools/msrc_highres.py``, where a 256-pixel patch shows an
eighth of the scene's width and sky, water, road or building look alike without the rest of
the image) are scored by per-class IoU and mIoU (``<variant>_miou``, ``<variant>_class_iou``),
trained on one split and evaluated on another (``eval_split``).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from wsseg.tasks.common.metrics import iou_from_confusion
from wsseg.tasks.common.training import BatchSource, reduce_fractions, soft_cross_entropy  # noqa: F401 (re-exported)
from wsseg.tasks.runtime.memory import status_kb
from wsseg.tasks.store import build_network, files

__all__ = ["reduce_mask", "reduce_fractions", "soft_cross_entropy", "upsample_labels", "load_split", "load_images",
           "dataset_classes", "PatchBatches", "train_highres", "confusion", "vessel_scores", "class_scores", "predict",
           "BenchData", "load_bench_data",
           "Variant", "VARIANTS", "DEFAULT_VARIANTS", "train_variant", "evaluate_variant", "scores_from_confusion",
           "save_bench_model", "write_overlay", "measure_segment_memory"]

_ROOT = Path(__file__).resolve().parents[2]  # the project (tasks/highres/train.py), for the probe's child


@dataclass(frozen=True)
class Variant:
    """One network of the benchmark: whether it takes the coarse image, how it labels an image
    (``"patches"``: patch by patch; ``"downsampled"``: the whole image resized to the patch size,
    on which it is also trained), extra :class:`models.global_local.GlobalLocalNet` options, the
    weight of the auxiliary loss on the coarse image (needs ``coarse_head``) and when to pick it."""

    use_global: bool
    mode: str = "patches"
    options: dict = field(default_factory=dict)
    coarse_loss: float = 0.0
    about: str = ""

    @property
    def downsampled(self) -> bool:
        return self.mode == "downsampled"


#: the benchmark's networks by name: the default ``global_local``, the two baselines it is compared with
#: (``DEFAULT_VARIANTS`` run unless ``variants`` says otherwise) and METHOD.md C as written. The ablations
#: that chose global_local's options (docs/benchmarks.md, "Method C: msrc21 upscaled and HRF") are in git.
VARIANTS: dict[str, Variant] = {
    "global_local": Variant(
        True, options={"coarse_head": True, "coarse_residual": True, "coarse_backbone": True,
                       "residual_init": "random", "coarse_detach": True},
        coarse_loss=1.0,
        about="the default: METHOD.md C (F1, F2, pooling and spatial branches) with a backbone of its own for the "
              "coarse image, the coarse head's logits of each patch's region added to the patch's without a "
              "gradient back, and a loss 1.0 x CE on the coarse image against its class fractions (the coarse "
              "head's only teacher); for a corpus whose classes a patch cannot tell apart without the rest of "
              "the image"),
    "patch_only": Variant(False, about="baseline: the same network on patches, without the coarse image (what the "
                                       "coarse image adds)"),
    "downsampled": Variant(False, "downsampled", about="baseline: the whole image resized to the patch size (what "
                                                       "the scene alone gives)"),
    "gl_method_c": Variant(True, about="METHOD.md C as written: one backbone for patches and coarse image, F1, F2, "
                                       "pooling branch (A1, A2), spatial branch (F4, F5), no coarse supervision; "
                                       "the reference for what global_local changes"),
}
DEFAULT_VARIANTS = ("global_local", "patch_only", "downsampled")


def _say(line: str) -> None:
    """Progress of the benchmark on stderr (stdout is for its result, see ``--json``)."""
    print(line, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------
def reduce_mask(mask: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """Reduce a label mask (class index, 255 ignore) to ``shape`` (H, W) by area.

    A pixel is ignore (255) when less than half its area is annotated.  A 0/1/255 mask: the
    pixel is 1 when at least half of its annotated area is 1, else 0; with more classes it is
    the class that covers most of its area (the lowest index on a tie).
    """
    import cv2
    if mask.shape == tuple(shape):
        return mask.copy()
    size = (shape[1], shape[0])
    valid = cv2.resize((mask != 255).astype(np.float32), size, interpolation=cv2.INTER_AREA)
    present = np.flatnonzero(np.bincount(mask.ravel(), minlength=256)[:255])
    if present.size and present.max() > 1:
        best = np.zeros(tuple(shape), np.float32)
        out = np.zeros(tuple(shape), np.uint8)
        for k in present:
            area = cv2.resize((mask == k).astype(np.float32), size, interpolation=cv2.INTER_AREA)
            out[area > best] = k
            np.maximum(best, area, out=best)
    else:
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


def load_split(data_dir: str | os.PathLike, split: str = "train", *, train_n: int | None = 12,
               eval_n: int | None = 3, eval_split: str | None = None, fold: int = 0) -> tuple[list[str], list[str]]:
    """Training and evaluation ids.

    Without ``eval_split``, the ids of ``<data_dir>/<split>.txt`` are divided: evaluation ids
    are taken from the end of each id-suffix group in turn (for HRF: the last healthy,
    glaucoma and diabetic image), training ids are the first ``train_n`` of the rest.  ``fold``
    f takes the next ``eval_n`` of that order instead of the first, after ``f * eval_n`` (HRF, 15
    images: fold 0 is the 05 images, fold 1 the 04 images, ... fold 4 the 01 images), so that
    folds 0 to ``len(ids) // eval_n - 1`` evaluate every image once (cross-validation).  With
    ``eval_split``, training ids are the first ``train_n`` of ``<split>.txt`` and evaluation
    ids the first ``eval_n`` of ``<eval_split>.txt`` (None: all of them; only fold 0).
    """
    ids = files.dataset_ids(data_dir, split)
    if fold < 0:
        raise ValueError(f"fold must be >= 0, got {fold}")
    if eval_split is not None:
        if fold:
            raise ValueError(f"folds divide one split; with an evaluation split ({eval_split}) there is only fold 0")
        evals = files.dataset_ids(data_dir, eval_split)
        for n, listing, name in ((train_n, ids, split), (eval_n, evals, eval_split)):
            if n is not None and not 1 <= n <= len(listing):
                raise ValueError(f"train_n / eval_n must be between 1 and {len(listing)} (the ids in "
                                 f"{Path(data_dir) / f'{name}.txt'}), got {n}")
        return ids[:train_n], evals[:eval_n]
    train_n, eval_n = 12 if train_n is None else train_n, 3 if eval_n is None else eval_n
    if train_n < 1 or eval_n < 1 or train_n + eval_n > len(ids):
        raise ValueError(f"train_n + eval_n must be between 2 and {len(ids)} (the ids in "
                         f"{Path(data_dir) / f'{split}.txt'})")
    if (fold + 1) * eval_n > len(ids):
        raise ValueError(f"fold {fold} of {eval_n} evaluation images needs {(fold + 1) * eval_n} ids, "
                         f"{Path(data_dir) / f'{split}.txt'} has {len(ids)}: folds 0 to {len(ids) // eval_n - 1}")
    groups: dict[str, list[str]] = {}
    for i in ids:
        groups.setdefault(i.rsplit("_", 1)[-1], []).append(i)
    order: list[str] = []      # the last id of each group in turn, then the one before, ...
    while len(order) < len(ids):
        for g in sorted(groups):
            if groups[g]:
                order.append(groups[g].pop())
    evals = order[fold * eval_n:(fold + 1) * eval_n]
    train = [i for i in ids if i not in evals][:train_n]
    return train, sorted(evals)


def dataset_classes(data_dir: str | os.PathLike) -> list[str]:
    """The class names of ``<data_dir>/classes.txt`` (one per line, mask value = line index);
    ``["background", "vessel"]`` when the folder has none (an HRF-like vessel corpus)."""
    path = Path(data_dir) / "classes.txt"
    if not path.exists():
        return ["background", "vessel"]
    names = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if len(names) < 2:
        raise ValueError(f"{path}: needs at least two classes, one per line, got {len(names)}")
    return names


def load_images(data_dir: str | os.PathLike, ids: Sequence[str], scale: float, full_masks: bool = False,
                num_classes: int | None = None):
    """Images at ``scale``, their masks reduced to that size and (``full_masks``) the original masks.

    ``num_classes``: a mask value that is neither a class index nor 255 is refused, naming the file.
    """
    images, masks, originals = [], [], []
    for i in ids:
        image = files.read_image(files.dataset_image_path(data_dir, i), scale)
        mask_path = files.dataset_mask_path(data_dir, i)
        mask = files.read_mask(mask_path)
        if num_classes is not None:
            counts = np.bincount(mask.ravel(), minlength=256)
            counts[[*range(num_classes), 255]] = 0
            bad = np.flatnonzero(counts)
            if bad.size:
                raise ValueError(f"{mask_path}: mask values {bad.tolist()} are neither a class index "
                                 f"(0..{num_classes - 1}, classes.txt) nor 255")
        images.append(image)
        masks.append(reduce_mask(mask, image.shape[:2]))
        if full_masks:
            originals.append(mask)
    return images, masks, originals


# ---------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------
class PatchBatches(BatchSource):
    """Method C's training batches (a :class:`tasks.common.training.BatchSource`).

    Each step draws ``images_per_batch`` images, flips each at random (horizontally and/or
    vertically; the coarse image is flipped with it), and cuts ``batch`` random
    ``patch_size`` patches from them (``balanced``: that share centred on a random foreground
    pixel); a patch's coarse image is its whole image resized to ``coarse_size`` (default
    ``patch_size``, :func:`models.global_local.coarse_image`) and its box is its position in
    coarse pixels.  A batch is ``({"patches", "coarse", "boxes"}, target)`` (without coarse and
    boxes when ``use_global`` is False), for ``model.forward_patches(**x)``.  With
    ``coarse_targets`` the target also holds each coarse image's class fractions at ``coarse_size``
    (:func:`reduce_fractions`; packed with the patches' by :func:`_pack_soft_targets`), for an
    auxiliary loss.
    """

    def __init__(self, images: Sequence[np.ndarray], masks: Sequence[np.ndarray], *, patch_size: int, steps: int,
                 batch: int, seed: int, use_global: bool, balanced: float = 0.0, images_per_batch: int = 2,
                 coarse_size: int | None = None, coarse_targets: bool = False, num_classes: int | None = None):
        from wsseg.models.global_local import coarse_image
        if coarse_targets and not num_classes:
            raise ValueError("coarse targets (class fractions) need num_classes")
        self.images, self.masks, self.p, self.batch = images, masks, patch_size, batch
        self.steps_per_epoch, self.seed, self.balanced, self.images_per_batch = steps, seed, balanced, images_per_batch
        self.c = int(coarse_size or patch_size)
        self.coarse = [coarse_image(im, self.c) for im in images] if use_global else None
        self.coarse_masks = ([reduce_fractions(m, (self.c, self.c), num_classes) for m in masks]
                             if use_global and coarse_targets else None)
        self.fg = [np.flatnonzero((m > 0) & (m != 255)).astype(np.int64) for m in masks] if balanced > 0 else None

    def batches(self, start_epoch: int, epochs: int):
        import torch

        from wsseg.models.global_local import normalize
        from wsseg.models.tiling import extract_patches

        rng = np.random.default_rng(self.seed)
        p, c, batch, images, masks, fg, coarse = self.p, self.c, self.batch, self.images, self.masks, self.fg, self.coarse
        for _ in range(self.steps_per_epoch * (epochs - start_epoch)):
            n_img = min(self.images_per_batch, batch)
            picks = rng.choice(len(images), n_img, replace=len(images) < n_img)
            patches, targets, coarses, boxes, coarse_targets = [], [], [], [], []
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
                    boxes.append([j, x0 * c / width, y0 * c / height, (x0 + p) * c / width, (y0 + p) * c / height])
                if coarse is not None:
                    coarses.append(coarse[k][sl])
                    if self.coarse_masks is not None:
                        coarse_targets.append(self.coarse_masks[k][(Ellipsis,) + sl])
            x = {"patches": normalize(np.stack(patches))}
            if coarse is not None:
                x["coarse"] = normalize(np.stack(coarses))
                x["boxes"] = torch.tensor(boxes, dtype=torch.float32)
            y = torch.from_numpy(np.stack(targets).astype(np.int64))
            if coarse_targets:
                y = _pack_soft_targets(y, torch.from_numpy(np.ascontiguousarray(np.stack(coarse_targets))))
            yield x, y


def _pack_soft_targets(patch_targets, coarse_fractions):
    """One (N + B, 1 + K, side, side) float target tensor: channel 0 of the first N rows holds the
    patches' class indices (255 = ignore, 255-padded), channels 1.. of the last B rows each coarse
    image's class fractions (:func:`reduce_fractions`, 0-padded)."""
    import torch
    n, b, k = len(patch_targets), len(coarse_fractions), coarse_fractions.shape[1]
    side = max(patch_targets.shape[-1], coarse_fractions.shape[-1])
    out = torch.zeros((n + b, 1 + k, side, side), dtype=torch.float32)
    out[:, 0] = 255
    out[:n, 0, :patch_targets.shape[-2], :patch_targets.shape[-1]] = patch_targets.float()
    out[n:, 1:, :coarse_fractions.shape[-2], :coarse_fractions.shape[-1]] = coarse_fractions
    return out


def _loss_with_soft_coarse(class_weights, weight: float, n_patches: int, p: int, c: int):
    """Cross-entropy of the patches + ``weight`` x :func:`soft_cross_entropy` of the coarse images
    (targets packed by :func:`_pack_soft_targets`)."""
    from wsseg.tasks.common import training as tr
    ce = tr.segmentation_loss(class_weights)

    def loss(out, y):
        return ce(out[:n_patches, :, :p, :p], y[:n_patches, 0, :p, :p].long()) + \
            weight * soft_cross_entropy(out[n_patches:, :, :c, :c], y[n_patches:, 1:, :c, :c], class_weights)
    return loss


def _forward_patches(model, x: dict):
    return model.forward_patches(**x)


def _forward_with_coarse(model, x: dict):
    """The patch logits and the coarse head's logits of the coarse images, each padded to the larger side
    and stacked (split again by :func:`_loss_with_soft_coarse`)."""
    import torch
    import torch.nn.functional as F
    logits, coarse_logits = model.forward_patches(**x, with_coarse=True)
    side = max(logits.shape[-1], coarse_logits.shape[-1])
    pad = lambda t: F.pad(t, (0, side - t.shape[-1], 0, side - t.shape[-2]))
    return torch.cat([pad(logits), pad(coarse_logits)])


def train_highres(images: Sequence[np.ndarray], masks: Sequence[np.ndarray], *, model, patch_size: int,
                  steps: int, batch: int = 4, lr: float = 2e-3, seed: int = 0, device: str = "cpu",
                  log: Callable[[dict], None] | None = None, balanced: float = 0.0,
                  class_weights: Sequence[float] | None = None, images_per_batch: int = 2,
                  log_every: int = 10, coarse_loss: float = 0.0):
    """Train a global-local network on random patches of annotated images (:class:`PatchBatches`)
    with :func:`tasks.common.training.fit`: cross-entropy ignoring 255 (a batch with no annotated pixel
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
    images_per_batch : int
        Images the ``batch`` patches of a step are cut from (each with its coarse image).
    coarse_loss : float
        Weight of an auxiliary cross-entropy on the coarse images against each coarse pixel's class
        fractions (:func:`reduce_fractions`, loss :func:`soft_cross_entropy`); needs a model built with
        ``coarse_head=True``.

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
    from wsseg.tasks.common import training as tr

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
    if coarse_loss and not (model.use_global and hasattr(model, "coarse_classifier")):
        raise ValueError("coarse_loss needs a global-local model built with coarse_head=True")

    c = getattr(model, "coarse_size", patch_size)
    source = PatchBatches(images, masks, patch_size=patch_size, steps=steps, batch=batch, seed=seed,
                          use_global=model.use_global, balanced=balanced, images_per_batch=images_per_batch,
                          coarse_size=c, coarse_targets=bool(coarse_loss), num_classes=model.num_classes)
    cfg = tr.TrainConfig(epochs=1, batch_size=batch, lr=lr, weight_decay=1e-4, seed=seed, device=device,
                         patience=10 ** 9, schedule="warmup_cosine", skip_unlabelled=True,
                         class_weights=class_weights)
    if coarse_loss:
        loss_fn = _loss_with_soft_coarse(class_weights, coarse_loss, batch, patch_size, c)
        forward = _forward_with_coarse
    else:
        loss_fn, forward = tr.segmentation_loss(class_weights), _forward_patches
    losses: list[float] = []

    def on_step(s: dict) -> None:
        losses.append(s["loss"])
        step = s["step"]
        if log is not None and s["loss"] == s["loss"] and (step % log_every == 0 or step == steps):
            recent = [v for v in losses[-log_every:] if v == v]
            log({"step": step, "loss": float(np.mean(recent)) if recent else float("nan"), "lr": float(s["lr"]),
                 "seconds": round(s["seconds"], 1)})

    tr.fit(model, source, loss_fn, cfg, on_step=on_step, forward=forward)
    return model.eval(), losses


# ---------------------------------------------------------------------------------------
# evaluation
# ---------------------------------------------------------------------------------------
def confusion(pred: np.ndarray, mask: np.ndarray, num_classes: int) -> np.ndarray:
    """(K, K) int64 counts, rows the true class, columns the predicted one; mask 255 is ignored
    (so is a predicted value >= K)."""
    if pred.shape != mask.shape:
        raise ValueError(f"prediction {pred.shape} and mask {mask.shape} differ in shape")
    valid = (mask != 255) & (pred < num_classes)
    idx = mask[valid].astype(np.int64) * num_classes + pred[valid]
    return np.bincount(idx, minlength=num_classes * num_classes).reshape(num_classes, num_classes)


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
    return {**_iou_f1(tp, fp, fn), "tp": tp, "fp": fp, "fn": fn}


def _iou_f1(tp: int, fp: int, fn: int) -> dict:
    """``{"iou", "f1"}`` of one class from its pooled counts (0 when there is nothing to count)."""
    return {"iou": tp / max(tp + fp + fn, 1), "f1": 2 * tp / max(2 * tp + fp + fn, 1)}


def class_scores(conf: np.ndarray, names: Sequence[str]) -> dict:
    """Per-class IoU and mIoU of a pooled (K, K) confusion matrix (:func:`confusion`).

    ``class_iou`` holds every class that occurs in the ground truth or the predictions;
    ``miou`` is their mean over the classes present in the ground truth (a class predicted but
    absent from every evaluation mask counts in neither: its IoU is 0 by definition and says
    nothing about that class), ``pixel_accuracy`` the share of annotated pixels labelled right.
    """
    conf = np.asarray(conf, dtype=np.int64)
    per_class, miou = iou_from_confusion(conf)  # the same mean as method A's figures
    present = int(np.count_nonzero(conf.sum(1)))
    return {"miou": miou if present else 0.0,
            "class_iou": {names[k]: float(v) for k, v in enumerate(per_class) if not np.isnan(v)},
            "pixel_accuracy": float(np.trace(conf) / max(conf.sum(), 1)), "classes_evaluated": present}


def predict(model, image: np.ndarray, *, mode: str, overlap: int = 0, batch: int = 4, device: str = "cpu") -> np.ndarray:
    """(H, W) uint8 labels of a working-resolution image.

    ``mode="patches"``: :func:`models.global_local.segment_large` (with or without global
    inputs, as the model says); ``mode="downsampled"``: the whole image resized to
    ``model.patch_size`` square, logits resized back bilinearly, argmax.
    """
    import torch
    import torch.nn.functional as F

    from wsseg.models.global_local import coarse_image, normalize, segment_large
    if mode == "patches":
        return segment_large(model, image, overlap=overlap, batch=batch, device=device)
    if mode != "downsampled":
        raise ValueError(f"mode must be 'patches' or 'downsampled', got {mode!r}")
    x = normalize(coarse_image(image, model.patch_size))[None].to(device)
    with torch.no_grad():
        logits = model.eval().to(device).forward_patches(x)
        logits = F.interpolate(logits, size=image.shape[:2], mode="bilinear", align_corners=False)
    return logits[0].argmax(0).to(torch.uint8).cpu().numpy()


def overlay_panel(image: np.ndarray, truth: np.ndarray, pred: np.ndarray, width: int = 1200,
                  num_classes: int = 2) -> np.ndarray:
    """image | ground truth | prediction, side by side, each ``width`` px wide (RGB).

    Two classes: class 1 white on black, ignore grey; more: the classes in the palette colours of
    :func:`tasks.store.files.palette`, ignore grey."""
    import cv2
    h, w = truth.shape
    size = (width, max(1, round(h * width / w)))
    img = cv2.resize(image, size, interpolation=cv2.INTER_AREA)
    if num_classes > 2:
        colours = np.asarray(files.palette(num_classes), np.uint8).reshape(-1, 3)
        colours[255] = 96
        gt = colours[cv2.resize(truth, size, interpolation=cv2.INTER_NEAREST)]
        pr = colours[cv2.resize(pred, size, interpolation=cv2.INTER_NEAREST)]
        return np.concatenate([img, gt, pr], axis=1)
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
    classes: list[str] = field(default_factory=lambda: ["background", "vessel"])

    @property
    def num_classes(self) -> int:
        return len(self.classes)


def load_bench_data(data_dir: str | os.PathLike, split: str, *, train_n: int | None, eval_n: int | None,
                    scale: float, eval_split: str | None = None, fold: int = 0) -> BenchData:
    """Training images and masks at ``scale``; evaluation images at ``scale`` with their full masks;
    the corpus's classes (:func:`dataset_classes`); ``fold`` as :func:`load_split` takes it."""
    classes = dataset_classes(data_dir)
    train_ids, eval_ids = load_split(data_dir, split, train_n=train_n, eval_n=eval_n, eval_split=eval_split,
                                     fold=fold)
    k = len(classes)
    images, masks, _ = load_images(data_dir, train_ids, scale, num_classes=k)
    ev_images, _, ev_full = load_images(data_dir, eval_ids, scale, full_masks=True, num_classes=k)
    return BenchData(train_ids, eval_ids, images, masks, ev_images, ev_full, classes)


def variant_options(variant: Variant, options: dict) -> dict:
    """The builder options of a variant: the benchmark's, updated by the variant's."""
    return {**options, **variant.options}


def train_variant(name: str, data: BenchData, *, options: dict, steps: int, batch: int, lr: float, seed: int,
                  device: str, balanced: float, class_weights: Sequence[float] | None,
                  variant: Variant | None = None, images_per_batch: int = 2, log: Callable[[str], None] = _say):
    """Build (seeded) and train one variant (``VARIANTS[name]`` unless given); returns
    (model, its builder options, {"<name>_train_seconds", "<name>_final_loss"})."""
    import cv2
    import torch

    variant = VARIANTS[name] if variant is None else variant
    images, masks = data.images, data.masks
    if variant.downsampled:
        p = options["patch_size"]
        images = [cv2.resize(im, (p, p), interpolation=cv2.INTER_AREA) for im in images]
        masks = [reduce_mask(m, (p, p)) for m in masks]
    opts = variant_options(variant, options)
    torch.manual_seed(seed)
    model = build_network("global_local", data.num_classes, in_channels=3, **opts,
                          **({} if variant.use_global else {"use_global": False}))
    t = time.perf_counter()
    model, losses = train_highres(images, masks, model=model, patch_size=options["patch_size"], steps=steps,
                                  batch=batch, lr=lr, seed=seed, device=device, balanced=balanced,
                                  class_weights=class_weights, log_every=max(1, steps // 5),
                                  images_per_batch=images_per_batch, coarse_loss=variant.coarse_loss,
                                  log=lambda d: log(f"  {name} step {d['step']}: loss {d['loss']:.4f} "
                                                    f"({d['seconds']} s)"))
    return model, opts, {f"{name}_train_seconds": round(time.perf_counter() - t, 1),
                         f"{name}_final_loss": float(np.nanmean(losses[-max(1, steps // 10):]))}


def evaluate_variant(name: str, model, data: BenchData, *, mode: str, overlap: int, batch: int, device: str,
                     log: Callable[[str], None] = _say) -> tuple[np.ndarray, dict]:
    """Score a variant on the evaluation images, its predictions upsampled to the full masks.

    The figures of :func:`scores_from_confusion`, the pooled confusion itself (``<name>_confusion``, rows the
    true class, for pooling over folds) and ``<name>_eval_seconds``.  Returns the first evaluation image's
    full-size prediction (for the overlay) and the figures.
    """
    t = time.perf_counter()
    k = data.num_classes
    conf = np.zeros((k, k), np.int64)
    first = None
    for image, full in zip(data.eval_images, data.eval_full_masks):
        pred = upsample_labels(predict(model, image, mode=mode, overlap=overlap, batch=batch, device=device),
                               *full.shape)
        conf += confusion(pred, full, k)
        first = pred if first is None else first
    scores = scores_from_confusion(name, conf, data.classes)
    if k == 2:
        log(f"  {name}: vessel IoU {scores[f'{name}_iou']:.4f}  F1 {scores[f'{name}_f1']:.4f}")
    else:
        log(f"  {name}: mIoU {scores[f'{name}_miou']:.4f}  pixel accuracy {scores[f'{name}_pixel_accuracy']:.4f}")
    return first, {**scores, f"{name}_confusion": conf.tolist(),
                   f"{name}_eval_seconds": round(time.perf_counter() - t, 1)}


def scores_from_confusion(name: str, conf, classes: Sequence[str]) -> dict:
    """A variant's figures from its (K, K) confusion pooled over evaluation images (:func:`confusion`).

    Two classes: the vessel's (class 1) IoU and F1 (``<name>_iou``, ``<name>_f1``, as
    :func:`vessel_scores`); more: ``<name>_miou``, ``<name>_class_iou`` and ``<name>_pixel_accuracy``
    (:func:`class_scores`).
    """
    conf = np.asarray(conf, dtype=np.int64)
    if len(classes) == 2:
        return {f"{name}_{k}": v for k, v in _iou_f1(int(conf[1, 1]), int(conf[0, 1]), int(conf[1, 0])).items()}
    s = class_scores(conf, classes)
    return {f"{name}_miou": s["miou"], f"{name}_class_iou": {c: round(v, 4) for c, v in s["class_iou"].items()},
            f"{name}_pixel_accuracy": s["pixel_accuracy"]}


def save_bench_model(out_json: str | os.PathLike, model, *, options: dict, scale: float, overlap: int,
                     classes: Sequence[str] = ("background", "vessel")) -> Path:
    """The global-local checkpoint beside the bench JSON (what ``wsseg segment --model`` reads)."""
    from wsseg.tasks.store import save_model
    return save_model(files.bench_outputs(out_json)[0], model, builder="global_local", num_classes=len(classes),
                      in_channels=3, options=options,
                      meta={"scale": scale, "overlap": overlap, "classes": list(classes)})


def write_overlay(out_json: str | os.PathLike, data_dir: str | os.PathLike, data: BenchData,
                  pred: np.ndarray) -> Path:
    """image | truth | prediction of the first evaluation image, beside the bench JSON."""
    full_image = files.read_image(files.dataset_image_path(data_dir, data.eval_ids[0]), 1.0)
    return files.write_rgb_png(files.bench_outputs(out_json)[1], overlay_panel(full_image, data.eval_full_masks[0],
                                                                              pred, num_classes=data.num_classes))


def run_segment_command(checkpoint: Path, image: Path, out_dir: Path, *, overlap: int, batch: int,
                        threads: int) -> dict:
    """Run ``wsseg segment`` on one image in a fresh process; its report (``segment.json``) plus the
    process's peak resident set size (``VmHWM`` polled from /proc while it runs, in MB)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))}
    api = _prefect_api_url()
    if api:
        env["PREFECT_API_URL"] = api        # the parent's Prefect API: the child starts no server of its own
    # the child runs in the project's folder: relative paths (the README's `--out runs/...`) are made whole first
    image, checkpoint, out_dir = (Path(p).resolve() for p in (image, checkpoint, out_dir))
    cmd = [sys.executable, "-m", "wsseg", "segment", str(image), "--model", str(checkpoint), "--out",
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
