"""Training and inference of the networks: device-aware, seeded, resumable.

* ``train_segmentation``: cross-entropy with ignore index 255 on (image + edge channel, label)
  pairs streamed from the store through a DataLoader; checkpoint every epoch and resume after
  an interruption; stops on the epoch budget, a time budget or a loss plateau.
* ``train_classifier``: the multi-label image classifier (binary cross-entropy on the tags)
  whose class activation maps are round 0's preliminary result.
* ``ContextDataset`` (:func:`context_sample`): crops that carry their whole image's coarse
  view and box, for networks that need global context (``needs_global_context``, the
  global-local network); ``train_step`` passes such batches as keyword inputs.
* ``predict_probs`` / ``class_activation_maps`` / ``image_class_probs``: inference on one image.

The device is chosen automatically (CUDA, then CPU); on CUDA the step runs under bfloat16
autocast and tensors are channels_last (on CPU, contiguous is faster).
"""
from __future__ import annotations

import abc
import dataclasses
import math
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import cv2
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

MEAN = np.array([0.485, 0.456, 0.406], np.float32)
STD = np.array([0.229, 0.224, 0.225], np.float32)
IGNORE = 255


def device_problem(requested: str) -> str | None:
    """Why device ``requested`` cannot train here (one line), or None: ``auto``, ``cpu``, ``cuda`` and
    ``cuda:N`` with CUDA present (N under its device count), ``mps`` where present.

    >>> device_problem("cpu"), device_problem("auto")
    (None, None)
    >>> device_problem("gpu")
    "device 'gpu': not a device wsseg trains on (auto, cpu, cuda, cuda:N, mps)"
    """
    if requested in ("auto", "cpu"):
        return None
    kind, _, index = requested.partition(":")
    if kind == "cuda" and (not index or index.isdigit()):
        if not torch.cuda.is_available():
            return f"device {requested!r}: CUDA is not available on this machine; use --device cpu or auto"
        if index and int(index) >= torch.cuda.device_count():
            return f"device {requested!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
        return None
    if requested == "mps":
        return None if torch.backends.mps.is_available() else "device 'mps': not available on this machine"
    return f"device {requested!r}: not a device wsseg trains on (auto, cpu, cuda, cuda:N, mps)"


def pick_device(requested: str = "auto") -> torch.device:
    """``auto``: CUDA when available, else CPU; a device that is not there is a ValueError
    (:func:`device_problem`)."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    problem = device_problem(requested)
    if problem:
        raise ValueError(problem)
    return torch.device(requested)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _epoch_seed(seed: int, epoch: int) -> int:
    """Seed of the global RNGs (dropout, ...) for one epoch: a function of (seed, epoch) only,
    so that a resumed training draws what an uninterrupted one would."""
    return int(np.random.SeedSequence((seed, epoch)).generate_state(1)[0])


def to_input(image: np.ndarray, edge: np.ndarray | None) -> np.ndarray:
    """(H, W, 3) uint8 + optional (H, W) {0,1} edge map -> (C, H, W) float32 network input."""
    x = (image.astype(np.float32) / 255.0 - MEAN) / STD
    chans = [x.transpose(2, 0, 1)]
    if edge is not None:
        chans.append((edge.astype(np.float32) - 0.5)[None])
    return np.ascontiguousarray(np.concatenate(chans, 0))


# ---------------------------------------------------------------------------- data
@dataclass
class Augment:
    """Random scale, crop (padded with ignore), horizontal flip, brightness/contrast jitter."""

    crop: int = 256
    scale: tuple[float, float] = (0.7, 1.3)
    flip: bool = True
    jitter: float = 0.15

    def __call__(self, rng: np.random.Generator, image, edge, label):
        s = rng.uniform(*self.scale)
        h, w = image.shape[:2]
        nh, nw = max(8, int(round(h * s))), max(8, int(round(w * s)))
        image = cv2.resize(image, (nw, nh), interpolation=cv2.INTER_LINEAR)
        if edge is not None:
            edge = cv2.resize(edge, (nw, nh), interpolation=cv2.INTER_NEAREST)
        if label is not None and label.ndim == 2:
            label = cv2.resize(label, (nw, nh), interpolation=cv2.INTER_NEAREST)
        image, edge, label = _random_crop(rng, self.crop, image, edge, label)
        if self.flip and rng.random() < 0.5:
            image = image[:, ::-1]
            edge = edge[:, ::-1] if edge is not None else None
            label = label[:, ::-1] if label is not None and label.ndim == 2 else label
        if self.jitter:
            a = 1.0 + rng.uniform(-self.jitter, self.jitter)
            b = 255 * rng.uniform(-self.jitter, self.jitter) / 2
            image = np.clip(image.astype(np.float32) * a + b, 0, 255).astype(np.uint8)
        return np.ascontiguousarray(image), edge if edge is None else np.ascontiguousarray(edge), \
            label if label is None or label.ndim != 2 else np.ascontiguousarray(label)


def _random_crop(rng, crop, image, edge, label):
    h, w = image.shape[:2]
    ph, pw = max(0, crop - h), max(0, crop - w)
    if ph or pw:
        image = np.pad(image, ((0, ph), (0, pw), (0, 0)))
        edge = np.pad(edge, ((0, ph), (0, pw))) if edge is not None else None
        if label is not None and label.ndim == 2:
            label = np.pad(label, ((0, ph), (0, pw)), constant_values=IGNORE)
        h, w = image.shape[:2]
    y = int(rng.integers(0, h - crop + 1))
    x = int(rng.integers(0, w - crop + 1))
    sl = (slice(y, y + crop), slice(x, x + crop))
    image = image[sl]
    edge = edge[sl] if edge is not None else None
    if label is not None and label.ndim == 2:
        label = label[sl]
    return image, edge, label


class StoreDataset(Dataset):
    """Training samples read from the store on demand (works in DataLoader workers).

    ``load(i) -> (image, edge or None, target)`` is a picklable callable; target is an
    (H, W) uint8 label map or a (K,) float tag vector.
    """

    def __init__(self, n: int, load: Callable[[int], tuple], augment: Augment | None, seed: int = 0,
                 with_edge: bool = True):
        self.n, self.load, self.augment, self.seed, self.with_edge = n, load, augment, seed, with_edge
        self.epoch = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, key: int | tuple[int, int]):
        # (epoch, i) keys come from EpochBatchSampler: the epoch travels with the key because a
        # worker's copy of the dataset keeps the epoch it was started with
        epoch, i = key if isinstance(key, tuple) else (self.epoch, key)
        image, edge, target = self.load(i)
        if not self.with_edge:
            edge = None
        if self.augment is not None:
            rng = np.random.default_rng((self.seed, epoch, i))
            image, edge, target = self.augment(rng, image, edge, target)
        x = torch.from_numpy(to_input(image, edge))
        if target.ndim == 2:
            return x, torch.from_numpy(target.astype(np.int64))
        return x, torch.from_numpy(np.asarray(target, np.float32))


def context_sample(rng: np.random.Generator, image: np.ndarray, edge: np.ndarray | None, label: np.ndarray,
                   augment: Augment, coarse_classes: int | None = None) -> tuple[dict, np.ndarray]:
    """A training crop with the global context of its whole image (global-local networks).

    The whole image (and edge map and label map) is scaled by a random factor in
    ``augment.scale`` and flipped horizontally at random; a brightness/contrast jitter is
    applied to all of it.  Then

    * ``x``: a random ``augment.crop`` square of it as network input (:func:`to_input`),
      zero-padded in input space where the image is smaller, as
      :meth:`models.global_local.GlobalLocalNet.forward` pads patches at inference;
    * ``coarse``: the whole scaled image as network input, resized to ``augment.crop``
      square by :func:`models.global_local.coarse_input` (what ``forward`` computes at
      inference);
    * ``boxes``: the crop's ``[x1, y1, x2, y2]`` in coarse-image pixels (the crop's pixel
      box scaled by ``crop / W`` and ``crop / H``, as
      :func:`models.global_local.patch_boxes_in_coarse`);
    * the label crop, padded with ignore (255).

    Returns
    -------
    inputs : dict
        ``{"x": (C, p, p), "coarse": (C, p, p), "boxes": (4,)}`` float32 tensors, ``p =
        augment.crop``.
    label : (p, p) uint8
        With ``coarse_classes`` = K: a (1 + K, p, p) float32 array instead, the label crop in
        channel 0 and the class fractions of the whole scaled label map at the coarse image's
        size in channels 1.. (:func:`reduce_fractions`), for a loss on the coarse
        image (:func:`coarse_context_loss`).
    """
    from wsseg.models.global_local import coarse_input

    p = augment.crop
    s = rng.uniform(*augment.scale)
    h, w = image.shape[:2]
    nh, nw = max(8, int(round(h * s))), max(8, int(round(w * s)))
    image = cv2.resize(image, (nw, nh), interpolation=cv2.INTER_LINEAR)
    edge = cv2.resize(edge, (nw, nh), interpolation=cv2.INTER_NEAREST) if edge is not None else None
    label = cv2.resize(label, (nw, nh), interpolation=cv2.INTER_NEAREST)
    if augment.flip and rng.random() < 0.5:
        image, label = image[:, ::-1], label[:, ::-1]
        edge = edge[:, ::-1] if edge is not None else None
    if augment.jitter:
        a = 1.0 + rng.uniform(-augment.jitter, augment.jitter)
        b = 255 * rng.uniform(-augment.jitter, augment.jitter) / 2
        image = np.clip(image.astype(np.float32) * a + b, 0, 255).astype(np.uint8)
    whole = torch.from_numpy(to_input(image, edge))
    coarse = coarse_input(whole[None], p)[0]
    y0 = int(rng.integers(0, max(nh - p, 0) + 1))
    x0 = int(rng.integers(0, max(nw - p, 0) + 1))
    ch, cw = min(p, nh - y0), min(p, nw - x0)
    x = torch.zeros((whole.shape[0], p, p), dtype=torch.float32)
    x[:, :ch, :cw] = whole[:, y0:y0 + ch, x0:x0 + cw]
    target = np.full((p, p), IGNORE, np.uint8)
    target[:ch, :cw] = label[y0:y0 + ch, x0:x0 + cw]
    boxes = torch.tensor([x0 * p / nw, y0 * p / nh, (x0 + p) * p / nw, (y0 + p) * p / nh], dtype=torch.float32)
    inputs = {"x": x, "coarse": coarse.contiguous(), "boxes": boxes}
    if coarse_classes:
        packed = np.empty((1 + coarse_classes, p, p), np.float32)
        packed[0] = target
        packed[1:] = reduce_fractions(np.ascontiguousarray(label), (p, p), coarse_classes)
        return inputs, packed
    return inputs, target


def reduce_fractions(mask: np.ndarray, shape: tuple[int, int], num_classes: int) -> np.ndarray:
    """Each class's share of the annotated area of every pixel of a label mask reduced to ``shape``.

    Returns a (num_classes, H, W) float32 array whose columns sum to 1 where at least half of a
    reduced pixel's area is annotated and are all 0 elsewhere (ignored). Unlike
    :func:`tasks.highres.train.reduce_mask`, a class thinner than a reduced pixel (a vessel in a coarse retina image)
    keeps its share instead of vanishing into the class around it.
    """
    if mask.ndim != 2 or num_classes < 1:
        raise ValueError(f"mask must be (H, W) and num_classes >= 1, got {mask.shape}, {num_classes}")
    size = (shape[1], shape[0])
    valid = cv2.resize((mask != 255).astype(np.float32), size, interpolation=cv2.INTER_AREA)
    out = np.zeros((num_classes,) + tuple(shape), np.float32)
    for k in np.flatnonzero(np.bincount(mask.ravel(), minlength=256)[:num_classes]):
        out[k] = cv2.resize((mask == k).astype(np.float32), size, interpolation=cv2.INTER_AREA)
    out /= np.maximum(valid, 1e-6)
    out[:, valid < 0.5] = 0.0
    return out


def soft_cross_entropy(logits, fractions, class_weights=None):
    """Cross-entropy against class fractions (B, K, h, w), weighted per class like
    :func:`segmentation_loss`: sum over pixels and classes of ``w_k q_k (-log p_k)``
    over the sum of ``w_k q_k``; pixels whose fractions are all 0 are ignored. With one-hot
    fractions it equals the weighted cross-entropy of the hard labels."""
    w = fractions if class_weights is None else \
        fractions * torch.as_tensor(class_weights, dtype=logits.dtype, device=logits.device).view(1, -1, 1, 1)
    total = w.sum()
    if total <= 0:
        return logits.sum() * 0.0
    return -(w * torch.log_softmax(logits, 1)).sum() / total


def coarse_context_loss(class_weights: Sequence[float] | None, weight: float) -> tuple[Callable, Callable]:
    """``(loss, forward)`` for :func:`fit` on :class:`ContextDataset` samples with ``coarse_classes``:
    the crop's cross-entropy (:func:`segmentation_loss`) + ``weight`` x the soft cross-entropy of
    the coarse head's prediction of the whole image against its label fractions
    (:func:`soft_cross_entropy`). The network must be a global-local one built with
    ``coarse_head``; ``forward`` stacks its crop and coarse logits."""
    from wsseg.models.global_local import indexed_boxes
    ce = segmentation_loss(class_weights)

    def forward(model, x: dict):
        logits, coarse_logits = model.forward_patches(x["x"], x["coarse"], indexed_boxes(x["boxes"]),
                                                      with_coarse=True)
        return torch.cat([logits, coarse_logits])

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        n = len(y)
        return ce(out[:n], y[:, 0].long()) + weight * soft_cross_entropy(out[n:], y[:, 1:], class_weights)
    return loss, forward


class ContextDataset(StoreDataset):
    """Training samples for networks that see the whole image beside each crop.

    Like :class:`StoreDataset` (same loader, seeding and epochs), but each sample is
    :func:`context_sample`'s ``({"x", "coarse", "boxes"}, label)``: the crop, its whole
    image's coarse view and its box.  ``augment.crop`` is the network's patch size, which
    is also the side of the coarse image.  :func:`train_step` calls the network as
    ``model(x=..., coarse=..., boxes=...)``.
    """

    def __init__(self, n: int, load: Callable[[int], tuple], augment: Augment, seed: int = 0,
                 with_edge: bool = True, coarse_classes: int | None = None):
        if augment is None:
            raise ValueError("ContextDataset needs an Augment (its crop is the network's patch size)")
        super().__init__(n, load, augment, seed=seed, with_edge=with_edge)
        self.coarse_classes = coarse_classes

    def __getitem__(self, key: int | tuple[int, int]):
        epoch, i = key if isinstance(key, tuple) else (self.epoch, key)
        image, edge, target = self.load(i)
        if target.ndim != 2:
            raise ValueError(f"ContextDataset needs (H, W) label maps, sample {i} has shape {target.shape}")
        rng = np.random.default_rng((self.seed, epoch, i))
        inputs, label = context_sample(rng, image, edge if self.with_edge else None, target, self.augment,
                                       coarse_classes=self.coarse_classes)
        if self.coarse_classes:
            return inputs, torch.from_numpy(label)
        return inputs, torch.from_numpy(label.astype(np.int64))


# ---------------------------------------------------------------------------- training
@dataclass
class TrainConfig:
    epochs: int = 20
    batch_size: int = 8
    lr: float = 1e-3
    weight_decay: float = 1e-4
    crop: int = 256
    num_workers: int = 1
    seed: int = 0
    device: str = "auto"
    max_seconds: float | None = None
    patience: int = 4
    min_delta: float = 0.01
    class_weights: Sequence[float] | None = None
    #: stop after this many optimiser steps in all (None: ``epochs`` full epochs); the schedule
    #: then spans these steps
    max_steps: int | None = None
    #: learning-rate schedule: ``one_cycle`` (OneCycleLR, 15 % warm-up) or ``warmup_cosine``
    #: (linear warm-up over 5 % of the steps, then cosine decay to 0; method C's)
    schedule: str = "one_cycle"
    #: a batch whose targets are all ignore (255) is skipped (no step; its loss is NaN) instead of
    #: stepping on a zero loss
    skip_unlabelled: bool = False


@dataclass
class TrainResult:
    epochs_run: int
    stopped: str
    history: list[dict] = field(default_factory=list)
    device: str = "cpu"
    images_per_second: float = 0.0
    data_wait_share: float = 0.0
    resumed_from: int = 0
    #: every step's loss (NaN for a skipped batch), of this call's steps
    losses: list[float] = field(default_factory=list)


class EpochBatchSampler(torch.utils.data.Sampler):
    """Batches of ``(epoch, index)`` keys for epochs ``start .. epochs - 1`` in one stream.

    Each epoch is a shuffle seeded by (seed, epoch) cut into ``max(1, n // batch_size)``
    batches (the incomplete last one dropped, unless the data is smaller than a batch). One
    DataLoader iterates all epochs: its workers start once and keep prefetching across epoch
    boundaries (measured: a DataLoader per epoch waited 0.8-1.5 s at every epoch start).
    """

    def __init__(self, n: int, batch_size: int, seed: int, start: int, epochs: int):
        self.n, self.batch_size, self.seed, self.start, self.epochs = n, batch_size, seed, start, epochs
        self.steps_per_epoch = max(1, n // batch_size)

    def __len__(self) -> int:
        return max(0, self.epochs - self.start) * self.steps_per_epoch

    def __iter__(self):
        b = self.batch_size
        for e in range(self.start, self.epochs):
            order = torch.randperm(self.n, generator=torch.Generator().manual_seed(_epoch_seed(self.seed, e))).tolist()
            for k in range(self.steps_per_epoch):
                yield [(e, i) for i in order[k * b:(k + 1) * b]]


class BatchSource(abc.ABC):
    """Batches made by the caller instead of a :class:`StoreDataset` (e.g. method C's patches).

    Subclasses give ``steps_per_epoch`` and ``batches(start_epoch, epochs)``; a subclass without
    ``batches`` cannot be instantiated."""

    steps_per_epoch: int = 1

    @abc.abstractmethod
    def batches(self, start_epoch: int, epochs: int) -> Iterator[tuple]:
        """``(x, y)`` batches for epochs ``start_epoch .. epochs - 1``, ``steps_per_epoch`` each
        (``x`` a tensor or a dict of keyword inputs)."""


def _loader(ds: StoreDataset, cfg: TrainConfig, device: torch.device, start_epoch: int = 0) -> DataLoader:
    """One loader for epochs ``start_epoch .. cfg.epochs - 1`` (see :class:`EpochBatchSampler`)."""
    workers = cfg.num_workers
    return DataLoader(ds, batch_sampler=EpochBatchSampler(len(ds), cfg.batch_size, cfg.seed, start_epoch, cfg.epochs),
                      num_workers=workers, pin_memory=device.type == "cuda",
                      prefetch_factor=4 if workers else None)


def _to_device(x, device: torch.device, fmt: torch.memory_format):
    """A batch tensor, or a dict of them (keyword inputs), on ``device``; 4-D tensors in ``fmt`` when
    that is channels_last (CUDA). On CPU a batch keeps its strides: the loader's batches are
    contiguous already, and method C's patches (:func:`models.global_local.normalize`, channels-last
    strides) train as they always did."""
    if isinstance(x, dict):
        return {k: _to_device(v, device, fmt) for k, v in x.items()}
    x = x.to(device, non_blocking=True)
    return x.to(memory_format=fmt) if x.ndim == 4 and fmt == torch.channels_last else x


def batch_size_of(x) -> int:
    """Samples in a batch: a tensor's first dimension, or that of a dict's first tensor."""
    return len(next(iter(x.values()))) if isinstance(x, dict) else len(x)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, sched, loss_fn: Callable, x: torch.Tensor | dict,
               y: torch.Tensor, *, device: torch.device, fmt: torch.memory_format, amp: bool,
               forward: Callable | None = None) -> torch.Tensor:
    """One optimiser step on a batch (bf16 autocast when ``amp``); returns the detached loss.
    ``x`` is the network's input, or a dict of keyword inputs (``model(**x)``, e.g. a
    :class:`ContextDataset` batch); ``forward(model, x)``, when given, calls the network instead.
    The schedule stops stepping at its last step, so resumed or extended loops stay valid."""
    x = _to_device(x, device, fmt)
    y = y.to(device, non_blocking=True)
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
        if forward is not None:
            out = forward(model, x)
        else:
            out = model(**x) if isinstance(x, dict) else model(x)
        loss = loss_fn(out.float(), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    if sched.last_epoch < sched.total_steps - 1:
        sched.step()
    return loss.detach()


def _schedule(opt: torch.optim.Optimizer, cfg: TrainConfig, steps: int):
    """The learning-rate schedule over ``steps`` optimiser steps (``total_steps`` = steps + 1)."""
    if cfg.schedule == "one_cycle":
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[g["lr"] for g in opt.param_groups],
                                                   total_steps=steps + 1, pct_start=0.15)
    if cfg.schedule == "warmup_cosine":
        warm = max(1, steps // 20)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + np.cos(np.pi * (s - warm) / max(1, steps - warm))))
        sched.total_steps = steps + 1
        return sched
    raise ValueError(f"unknown schedule {cfg.schedule!r}; one of: one_cycle, warmup_cosine")


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW at ``cfg.lr`` and ``cfg.weight_decay`` over ``model.param_groups(cfg.lr)`` where the model
    has them (a pretrained encoder learns slower than the layers new to it), else over all its parameters."""
    params = model.param_groups(cfg.lr) if hasattr(model, "param_groups") else model.parameters()
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def fit(model: nn.Module, ds: StoreDataset | BatchSource, loss_fn: Callable, cfg: TrainConfig, *,
        checkpoint=None, log: Callable[[dict, int], None] | None = None,
        progress: Callable[[str], None] | None = None, on_step: Callable[[dict], None] | None = None,
        forward: Callable | None = None, resume_key: dict | None = None) -> TrainResult:
    """The one training loop of every network: seeded, resumable, budgeted, plateau-aware.

    Parameters
    ----------
    ds : StoreDataset or BatchSource
        A dataset (batches through DataLoader workers, :class:`EpochBatchSampler`), or a
        :class:`BatchSource` that makes its own batches (method C's patches).
    checkpoint : tasks.store.StateFile, optional
        Model, optimiser, scheduler, epoch and history, saved (atomically) after every epoch;
        when it holds a state, training resumes from the epoch after the saved one.
    resume_key : dict, optional
        What the training is computed from (corpus hash, class list, settings), saved with the
        state: a state saved under another key is not resumed (training starts over).
    log, progress : callable, optional
        Per epoch: ``log(metrics, epoch)``, ``progress(line)``.
    on_step : callable(dict), optional
        After every step: ``{"step", "epoch", "loss" (float, NaN when skipped), "lr", "wait",
        "busy", "images", "seconds", "batches" (the batch iterator)}``.
    forward : callable(model, x), optional
        How the network is called on a batch (default ``model(x)`` / ``model(**x)``).
    """
    seed_everything(cfg.seed)
    device = pick_device(cfg.device)
    # channels_last pays on CUDA; on CPU batch norm in channels_last was measured 2-3x slower
    fmt = torch.channels_last if device.type == "cuda" else torch.contiguous_format
    model = model.to(device).to(memory_format=fmt)
    opt = make_optimizer(model, cfg)
    source = ds if isinstance(ds, BatchSource) else None
    steps_per_epoch = source.steps_per_epoch if source is not None else max(1, len(ds) // cfg.batch_size)
    epochs = cfg.epochs if cfg.max_steps is None else min(cfg.epochs, -(-cfg.max_steps // steps_per_epoch))
    total = epochs * steps_per_epoch if cfg.max_steps is None else min(cfg.max_steps, epochs * steps_per_epoch)
    sched = _schedule(opt, cfg, total)
    history: list[dict] = []
    start_epoch = 0
    state = checkpoint.load(device) if checkpoint is not None else None
    if state is not None and state.get("resume_key") != resume_key:
        # a stopped training of other inputs (another corpus, class list or configuration)
        print(f"  [train] {checkpoint.path}: a stopped training of other inputs; starting over",
              file=sys.stderr, flush=True)
        state = None
    if state is not None:
        if state.get("epochs") == cfg.epochs and state.get("epoch", -1) + 1 <= cfg.epochs:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            sched.load_state_dict(state["scheduler"])
            history = state["history"]
            start_epoch = state["epoch"] + 1
            if state.get("stopped"):
                return TrainResult(start_epoch, state["stopped"], history, device.type, resumed_from=start_epoch)
    amp = device.type == "cuda"
    t_start = time.perf_counter()
    best = math.inf
    stale = 0
    stopped = "epochs"
    n_images = 0
    wait = 0.0
    busy = 0.0
    losses: list[float] = []
    step = start_epoch * steps_per_epoch
    epoch = start_epoch - 1  # a finished training resumed: no epoch runs, epochs_run = start_epoch
    batches = None
    if start_epoch < epochs:
        batches = iter(source.batches(start_epoch, epochs) if source is not None
                       else _loader(ds, dataclasses.replace(cfg, epochs=epochs), device, start_epoch))
    for epoch in range(start_epoch, epochs):
        seed_everything(_epoch_seed(cfg.seed, epoch))
        if source is None:
            ds.epoch = epoch
        model.train()
        total_loss, count = 0.0, 0
        t_epoch = time.perf_counter()
        t_ready = time.perf_counter()
        for _ in range(min(steps_per_epoch, total - step)):
            t_waited = t_ready
            x, y = next(batches)
            t_got = time.perf_counter()
            wait += t_got - t_ready
            n = batch_size_of(x)
            if cfg.skip_unlabelled and (y != IGNORE).sum() == 0:
                value = float("nan")
            else:
                value = float(train_step(model, opt, sched, loss_fn, x, y, device=device, fmt=fmt, amp=amp,
                                         forward=forward))
                total_loss += value * n
                count += n
            n_images += n
            losses.append(value)
            step += 1
            t_ready = time.perf_counter()
            busy += t_ready - t_got
            if on_step is not None:
                on_step({"step": step, "epoch": epoch, "loss": value, "lr": opt.param_groups[0]["lr"],
                         "wait": t_got - t_waited, "busy": t_ready - t_got, "images": n,
                         "seconds": t_ready - t_start, "batches": batches})
        mean_loss = total_loss / max(count, 1)
        rec = {"epoch": epoch, "loss": mean_loss, "lr": opt.param_groups[0]["lr"],
               "seconds": time.perf_counter() - t_epoch}
        history.append(rec)
        if log is not None:
            log({"train_loss": mean_loss, "lr": rec["lr"], "epoch_seconds": rec["seconds"]}, epoch)
        if progress is not None:
            progress(f"epoch {epoch + 1}/{cfg.epochs} loss {mean_loss:.4f} ({rec['seconds']:.1f}s)")
        if mean_loss < best * (1 - cfg.min_delta):
            best, stale = mean_loss, 0
        else:
            stale += 1
        stop = None
        if stale >= cfg.patience:
            stop = "plateau"
        elif cfg.max_seconds is not None and time.perf_counter() - t_start > cfg.max_seconds:
            stop = "time budget"
        if checkpoint is not None:
            checkpoint.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                             "scheduler": sched.state_dict(), "epoch": epoch,
                             "epochs": cfg.epochs, "history": history, "stopped": stop,
                             "resume_key": resume_key})
        if stop:
            stopped = stop
            break
    del batches  # stops the loader's workers
    elapsed = wait + busy
    return TrainResult(epochs_run=epoch + 1, stopped=stopped, history=history, device=device.type,
                       images_per_second=n_images / busy if busy else 0.0,
                       data_wait_share=wait / elapsed if elapsed else 0.0, resumed_from=start_epoch,
                       losses=losses)


def segmentation_loss(class_weights: Sequence[float] | None = None) -> Callable:
    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        w = torch.as_tensor(class_weights, dtype=out.dtype, device=out.device) if class_weights is not None else None
        if (y != IGNORE).sum() == 0:
            return out.sum() * 0.0
        return F.cross_entropy(out, y, weight=w, ignore_index=IGNORE)
    return loss


def balanced_class_weights(counts: Sequence[float], power: float = 0.5, max_ratio: float = 10.0) -> list[float]:
    """Per-class loss weights ``share ** -power`` from label pixel counts, scaled to mean 1 over the
    classes that occur and clipped to ``max_ratio`` times the smallest weight (a class seen on a
    handful of pixels must not dominate); classes that never occur get weight 0 (they have no
    pixels to weigh). ``power=0``: all ones."""
    c = np.asarray(counts, np.float64)
    if c.ndim != 1 or (c < 0).any():
        raise ValueError(f"counts must be a 1-D array of non-negative pixel counts, got {c}")
    present = c > 0
    if power == 0 or not present.any():
        return [1.0] * len(c)
    w = np.zeros_like(c)
    w[present] = (c[present] / c.sum()) ** -power
    w[present] = np.minimum(w[present], w[present].min() * max_ratio)
    w[present] /= w[present].mean()
    return w.tolist()


def multilabel_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(out, y)


# ---------------------------------------------------------------------------- inference
@torch.no_grad()
def predict_probs(model: nn.Module, image: np.ndarray, edge: np.ndarray | None, *,
                  device: torch.device | None = None, flip: bool = True) -> np.ndarray:
    """(K, H, W) float32 softmax of a segmentation network on one image (flip-averaged)."""
    device = device or next(model.parameters()).device
    model.eval()
    x = torch.from_numpy(to_input(image, edge))[None].to(device)
    logits = model(x)
    prob = logits.softmax(1)
    if flip:
        prob = 0.5 * (prob + model(x.flip(-1)).softmax(1).flip(-1))
    return prob[0].float().cpu().numpy()


def _at_scale(image: np.ndarray, s: float) -> np.ndarray:
    """``image`` resized by ``s`` (bilinear, at least 16 pixels a side)."""
    h, w = image.shape[:2]
    return cv2.resize(image, (max(16, int(w * s)), max(16, int(h * s))), interpolation=cv2.INTER_LINEAR)


@torch.no_grad()
def image_class_probs(model: nn.Module, image: np.ndarray, *, scales: Sequence[float] = (1.0,), flip: bool = True,
                      device: torch.device | None = None) -> np.ndarray:
    """(K,) float32 sigmoid of a multi-label image classifier on one image, averaged over the
    image ``scales`` and (``flip``) its mirror image."""
    device = device or next(model.parameters()).device
    model.eval()
    acc = []
    for s in scales:
        x = torch.from_numpy(to_input(_at_scale(image, s), None))[None].to(device)
        xs = torch.cat([x, x.flip(-1)]) if flip else x
        acc.append(torch.sigmoid(model(xs)).mean(0))
    return torch.stack(acc).mean(0).float().cpu().numpy()


@torch.no_grad()
def class_activation_maps(model: nn.Module, image: np.ndarray, *, scales: Sequence[float] = (0.75, 1.0, 1.25),
                          flip: bool = True, device: torch.device | None = None, raw: bool = False,
                          maps_levels: Sequence[int] | None = None):
    """(K, H, W) float32 class activation maps, multi-scale and flip averaged.

    Default: ReLU of the class map, each class divided by its maximum (in [0, 1]).
    ``raw=True``: the averaged class map (logit units) itself, for :func:`tasks.wsss.pipeline.cam_to_prob_centered`.
    ``maps_levels``: also return the encoder's maps at these levels (``forward_features``' indices)
    from the same pass, those of the first scale's image without its mirror, as a list of (1, C, h, w)
    tensors: ``(cams, maps)`` (the superpixel features of :mod:`tasks.wsss.deep_features`). The model
    needs ``cam_and_maps`` (:class:`models.lite_nets.LiteClassifier`).
    """
    device = device or next(model.parameters()).device
    model.eval()
    h, w = image.shape[:2]
    acc, kept = None, None
    for s in scales:
        x = torch.from_numpy(to_input(_at_scale(image, s), None))[None].to(device)
        xs = torch.cat([x, x.flip(-1)]) if flip else x
        if maps_levels is not None and kept is None:
            cam, maps = model.cam_and_maps(xs, tuple(maps_levels))
            kept = [m[:1] for m in maps]
        else:
            cam = model.cam(xs)
        cam = cam if raw else F.relu(cam)
        cam = 0.5 * (cam[:1] + cam[1:].flip(-1)) if flip else cam
        cam = F.interpolate(cam, size=(h, w), mode="bilinear", align_corners=False)[0]
        acc = cam if acc is None else acc + cam
    acc = acc / len(scales)
    if not raw:
        acc = acc / acc.flatten(1).amax(1).clamp_min(1e-5)[:, None, None]
    cams = acc.float().cpu().numpy()
    return cams if maps_levels is None else (cams, kept)
