"""Ultra-high-resolution segmentation (METHOD.md C): the ``segment`` and ``bench-highres`` flows.

* :func:`segment` labels image files with a trained model (:func:`tasks.highres.segment.segment`) and
  writes ``<out>/segment.json``; its Prefect and MLflow state live in the ``--out`` folder.
* :func:`bench_highres` compares, on the same images and step budget, (a) global-local, (b) the
  same network on patches without the global inputs and (c) the whole image downsampled to the
  patch size, and on request METHOD.md C as written (``gl_method_c``; :data:`tasks.highres.train.VARIANTS`);
  two-class corpora (HRF) are scored by vessel IoU / F1, others by
  per-class IoU and mIoU; it measures the peak memory of ``wsseg segment`` on an evaluation
  image at its original size and at twice its side, and the CPU throughput; writes the JSON,
  an overlay PNG and the global-local checkpoint. Its Prefect and MLflow state live in the
  folder of ``--out``.

Import this module only after :func:`flows.runtime.prepare` has set the environment.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from prefect import flow

from wsseg.flows.naming import FlowRunName
from wsseg.models.efficientnet_lite import weights_digest
from wsseg.tasks.highres import segment as sg
from wsseg.tasks.highres import train as hr
from wsseg.tasks.runtime.memory import rss_mb
from wsseg.tasks.runtime.tracking import Tracker
from wsseg.tasks.store import files

__all__ = ["segment", "bench_highres", "check_bench_inputs"]


@flow(name="segment", flow_run_name=FlowRunName("segment"))
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


def check_bench_inputs(data: str, split: str, *, train_n: int | None, eval_n: int | None, eval_split: str | None,
                       variants, folds: int) -> None:
    """The benchmark's variants and every fold's ids, before anything trains (``wsseg bench highres`` calls it
    before Prefect starts, so that a mistake is its one line): ValueError naming the problem."""
    unknown = [v for v in variants if v not in hr.VARIANTS]
    if unknown or not variants:
        raise ValueError(f"unknown variants {unknown}; choose from {', '.join(hr.VARIANTS)}")
    if folds < 1:
        raise ValueError(f"folds must be >= 1, got {folds}")
    for f in range(folds):  # a fold too many fails now, not after hours of training
        hr.load_split(data, split, train_n=train_n, eval_n=eval_n, eval_split=eval_split, fold=f)


@flow(name="bench-highres", flow_run_name=FlowRunName("bench-highres"))
def bench_highres(data: str, split: str, out: str, train_n: int | None = 12, eval_n: int | None = 3,
                  patch_size: int = 256, scale: float = 0.5, steps: int = 400, batch: int = 4, lr: float = 2e-3,
                  width: int = 16, blocks: tuple[int, ...] = (1, 1, 1), overlap: int = 32, balanced: float = 0.0,
                  class_weights: tuple[float, ...] | None | str = "auto", seed: int = 0, threads: int | None = 2,
                  device: str = "cpu", eval_split: str | None = None,
                  variants: tuple[str, ...] = hr.DEFAULT_VARIANTS, images_per_batch: int = 2,
                  memory_probe: bool = True, backbone: str = "lite0", folds: int = 1) -> dict:
    """Global-local vs. patches without context vs. downsampled whole image (and any other of
    ``tasks.highres.train.VARIANTS``); see :mod:`tasks.highres.train`. ``class_weights="auto"``: (1, 2) for a
    two-class (vessel) corpus, none otherwise. ``folds`` > 1 cross-validates: every network is trained and
    scored once per fold (:func:`tasks.highres.train.load_split`'s ``fold``, each fold's ``eval_n`` images
    unseen), its figures pooled over every fold's evaluation images (each fold's in ``folds``); the
    checkpoint, overlay and memory probe are fold 0's, the single split's. Returns the dict written to
    ``out`` (JSON)."""
    import numpy as np
    import torch

    t_start = time.perf_counter()
    check_bench_inputs(data, split, train_n=train_n, eval_n=eval_n, eval_split=eval_split, variants=variants,
                       folds=folds)
    if threads:
        torch.set_num_threads(threads)
    d = hr.load_bench_data(data, split, train_n=train_n, eval_n=eval_n, scale=scale, eval_split=eval_split)
    if class_weights == "auto":
        class_weights = (1.0, 2.0) if d.num_classes == 2 else None
    print(f"highres: {len(d.train_ids)} training / {len(d.eval_ids)} evaluation images at {d.images[0].shape[1]}x"
          f"{d.images[0].shape[0]} (scale {scale}), {d.num_classes} classes, patch {patch_size}, {steps} steps x "
          f"{batch}" + (f"; {folds} folds" if folds > 1 else ""), file=sys.stderr, flush=True)
    options = dict(patch_size=patch_size, width=width, blocks=tuple(blocks), backbone=backbone)
    results: dict = {"train_ids": d.train_ids, "eval_ids": d.eval_ids, "scale": scale, "patch_size": patch_size,
                     "steps": steps, "batch": batch, "width": width, "blocks": list(blocks), "overlap": overlap,
                     "threads": threads, "seed": seed, "backbone": backbone,
                     "pretrained": {} if backbone == "hrnet" else {backbone: weights_digest(backbone)}}
    if d.num_classes > 2:
        results.update({"classes": d.classes, "eval_split": eval_split, "variants": list(variants),
                        "images_per_batch": images_per_batch, "lr": lr,
                        "budget": {"train_images": len(d.train_ids), "eval_images": len(d.eval_ids),
                                   "steps": steps, "patches_per_step": batch, "images_per_step": images_per_batch,
                                   "seed": seed, "note": "the same for every variant (downsampled: whole images "
                                                         "resized to the patch size instead of patches)"}})
    train = dict(options=options, steps=steps, batch=batch, lr=lr, seed=seed, device=device, balanced=balanced,
                 class_weights=class_weights, images_per_batch=images_per_batch)
    ckpt = overlay = None
    probe_image = files.dataset_image_path(data, d.eval_ids[0])
    pooled: dict[str, np.ndarray] = {}
    for f in range(folds):
        if f:
            d = hr.load_bench_data(data, split, train_n=train_n, eval_n=eval_n, scale=scale, fold=f)
        if folds > 1:
            print(f"highres: fold {f + 1}/{folds}: evaluation images {', '.join(d.eval_ids)}", file=sys.stderr,
                  flush=True)
        figures_of_fold: dict = {}
        for name in variants:
            variant = hr.VARIANTS[name]
            model, opts, figures = hr.train_variant(name, d, **train)
            first, scores = hr.evaluate_variant(name, model, d, mode=variant.mode, overlap=overlap, batch=batch,
                                                device=device)
            figures_of_fold.update(figures | scores)
            pooled[name] = pooled.get(name, 0) + np.asarray(scores[f"{name}_confusion"], np.int64)
            if ckpt is None and variant.use_global:
                ckpt = hr.save_bench_model(out, model, options=opts, scale=scale, overlap=overlap, classes=d.classes)
                overlay = hr.write_overlay(out, data, d, first)
            del model, first
            so_far = {"variants_done": variants[:variants.index(name) + 1]} | ({"folds_done": f} if folds > 1 else {})
            files.write_json(out, {**results, **(figures_of_fold if folds == 1 else {}), **so_far})  # so far
        if folds == 1:
            results.update(figures_of_fold)
        else:
            results.setdefault("folds", []).append({"fold": f, "train_ids": d.train_ids, "eval_ids": d.eval_ids,
                                                    **figures_of_fold})
    if folds > 1:
        results.update(_pooled_over_folds(results["folds"], pooled, variants, d.classes))
    if memory_probe and ckpt is not None:
        results.update(hr.measure_segment_memory(ckpt, probe_image, overlap=overlap, batch=batch,
                                                 threads=threads or torch.get_num_threads()))
        print(f"  memory of `wsseg segment`: peak {results['peak_mem_mb_1x']} MB / {results['peak_mem_mb_2x']} MB "
              f"(2x side), ratio {results['peak_mem_ratio_2x']}; {results['mpix_per_s']} Mpx/s", file=sys.stderr,
              flush=True)
    if ckpt is not None:
        results.update({"overlay_png": overlay.name, "checkpoint": ckpt.name})
    results["wall_seconds"] = round(time.perf_counter() - t_start, 1)
    path = files.write_json(out, results)
    tracker = Tracker(Path(out).parent)
    with tracker.run("bench-highres"):
        tracker.log_params({k: results[k] for k in ("scale", "patch_size", "steps", "batch", "width", "blocks",
                                                    "overlap", "threads", "seed", "backbone", "pretrained")}
                          | {"data": str(data), "split": split, "folds": folds})
        tracker.log_metrics({k: v for k, v in results.items() if isinstance(v, (int, float)) and k not in
                             ("scale", "patch_size", "steps", "batch", "width", "overlap", "threads", "seed")})
        for artifact in (path, overlay):
            if artifact is not None:
                tracker.log_artifact(artifact)
    print(f"highres: wrote {path} ({results['wall_seconds']} s)", file=sys.stderr, flush=True)
    return results


def _pooled_over_folds(per_fold: list[dict], pooled: dict, variants, classes) -> dict:
    """Each variant's figures from its confusion summed over the folds' evaluation images, the per-fold
    figure beside it (``<name>_fold_iou`` or ``<name>_fold_miou``) and its seconds summed; printed too."""
    key = "iou" if len(classes) == 2 else "miou"
    out: dict = {"cross_validation": {"folds": len(per_fold), "eval_images": sum(len(f["eval_ids"]) for f in per_fold),
                                      "note": "each variant's figures pooled over every fold's evaluation images "
                                              "(its confusion summed); per fold in folds; checkpoint, overlay and "
                                              "memory probe from fold 0"}}
    for name in variants:
        out.update(hr.scores_from_confusion(name, pooled[name], classes))
        out[f"{name}_confusion"] = pooled[name].tolist()
        out[f"{name}_fold_{key}"] = [fold[f"{name}_{key}"] for fold in per_fold]
        for what in ("train_seconds", "eval_seconds"):
            out[f"{name}_{what}"] = round(sum(fold[f"{name}_{what}"] for fold in per_fold), 1)
        folds_line = " ".join(f"{v:.4f}" for v in out[f"{name}_fold_{key}"])
        print(f"highres: {name}: {'vessel IoU' if key == 'iou' else 'mIoU'} {out[f'{name}_{key}']:.4f} over "
              f"{out['cross_validation']['eval_images']} images in {len(per_fold)} folds (per fold {folds_line})",
              file=sys.stderr, flush=True)
    return out
