"""``wsseg bench train``: training throughput of a registry network on real store batches.

1. ingest the bundled sample (or ``--data``) into ``--run-dir`` with the ingest flow's per-image
   shard function (:func:`tasks.pipeline.ingest_shard`, no Prefect server needed) and compute
   the per-image features (:func:`tasks.pipeline.compute_features`; cached by content, so a
   second bench on the same run directory starts at once);
2. build the network (``--model``, ``--options``) and train it for ``--steps`` optimiser steps
   on ``--size`` x ``--size`` crops, with the ground-truth masks as labels read through the
   same path as real training: :class:`flows.wsss.LabelLoader` -> :class:`tasks.training.StoreDataset`
   (:class:`tasks.training.Augment`) -> :func:`tasks.training._loader` (DataLoader workers);
   the step is :func:`tasks.training.fit`'s (AdamW + one-cycle, bf16 autocast and
   channels_last on CUDA only);
3. report, over the steady-state steps (the first ``--warmup`` are skipped):
   ``images_per_second`` (images / wall time of those steps, loader waits included),
   ``compute_images_per_second`` (images / time in forward+backward+step), ``data_wait_share``
   (share of the wall time spent waiting for the loader, DataLoader start-up and shut-down at
   epoch boundaries included), ``peak_rss_mb`` (VmHWM of the main process during training and
   of each loader worker; workers are separate processes), device, torch threads and the
   parameter count; on CUDA also images/s at 512 x 512 under bf16 autocast.

A one-screen summary is printed and the figures are written to ``--out`` (JSON).

This module must stay importable before :func:`flows.runtime.prepare` runs (the CLI imports it
to build its parser): torch and the flows are imported inside functions.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

__all__ = ["prepare_corpus", "measure_training", "run_bench", "format_summary", "add_bench_train_parser", "main"]

SAMPLE = Path(__file__).resolve().parent / "sample" / "msrc21"


# ============================================================================ process memory
def _status_kb(pid: int | str, field: str) -> int | None:
    """A ``kB`` field (``VmHWM``, ``VmRSS``) of /proc/PID/status, None when unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _pss_kb(pid: int | str) -> int | None:
    """Proportional set size (shared pages split between their users) of a process."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _reset_peak_rss() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux >= 4.0); False when not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _mb(kb: int | None) -> float | None:
    return None if kb is None else round(kb / 1024, 1)


# ============================================================================ 1. corpus + features
def prepare_corpus(run_dir: str | os.PathLike, source: str | os.PathLike = SAMPLE, *,
                   progress: Callable[[str], None] | None = None) -> tuple[list, str]:
    """Ingest ``source`` into the store of ``run_dir`` and compute the default per-image features.

    Both steps are the ones the flows run (per-image functions of :mod:`tasks.pipeline`), run
    here in-process; an existing corpus and cached features are reused.

    Returns
    -------
    records : list of ImageRecord
        Every image of the corpus (all splits) that has a mask.
    feature_key : str
        Key of the feature cache (:func:`tasks.pipeline.feature_key` of the default
        :class:`flows.config.FeatureConfig`), what :class:`flows.wsss.LabelLoader` reads edges by.

    Raises
    ------
    ValueError
        When the source has no image with a ground-truth mask (the bench trains on the masks).
    """
    from flows.config import FeatureConfig
    from tasks import ingest as ing
    from tasks import pipeline as pl
    from tasks.store import ImageRecord, Store

    say = progress or (lambda s: None)
    store = Store(run_dir)
    if not store.has_corpus():
        items, classes = ing.read_source(source)
        by_id = {it.image_id: dict(image_path=str(it.image_path), mask_path=str(it.mask_path) if it.mask_path else None,
                                   tags=list(it.tags), split=it.split) for it in items}
        t0 = time.perf_counter()
        res = pl.ingest_shard(str(store.root), list(by_id), by_id)
        if res["problems"]:
            raise ing.IngestError(res["problems"])
        recs = [ImageRecord(**(r | {"tags": tuple(r["tags"])})) for r in res["records"]]
        store.write_corpus(recs, classes)
        say(f"ingested {len(recs)} images from {source} in {time.perf_counter() - t0:.1f}s")
    records = [r for r in store.manifest() if r.has_mask]
    if not records:
        raise ValueError(f"{source}: no image has a ground-truth mask; the training bench trains on the masks "
                         "(give --data a folder with masks/)")
    fcfg = FeatureConfig().model_dump()
    key = pl.feature_key(fcfg)
    t0 = time.perf_counter()
    computed = 0
    for i, rec in enumerate(records):
        computed += pl.compute_features(store, rec, fcfg, key)
        if computed and (i + 1) % 16 == 0:
            say(f"features {i + 1}/{len(records)} ({time.perf_counter() - t0:.0f}s)")
    say(f"features of {len(records)} images ready ({computed} computed, {len(records) - computed} cached)")
    return records, key


# ============================================================================ 2. timed training steps
def measure_training(model, ds, cfg, *, steps: int, warmup: int = 2,
                     loss_fn: Callable | None = None) -> dict[str, Any]:
    """Run ``steps`` optimiser steps of :func:`tasks.training.fit`'s loop and time each one.

    Batches come from :func:`tasks.training._loader` as in ``fit`` (one DataLoader streaming
    all epochs when ``tasks.training`` has ``EpochBatchSampler``, else one per epoch) until
    ``steps`` batches were trained on. The clock runs continuously, so a DataLoader's
    start-up and shut-down at epoch boundaries count as waiting.

    Parameters
    ----------
    model : nn.Module
    ds : tasks.training.StoreDataset
    cfg : tasks.training.TrainConfig
        ``batch_size``, ``num_workers``, ``lr``, ``weight_decay``, ``seed``, ``device`` are used.
    steps : int
        Optimiser steps, > ``warmup``.
    warmup : int
        First steps left out of the steady-state figures (allocator, caches, first loader fill).
    loss_fn : callable or None
        Default: :func:`tasks.training.segmentation_loss`.

    Returns
    -------
    dict
        ``images_per_second``, ``compute_images_per_second``, ``data_wait_share``,
        ``step_seconds`` (median of the steady steps), ``steps``, ``warmup``, ``epochs``,
        ``wait_seconds`` and ``busy_seconds`` (per step, all steps), ``worker_memory``
        (per loader worker at the last step: VmHWM and PSS in MB), ``main_pss_mb``.
    """
    import numpy as np
    import torch

    from tasks import training as tr

    if steps <= warmup:
        raise ValueError(f"steps ({steps}) must exceed warmup ({warmup}); pass a larger --steps")
    loss_fn = loss_fn or tr.segmentation_loss()
    tr.seed_everything(cfg.seed)
    device = tr.pick_device(cfg.device)
    fmt = torch.channels_last if device.type == "cuda" else torch.contiguous_format
    model = model.to(device).to(memory_format=fmt)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=steps + 1, pct_start=0.15)
    amp = device.type == "cuda"
    waits: list[float] = []
    busys: list[float] = []
    sizes: list[int] = []
    workers: list[dict] = []
    main_pss = None
    per_epoch = max(1, len(ds) // cfg.batch_size)
    epochs = -(-steps // per_epoch)
    cfg = dataclasses.replace(cfg, epochs=epochs)
    # fit's loader: one DataLoader streaming every epoch (EpochBatchSampler), or, in the older
    # fit, a DataLoader per epoch
    stream = hasattr(tr, "EpochBatchSampler")
    model.train()
    t_ready = time.perf_counter()
    it = iter(tr._loader(ds, cfg, device)) if stream else None
    for epoch in range(epochs):
        ds.epoch = epoch
        if not stream:
            it = iter(tr._loader(ds, cfg, device))
        for _ in range(per_epoch):
            x, y = next(it)
            t_got = time.perf_counter()
            # float() synchronises CUDA, as fit's loss bookkeeping does
            float(tr.train_step(model, opt, sched, loss_fn, x, y, device=device, fmt=fmt, amp=amp))
            t_done = time.perf_counter()
            waits.append(t_got - t_ready)
            busys.append(t_done - t_got)
            sizes.append(len(x))
            t_ready = t_done
            if len(busys) == steps:
                for w in getattr(it, "_workers", []):
                    workers.append({"pid": w.pid, "vm_hwm_mb": _mb(_status_kb(w.pid, "VmHWM")),
                                    "pss_mb": _mb(_pss_kb(w.pid))})
                main_pss = _mb(_pss_kb("self"))
                break
    del it  # stops the loader's workers
    if amp:
        torch.cuda.synchronize()
    w, b, n = np.array(waits[warmup:]), np.array(busys[warmup:]), np.array(sizes[warmup:])
    wall = float(w.sum() + b.sum())
    return {"images_per_second": float(n.sum() / wall), "compute_images_per_second": float(n.sum() / b.sum()),
            "data_wait_share": float(w.sum() / wall), "step_seconds": float(np.median(w + b)),
            "steps": steps, "warmup": warmup, "epochs": epochs, "device": device.type, "loader": "stream" if stream else "per-epoch",
            "wait_seconds": [round(v, 4) for v in waits], "busy_seconds": [round(v, 4) for v in busys],
            "worker_memory": workers, "main_pss_mb": main_pss}


# ============================================================================ 3. the bench
def _build(name: str, num_classes: int, options: dict, size: int):
    import models

    opts = dict(options)
    if name == "global_local":
        opts.setdefault("patch_size", size)  # one patch per crop, as in patch training
    return models.build_model(name, num_classes, in_channels=4, **opts), opts


def run_bench(model: str, out: str | os.PathLike | None = None, *, size: int = 256, batch: int = 8,
              steps: int = 24, warmup: int = 3, workers: int = 1, threads: int | None = 1,
              options: dict | None = None, run_dir: str | os.PathLike = "runs/bench-train",
              device: str = "auto", data: str | os.PathLike = SAMPLE, seed: int = 0, lr: float = 2e-3,
              amp512: bool = True, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure training throughput of registry network ``model``; see the module docstring.

    Returns the result dict (also written to ``out`` as JSON when given).
    """
    import torch

    from flows.wsss import LabelLoader
    from tasks import training as tr
    from tasks.store import Store

    if size < 32 or batch < 1 or workers < 0:
        raise ValueError(f"need --size >= 32, --batch >= 1, --workers >= 0; got {size}, {batch}, {workers}")
    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    options = dict(options or {})
    say = progress or (lambda s: print(f"  [bench train] {s}", file=sys.stderr, flush=True))
    if threads is not None:
        torch.set_num_threads(threads)
    records, key = prepare_corpus(run_dir, data, progress=say)
    store = Store(run_dir)
    classes = store.classes()
    if len(records) < batch:
        raise ValueError(f"{len(records)} images with masks but --batch {batch}: pass a smaller --batch")
    net, built_options = _build(model, classes.n, options, size)
    n_params = sum(p.numel() for p in net.parameters())
    loader = LabelLoader(str(store.root), records, key, None)

    def one(crop: int, n_steps: int) -> dict:
        ds = tr.StoreDataset(len(records), loader, tr.Augment(crop=crop), seed=seed, with_edge=True)
        cfg = tr.TrainConfig(batch_size=batch, crop=crop, num_workers=workers, seed=seed, device=device, lr=lr)
        return measure_training(net, ds, cfg, steps=n_steps, warmup=warmup)

    rss_before = _status_kb("self", "VmRSS")
    reset = _reset_peak_rss()
    say(f"training {model} {built_options} ({n_params / 1e6:.2f}M parameters) for {steps} steps "
        f"of {batch} x {size}x{size}, {workers} loader worker(s), {torch.get_num_threads()} torch thread(s)")
    t0 = time.perf_counter()
    m = one(size, steps)
    main_hwm = _status_kb("self", "VmHWM")
    result: dict[str, Any] = {
        "model": model, "options": built_options, "parameters": n_params, "device": m["device"],
        "torch_threads": torch.get_num_threads(), "loader_workers": workers, "batch": batch, "size": size,
        "images": len(records), "steps": steps, "warmup_steps": warmup, "epochs_touched": m["epochs"],
        "loader": m["loader"], "images_per_second": m["images_per_second"], "compute_images_per_second": m["compute_images_per_second"],
        "data_wait_share": m["data_wait_share"], "median_step_seconds": m["step_seconds"],
        "peak_rss_mb": {
            "main": _mb(main_hwm), "main_reset_before_training": reset, "main_before_training": _mb(rss_before),
            "workers": [w["vm_hwm_mb"] for w in m["worker_memory"]],
            "sum": _mb((main_hwm or 0) + sum(int((w["vm_hwm_mb"] or 0) * 1024) for w in m["worker_memory"])),
            "pss_total_at_end": (round((m["main_pss_mb"] or 0) + sum(w["pss_mb"] or 0 for w in m["worker_memory"]), 1)
                                 if m["main_pss_mb"] is not None else None),
        },
        "wait_seconds": m["wait_seconds"], "busy_seconds": m["busy_seconds"],
        "wall_seconds": time.perf_counter() - t0,
        "torch": torch.__version__, "cpu_count": os.cpu_count(),
    }
    if m["device"] == "cuda" and amp512:
        say("CUDA: images/s at 512x512 with bf16 autocast")
        m512 = one(512, steps)
        result["cuda_amp_512"] = {k: m512[k] for k in ("images_per_second", "compute_images_per_second",
                                                         "data_wait_share", "step_seconds")}
        result["cuda_amp_512"]["max_memory_allocated_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    if out is not None:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
    return result


def format_summary(r: dict) -> str:
    """The one-screen summary printed by the CLI."""
    mem = r["peak_rss_mb"]
    lines = [
        f"wsseg bench train: {r['model']} {json.dumps(r['options'])}  ({r['parameters'] / 1e6:.2f}M parameters)",
        f"  device {r['device']}, {r['torch_threads']} torch thread(s), {r['loader_workers']} loader worker(s), "
        f"{r['cpu_count']} CPUs, torch {r['torch']}",
        f"  {r['steps']} steps of {r['batch']} x {r['size']}x{r['size']} over {r['epochs_touched']} epoch(s) of "
        f"{r['images']} images; first {r['warmup_steps']} steps not counted",
        f"  images/s         {r['images_per_second']:8.2f}   (wall, loader waits included)",
        f"  compute images/s {r['compute_images_per_second']:8.2f}   (forward + backward + step only)",
        f"  data wait share  {r['data_wait_share']:8.3f}   (target <= 0.10)",
        f"  median step      {r['median_step_seconds']:8.3f} s",
        f"  peak RSS         main {mem['main']} MB (before training {mem['main_before_training']} MB), workers {mem['workers']} MB, sum {mem['sum']} MB "
        f"(shared pages counted per process); PSS total at end {mem['pss_total_at_end']} MB",
    ]
    if "cuda_amp_512" in r:
        c = r["cuda_amp_512"]
        lines.append(f"  CUDA 512x512 bf16 images/s {c['images_per_second']:.1f} (data wait {c['data_wait_share']:.3f}), "
                     f"max allocated {c['max_memory_allocated_mb']} MB")
    return "\n".join(lines)


# ============================================================================ CLI
def add_bench_train_parser(bench_subparsers) -> argparse.ArgumentParser:
    """Register ``wsseg bench train``."""
    p = bench_subparsers.add_parser(
        "train", help="training throughput (images/s, data-wait share, peak RSS) of a registry network",
        description="Ingest the bundled sample (or --data) into --run-dir, then train a registry network on "
                    "--size x --size crops for --steps steps with batches read from the Zarr store through the "
                    "real training path (LabelLoader -> StoreDataset -> DataLoader workers, ground-truth masks as "
                    "labels) and report steady-state images/s, the share of time waiting for the loader, peak "
                    "RSS of the process and its loader workers, device, threads and parameter count. "
                    "Prints a summary and writes --out (JSON).")
    p.add_argument("--model", required=True, help="registry name: small, fusion, global_local")
    p.add_argument("--out", required=True, type=Path, help="result JSON file")
    p.add_argument("--size", type=int, default=256, help="square crop side in pixels (default 256)")
    p.add_argument("--batch", type=int, default=8, help="images per step (default 8)")
    p.add_argument("--steps", type=int, default=24, help="optimiser steps to run (default 24)")
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the figures (default 3)")
    p.add_argument("--workers", type=int, default=1, help="DataLoader worker processes (default 1; 0 = in process)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of the training process (default 1; 0 keeps torch's default)")
    p.add_argument("--options", default="{}", help="builder options as JSON, e.g. '{\"width\": 0.25}' for fusion")
    p.add_argument("--data", type=Path, default=SAMPLE,
                   help="dataset folder with masks (default: the bundled MSRC-21 sample)")
    p.add_argument("--run-dir", default="runs/bench-train",
                   help="run directory holding the corpus store and feature cache (default: runs/bench-train)")
    p.add_argument("--device", default="auto", help="auto (CUDA when present, else CPU), cpu or cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verbose", action="store_true", help="tracebacks instead of one-line errors")
    p.set_defaults(func=main)
    return p


def main(args) -> int:
    try:
        options = json.loads(args.options)
    except json.JSONDecodeError as e:
        raise ValueError(f"--options must be a JSON object, e.g. '{{\"width\": 0.25}}'; got {args.options!r} ({e})")
    if not isinstance(options, dict):
        raise ValueError(f"--options must be a JSON object, e.g. '{{\"width\": 0.25}}'; got {args.options!r}")
    r = run_bench(args.model, args.out, size=args.size, batch=args.batch, steps=args.steps, warmup=args.warmup,
                  workers=args.workers, threads=args.threads or None, options=options, run_dir=args.run_dir,
                  device=args.device, data=args.data, seed=args.seed)
    print(format_summary(r))
    print(Path(args.out).resolve())
    return 0
