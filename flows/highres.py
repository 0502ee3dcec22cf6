"""Ultra-high-resolution segmentation (METHOD.md C): the ``segment`` and ``bench-highres`` flows.

* :func:`segment` labels image files with a trained model (:func:`tasks.segment.segment`) and
  writes ``<out>/segment.json``; its Prefect and MLflow state live in the ``--out`` folder.
* :func:`bench_highres` compares, on the same images and step budget, (a) global-local, (b) the
  same network on patches without the global inputs and (c) the whole image downsampled to the
  patch size (:mod:`tasks.highres`); it measures the peak memory of ``wsseg segment`` on an
  evaluation image at its original size and at twice its side, and the CPU throughput; writes
  the JSON, an overlay PNG and the global-local checkpoint. Its Prefect and MLflow state live
  in the folder of ``--out``.

Import this module only after :func:`flows.runtime.prepare` has set the environment.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from prefect import flow

from tasks import highres as hr
from tasks import segment as sg
from tasks.memory import rss_mb
from tasks.store import files
from tasks.tracking import Tracker

__all__ = ["segment", "bench_highres"]


@flow(name="segment")
def segment(inputs: list[str], model: str, out: str, patch_size: int | None = None, overlap: int | None = None,
            batch: int = 4, device: str = "cpu", fov: str = "auto", gate: bool | None = None,
            threads: int | None = None) -> dict:
    """Label ``inputs`` with ``model`` (a checkpoint, run directory or bench output) into ``out``;
    returns the report written to ``<out>/segment.json``."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    params = dict(inputs=inputs, model=model, out=out, patch_size=patch_size, overlap=overlap, batch=batch,
                  device=device, fov=fov, gate=gate, threads=torch.get_num_threads())
    tracker = Tracker(Path(out))
    with tracker.run("segment"):
        tracker.log_params(params)
        stats: list[dict] = []
        rss_before = rss_mb()
        sg.segment(inputs, model, out, patch_size=patch_size, overlap=overlap, batch=batch, device=device, fov=fov,
                   gate=gate, stats=stats)
        report = sg.report(stats, rss_before)
        path = files.write_json(Path(out) / "segment.json", report)
        tracker.log_metrics({"images": len(stats), "seconds": sum(s["seconds"] for s in stats),
                             "peak_rss_mb": report["peak_rss_mb"]})
        tracker.log_artifact(path)
    return report


@flow(name="bench-highres")
def bench_highres(data: str, split: str, out: str, train_n: int = 12, eval_n: int = 3, patch_size: int = 256,
                  scale: float = 0.5, steps: int = 400, batch: int = 4, lr: float = 2e-3, width: int = 16,
                  blocks: tuple[int, ...] = (1, 1, 1), overlap: int = 32, balanced: float = 0.0,
                  class_weights: tuple[float, ...] | None = (1.0, 2.0), seed: int = 0, threads: int | None = 2,
                  device: str = "cpu") -> dict:
    """Global-local vs. patches without context vs. downsampled whole image; see :mod:`tasks.highres`.
    Returns the dict written to ``out`` (JSON)."""
    import torch

    t_start = time.perf_counter()
    if threads:
        torch.set_num_threads(threads)
    d = hr.load_bench_data(data, split, train_n=train_n, eval_n=eval_n, scale=scale)
    print(f"highres: {len(d.train_ids)} training / {len(d.eval_ids)} evaluation images at {d.images[0].shape[1]}x"
          f"{d.images[0].shape[0]} (scale {scale}), patch {patch_size}, {steps} steps x {batch}", file=sys.stderr, flush=True)
    options = dict(patch_size=patch_size, width=width, blocks=tuple(blocks))
    results: dict = {"train_ids": d.train_ids, "eval_ids": d.eval_ids, "scale": scale, "patch_size": patch_size,
                     "steps": steps, "batch": batch, "width": width, "blocks": list(blocks), "overlap": overlap,
                     "threads": threads, "seed": seed}
    train = dict(options=options, steps=steps, batch=batch, lr=lr, seed=seed, device=device, balanced=balanced,
                 class_weights=class_weights)
    for name, use_global, mode, downsampled in hr.VARIANTS:
        model, figures = hr.train_variant(name, d, use_global=use_global, downsampled=downsampled, **train)
        preds, scores = hr.evaluate_variant(name, model, d, mode=mode, overlap=overlap, batch=batch, device=device)
        results.update(figures | scores)
        if name == "global_local":
            ckpt = hr.save_bench_model(out, model, options=options, scale=scale, overlap=overlap)
            overlay = hr.write_overlay(out, data, d, preds[0])
    results.update(hr.measure_segment_memory(ckpt, files.dataset_image_path(data, d.eval_ids[0]), overlap=overlap,
                                             batch=batch, threads=threads or torch.get_num_threads()))
    results.update({"overlay_png": overlay.name, "checkpoint": ckpt.name})
    print(f"  memory of `wsseg segment`: peak {results['peak_mem_mb_1x']} MB / {results['peak_mem_mb_2x']} MB "
          f"(2x side), ratio {results['peak_mem_ratio_2x']}; {results['mpix_per_s']} Mpx/s", file=sys.stderr,
          flush=True)
    results["wall_seconds"] = round(time.perf_counter() - t_start, 1)
    path = files.write_json(out, results)
    tracker = Tracker(Path(out).parent)
    with tracker.run("bench-highres"):
        tracker.log_params({k: results[k] for k in ("scale", "patch_size", "steps", "batch", "width", "blocks",
                                                    "overlap", "threads", "seed")} | {"data": str(data), "split": split})
        tracker.log_metrics({k: v for k, v in results.items() if isinstance(v, (int, float)) and k not in
                             ("scale", "patch_size", "steps", "batch", "width", "overlap", "threads", "seed")})
        for artifact in (path, overlay):
            tracker.log_artifact(artifact)
    print(f"highres: wrote {path} ({results['wall_seconds']} s)", file=sys.stderr, flush=True)
    return results
