"""``wsseg bench train``'s work: training throughput of a registry network on real store batches.

1. :func:`prepare_corpus`: ingest the bundled sample (or ``--data``) into the run directory with the
   ingest flow's per-image shard function (:func:`tasks.wsss.pipeline.ingest_shard`) and compute the
   per-image features (:func:`tasks.wsss.feature_cache.compute_features`; cached by content, so a second bench
   on the same run directory starts at once);
2. :func:`measure_training`: train the network for ``steps`` optimiser steps on ``size`` x ``size``
   crops, with the ground-truth masks as labels read through the same path as real training
   (:class:`tasks.wsss.segmenter.LabelLoader` -> :class:`tasks.common.training.StoreDataset`
   (:class:`tasks.common.training.Augment`) -> DataLoader workers), in the one training loop
   :func:`tasks.common.training.fit` (AdamW + one-cycle, bf16 autocast and channels_last on CUDA only),
   timing every step through its ``on_step`` hook;
3. :func:`run_bench`: the figures over the steady-state steps (the first ``warmup`` are skipped):
   ``images_per_second`` (images / wall time of those steps, loader waits included),
   ``compute_images_per_second`` (images / time in forward+backward+step), ``data_wait_share``
   (share of the wall time spent waiting for the loader), ``peak_rss_mb`` (VmHWM of the main
   process during training and of each loader worker; workers are separate processes), device,
   torch threads and the parameter count; on CUDA also images/s at 512 x 512 under bf16 autocast.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

from wsseg.tasks.runtime.memory import pss_kb, reset_peak_rss, status_kb

__all__ = ["prepare_corpus", "measure_training", "run_bench", "format_summary", "SAMPLE"]

SAMPLE = Path(__file__).resolve().parents[2] / "flows" / "sample" / "msrc21"  # tasks/bench/train.py -> the project


# ============================================================================ process memory
def _mb(kb: int | None) -> float | None:
    return None if kb is None else round(kb / 1024, 1)


# ============================================================================ 1. corpus + features
def prepare_corpus(run_dir: str | os.PathLike, source: str | os.PathLike = SAMPLE, *,
                   progress: Callable[[str], None] | None = None) -> tuple[list, str]:
    """Ingest ``source`` into the store of ``run_dir`` and compute the default per-image features.

    Both steps are the ones the flows run (per-image functions of :mod:`tasks.wsss.pipeline`), run
    here in-process; an existing corpus and cached features are reused.

    Returns
    -------
    records : list of ImageRecord
        Every image of the corpus (all splits) that has a mask.
    feature_key : str
        Key of the feature cache (:func:`tasks.wsss.feature_cache.feature_key` of the default
        :class:`tasks.config.FeatureConfig`), what :class:`flows.wsss.LabelLoader` reads edges by.

    Raises
    ------
    ValueError
        When the source has no image with a ground-truth mask (the bench trains on the masks).
    """
    from wsseg.tasks.config import FeatureConfig
    from wsseg.tasks.corpus import ingest as ing
    from wsseg.tasks.store import ImageRecord, Store
    from wsseg.tasks.wsss import pipeline as pl
    from wsseg.tasks.wsss.feature_cache import compute_features, feature_key

    say = progress or (lambda s: None)
    store = Store(run_dir)
    if not store.has_corpus():
        items, classes = ing.read_source(source)
        by_id = {it.image_id: dict(image_path=str(it.image_path), mask_path=str(it.mask_path) if it.mask_path else None,
                                   tags=list(it.tags), split=it.split) for it in items}
        t0 = time.perf_counter()
        store.drop_staged()  # what a stopped earlier attempt staged
        res = pl.ingest_shard(str(store.root), list(by_id), by_id)
        if res["problems"]:
            raise ing.IngestError(res["problems"])
        recs = [ImageRecord(**(r | {"tags": tuple(r["tags"])})) for r in res["records"]]
        store.commit_staged(res["staged"])  # images a stopped earlier attempt left: replaced
        store.write_corpus(recs, classes)
        say(f"ingested {len(recs)} images from {source} in {time.perf_counter() - t0:.1f}s")
    records = [r for r in store.manifest() if r.has_mask]
    if not records:
        raise ValueError(f"{source}: no image has a ground-truth mask; the training bench trains on the masks "
                         "(give --data a folder with masks/)")
    fcfg = FeatureConfig()
    key = feature_key(fcfg)
    t0 = time.perf_counter()
    computed = 0
    for i, rec in enumerate(records):
        computed += compute_features(store, rec, fcfg, key)
        if computed and (i + 1) % 16 == 0:
            say(f"features {i + 1}/{len(records)} ({time.perf_counter() - t0:.0f}s)")
    say(f"features of {len(records)} images ready ({computed} computed, {len(records) - computed} cached)")
    return records, key


# ============================================================================ 2. timed training steps
def measure_training(model, ds, cfg, *, steps: int, warmup: int = 2,
                     loss_fn: Callable | None = None) -> dict[str, Any]:
    """Run ``steps`` optimiser steps of :func:`tasks.common.training.fit` and time each one.

    ``fit`` streams the batches (one DataLoader for all epochs) and stops after ``steps``
    steps (``max_steps``; the one-cycle schedule spans them); its ``on_step`` hook records each
    step's wait for the loader and its busy time (forward, backward, step, loss read back, which
    synchronises CUDA), and at the last step the loader workers' memory.

    Parameters
    ----------
    model : nn.Module
    ds : tasks.common.training.StoreDataset
    cfg : tasks.common.training.TrainConfig
        ``batch_size``, ``num_workers``, ``lr``, ``weight_decay``, ``seed``, ``device`` are used.
    steps : int
        Optimiser steps, > ``warmup``.
    warmup : int
        First steps left out of the steady-state figures (allocator, caches, first loader fill).
    loss_fn : callable or None
        Default: :func:`tasks.common.training.segmentation_loss`.

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

    from wsseg.tasks.common import training as tr

    if steps <= warmup:
        raise ValueError(f"steps ({steps}) must exceed warmup ({warmup}); pass a larger --steps")
    loss_fn = loss_fn or tr.segmentation_loss()
    per_epoch = max(1, len(ds) // cfg.batch_size)
    epochs = -(-steps // per_epoch)
    cfg = dataclasses.replace(cfg, epochs=epochs, max_steps=steps, patience=10 ** 9, max_seconds=None,
                              schedule="one_cycle")
    waits: list[float] = []
    busys: list[float] = []
    sizes: list[int] = []
    workers: list[dict] = []
    main_pss: list = [None]

    def on_step(s: dict) -> None:
        waits.append(s["wait"])
        busys.append(s["busy"])
        sizes.append(s["images"])
        if s["step"] == steps:
            for w in getattr(s["batches"], "_workers", []):
                workers.append({"pid": w.pid, "vm_hwm_mb": _mb(status_kb(w.pid, "VmHWM")),
                                "pss_mb": _mb(pss_kb(w.pid))})
            main_pss[0] = _mb(pss_kb("self"))

    res = tr.fit(model, ds, loss_fn, cfg, on_step=on_step)
    if res.device == "cuda":
        torch.cuda.synchronize()
    w, b, n = np.array(waits[warmup:]), np.array(busys[warmup:]), np.array(sizes[warmup:])
    wall = float(w.sum() + b.sum())
    return {"images_per_second": float(n.sum() / wall), "compute_images_per_second": float(n.sum() / b.sum()),
            "data_wait_share": float(w.sum() / wall), "step_seconds": float(np.median(w + b)),
            "steps": steps, "warmup": warmup, "epochs": epochs, "device": res.device, "loader": "stream",
            "wait_seconds": [round(v, 4) for v in waits], "busy_seconds": [round(v, 4) for v in busys],
            "worker_memory": workers, "main_pss_mb": main_pss[0]}


# ============================================================================ 3. the bench
def _build(name: str, num_classes: int, options: dict, size: int):
    from wsseg.tasks.store import build_network

    opts = dict(options)
    if name == "global_local":
        opts.setdefault("patch_size", size)  # one patch per crop, as in patch training
    return build_network(name, num_classes, in_channels=4, **opts), opts


def run_bench(model: str, out: str | os.PathLike | None = None, *, size: int = 256, batch: int = 8,
              steps: int = 24, warmup: int = 3, workers: int = 1, threads: int | None = 1,
              options: dict | None = None, run_dir: str | os.PathLike = "runs/bench-train",
              device: str = "auto", data: str | os.PathLike = SAMPLE, seed: int = 0, lr: float = 2e-3,
              amp512: bool = True, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure training throughput of registry network ``model``; see the module docstring.

    Returns the result dict (also written to ``out`` as JSON when given).
    """
    import torch

    from wsseg.tasks.common import training as tr
    from wsseg.tasks.store import Store
    from wsseg.tasks.wsss.segmenter import LabelLoader

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

    rss_before = status_kb("self", "VmRSS")
    reset = reset_peak_rss()
    say(f"training {model} {built_options} ({n_params / 1e6:.2f}M parameters) for {steps} steps "
        f"of {batch} x {size}x{size}, {workers} loader worker(s), {torch.get_num_threads()} torch thread(s)")
    t0 = time.perf_counter()
    m = one(size, steps)
    main_hwm = status_kb("self", "VmHWM")
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
        from wsseg.tasks.store import files
        files.write_json(out, result, indent=1)
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
