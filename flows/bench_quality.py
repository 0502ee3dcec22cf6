"""``wsseg bench quality``: pseudo-label quality side by side with CAM and CAM + dense CRF.

One command, one Prefect flow run, one Dask cluster:

1. ingest the dataset folder into the run directory and run ``train_wsss`` on ``--split``
   (the method reads tags only; masks are read only by the evaluation steps below);
2. baselines on the same images: ``cam`` (round 0's CAM labels) and ``cam_crf`` (round 0's
   preliminary probabilities refined by :func:`tasks.crf.dense_crf` over the tagged classes
   only, in shard tasks on Dask);
3. the final round's segmentation model, evaluated on ``--eval-split``;
4. the same network trained on the ground-truth masks of ``--split`` with the final model's
   recipe (:func:`flows.wsss.final_model_config`: same start, same total epochs, same seed),
   evaluated the same way (the supervised reference); with ``--model-seeds N`` both models again
   under N - 1 further seeds (every seed's figures, the mean and range of each and of the ratio);
5. ``FILE.json``, a markdown table ``FILE.md`` and an overlay figure ``FILE.png``;
6. with ``--ablate``: one variant per switched-off part of the method, each in
   ``RUN/ablate-<name>/`` sharing the corpus, feature cache, image classifier and round 0's
   CAMs of the main run; each runs ``--ablate-rounds`` label-only rounds (no model after the
   last) and reports its pseudo-label mIoU beside the main run's at the same round;
7. with ``--compare-models``: each named network (and the configured one) trained from scratch
   on the final round's pseudo-labels and, separately, on the masks, for the same wall-time
   budget (``--compare-seconds``, turned into epochs from each network's measured speed so
   that its learning-rate schedule completes), all evaluated on ``--eval-split``.

This module must stay importable before :func:`flows.runtime.prepare` runs (the CLI imports it
to build its parser): prefect and ``flows.wsss`` are imported inside functions only.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from tasks.crf import dense_crf
from tasks.metrics import confusion_matrix, iou_from_confusion
from tasks.store import ImageRecord, Store, records_by_id

__all__ = ["crf_labels", "cam_crf_shard", "ablation_variants", "pick_overlay_records", "run_bench",
           "add_bench_quality_parser", "main", "CRF_DEFAULTS", "parse_model_spec", "budget_epochs"]

#: dense CRF parameters of the ``cam_crf`` baseline (DeepLab's usual values, tasks.crf defaults)
CRF_DEFAULTS = {"n_iter": 10, "gauss_sxy": 3, "gauss_compat": 3, "bilateral_sxy": 80, "bilateral_srgb": 13,
                "bilateral_compat": 10}

# Names of the config fields that would make the 3-way clustering's lo/hi configurable; the
# "no_3way" variant runs only when WSSSConfig has them (see ablation_variants).
CLUSTER_LO, CLUSTER_HI = "proposals.clustering_lo", "proposals.clustering_hi"


# ============================================================================ pure helpers
def crf_labels(image: np.ndarray, prob: np.ndarray, allowed: np.ndarray, *, backend: str = "auto",
               **crf_params: float) -> np.ndarray:
    """Dense-CRF label map restricted to an image's allowed (tagged) classes.

    Only the allowed channels of ``prob`` enter :func:`tasks.crf.dense_crf` (renormalised there),
    which keeps the CRF cheap with many classes and guarantees the result uses allowed classes only.

    Parameters
    ----------
    image : (H, W, 3) uint8
        RGB image, the bilateral kernel's guide.
    prob : (K, H, W) float array
        Class probabilities (e.g. the round-0 preliminary result); channels of classes that are
        not allowed are ignored.
    allowed : (K,) bool array
        The image's tags (plus the implicit background class, if any); at least one True.
    backend : {'auto', 'pydensecrf', 'approx'}, optional
        Passed to :func:`tasks.crf.dense_crf`.
    **crf_params
        Keyword options of :func:`tasks.crf.dense_crf` (default :data:`CRF_DEFAULTS`).

    Returns
    -------
    label : (H, W) uint8
        Dataset class index per pixel, always one of the allowed classes.

    Raises
    ------
    ValueError
        On mismatched shapes or when no class is allowed.

    Examples
    --------
    >>> img = np.zeros((4, 4, 3), np.uint8)
    >>> p = np.zeros((3, 4, 4), np.float32); p[2] = 1.0
    >>> crf_labels(img, p, np.array([False, True, True]), backend="approx")[0, 0]
    np.uint8(2)
    """
    image = np.asarray(image)
    prob = np.asarray(prob, dtype=np.float32)
    allowed = np.asarray(allowed, dtype=bool)
    if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
        raise ValueError(f"image must be (H, W, 3) uint8 RGB, got {image.shape} {image.dtype}.")
    if prob.ndim != 3 or prob.shape[1:] != image.shape[:2]:
        raise ValueError(f"prob must be (K, {image.shape[0]}, {image.shape[1]}), got {prob.shape}.")
    if allowed.shape != (prob.shape[0],):
        raise ValueError(f"allowed must be ({prob.shape[0]},) bool (one flag per class of prob), "
                         f"got shape {allowed.shape}.")
    idx = np.flatnonzero(allowed)
    if idx.size == 0:
        raise ValueError("allowed has no True entry: an image needs at least one tag (or a background class).")
    if idx.max() > 254:
        raise ValueError(f"class index {idx.max()} does not fit a uint8 label map (255 = ignore).")
    if idx.size == 1:
        return np.full(image.shape[:2], idx[0], np.uint8)
    params = {**CRF_DEFAULTS, **crf_params}
    q = dense_crf(image, prob[idx], backend=backend, **params)
    return idx[q.argmax(0)].astype(np.uint8)


def cam_crf_shard(run_dir: str, ids: list[str], crf: dict | None = None, round_index: int = 0,
                  name: str = "cam_crf") -> dict:
    """The CAM + CRF baseline for one shard: round ``round_index``'s preliminary probabilities
    of each image, refined by :func:`crf_labels`, stored as ``store.pseudo(round, id, name)``.
    Images already stored are skipped, so an interrupted run resumes."""
    import torch

    torch.set_num_threads(1)
    store = Store(run_dir)
    classes = store.classes()
    t0 = time.perf_counter()
    done = 0
    for rec in records_by_id(store.manifest(), ids):
        if store.pseudo(round_index, rec.image_id, name=name) is not None:
            continue
        prelim = store.prelim(round_index, rec.image_id, classes.n)
        label = crf_labels(store.image(rec.image_id), prelim, classes.tag_vector(rec.tags), **(crf or {}))
        store.write_pseudo(round_index, rec.image_id, label, name=name)
        done += 1
    return {"images": len(ids), "computed": done, "seconds": time.perf_counter() - t0}


def _field_exists(model_cls, dotted: str) -> bool:
    """Whether a dotted key names a field of a pydantic model (keys inside a dict field count)."""
    import typing

    node = model_cls
    for part in dotted.split("."):
        if node is dict or typing.get_origin(node) is dict:
            return True
        fields = getattr(node, "model_fields", None)
        if fields is None or part not in fields:
            return False
        node = fields[part].annotation
    return True


def check_overrides(overrides: list[str]) -> None:
    """Refuse ``--set`` keys that are no WSSSConfig field (pydantic would silently drop them)."""
    from flows.config import WSSSConfig

    bad = [item.split("=", 1)[0] for item in overrides if not _field_exists(WSSSConfig, item.split("=", 1)[0])]
    if bad:
        raise ValueError(f"--set {', '.join(bad)}: no such config field; see flows/config.py:WSSSConfig "
                         f"(e.g. segmentation.options.width, proposals.t1)")


IOU_FILTER = {"proposals.t1": 0.3, "proposals.p1": 0.5}  # the filter's settings when the variant turns it on


def ablation_variants(config) -> dict[str, dict]:
    """The ``--ablate`` variants of a configuration, each switching one part of the method off
    (or swapping it), as ``{name: {"overrides": {dotted key: value}, "what": text}}``; a variant
    the configuration cannot express carries ``"skip"`` (the reason) instead of running."""
    from flows.config import WSSSConfig

    p, f = config.proposals, config.features
    out: dict[str, dict] = {}
    if p.t1 > 0 or p.p1 > 0:
        out["no_iou_filter"] = {"what": "IoU filtering off (t1=0, p1=0: every proposal is positive)",
                                "overrides": {"proposals.t1": 0.0, "proposals.p1": 0.0}}
    else:  # the default since it measured better: the variant is the method's filter switched on
        out["iou_filter"] = {"what": f"IoU filtering on (t1={IOU_FILTER['proposals.t1']}, "
                                     f"p1={IOU_FILTER['proposals.p1']}) instead of off",
                             "overrides": dict(IOU_FILTER)}
    out |= {
        "fusion_" + ("threshold" if p.fusion == "topk" else "topk"): {
            "what": f"fusion {'threshold' if p.fusion == 'topk' else 'top-k'} instead of {p.fusion}",
            "overrides": {"proposals.fusion": "threshold" if p.fusion == "topk" else "topk"}},
        "no_3way": {"what": "3-way clustering off (quantile split at the median: nothing ambiguous)",
                    "overrides": {"proposals.clustering": "quantile", CLUSTER_LO: 0.5, CLUSTER_HI: 0.5 + 1e-6}},
    }
    if config.mil.iterations > 0:
        out["no_mil"] = {"what": "superpixel MIL refinement off (the preliminary result goes to step 3 as it is)",
                         "overrides": {"mil.iterations": 0}}
    if config.mil.iterations > 0 and config.mil.min_share > 0:
        out["no_mil_claim"] = {"what": "MIL targets by plain argmax (tagged classes claim no least area)",
                               "overrides": {"mil.min_share": 0.0}}
    if config.mil.iterations > 0:
        for mode, what in (("off", "MIL softmax over the tags only in training (no negatives from untagged classes)"),
                           ("first_round", "MIL negatives (softmax over every class) in round 0 only"),
                           ("all_rounds", "MIL negatives (softmax over every class) in every round")):
            if mode != config.mil.negatives:
                # first_round and all_rounds differ only from round 1 on
                late = {mode, config.mil.negatives} == {"first_round", "all_rounds"}
                out[f"mil_negatives_{mode}"] = {"what": f"{what} instead of {config.mil.negatives}",
                                                "overrides": {"mil.negatives": mode}, "from_round": int(late)}
    out["proposals_" + ("tags_only" if p.negatives else "negatives")] = {
        "what": ("proposal classifier trained over the tags only" if p.negatives
                 else "proposal classifier trained over every class (untagged = negative)"),
        "overrides": {"proposals.negatives": not p.negatives}}
    if p.seed_prior_weight > 0:
        out["no_seed_prior"] = {"what": "seeded segmentation without the evidence prior (colour and seeds alone)",
                                "overrides": {"proposals.seed_prior_weight": 0.0}}
    if config.prior_weight > 0 and config.max_rounds > 1:
        out["no_round_prior"] = {"what": "rounds >= 1 use model r-1 alone as the preliminary result (no CAM prior)",
                                 "overrides": {"prior_weight": 0.0}, "from_round": 1}
    if config.prelim_normalize and config.max_rounds > 1:
        out["no_prelim_normalize"] = {"what": "rounds >= 1 take model r-1's probabilities as they are (no per-class "
                                              "max normalisation)",
                                      "overrides": {"prelim_normalize": False}, "from_round": 1}
    if config.segmentation.class_balance > 0:
        out["no_class_balance"] = {"what": "segmenter trained with unweighted cross-entropy",
                                   "overrides": {"segmentation.class_balance": 0.0}, "from_round": 1}
    for s in ("grabcut", "random_walker", "none"):
        if s != p.seeding:
            out[f"seeding_{s}"] = {"what": f"seeded segmentation {s} instead of {p.seeding}",
                                   "overrides": {"proposals.seeding": s}}
    if config.segmentation.use_edges:
        out["no_edges"] = {"what": "edge-feature channel off (3-channel segmenter)",
                           "overrides": {"segmentation.use_edges": False}, "from_round": 1}
    for m in ("skimage_slic", "felzenszwalb"):
        if m != f.superpixel_method:
            out[f"superpixel_{m}"] = {"what": f"superpixels {m} instead of {f.superpixel_method}",
                                      "overrides": {"features.superpixel_method": m}}
    for v in out.values():
        missing = [k for k in v["overrides"] if not _field_exists(WSSSConfig, k)]
        if missing:
            v["skip"] = (f"WSSSConfig has no field {', '.join(missing)} (three_way's lo/hi are not configurable)"
                         if any(k in (CLUSTER_LO, CLUSTER_HI) for k in missing)
                         else f"WSSSConfig has no field {', '.join(missing)}")
    return out


def apply_overrides(config, overrides: dict[str, Any]):
    """A validated copy of ``config`` with dotted-key overrides applied."""
    from flows.config import WSSSConfig

    data = config.model_dump(mode="json")
    for key, value in overrides.items():
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return WSSSConfig.model_validate(data)


def parse_model_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``NAME`` or ``NAME={json options}`` (``--compare-models``) -> (registry name, options).

    >>> parse_model_spec('fusion={"width": 0.25}')
    ('fusion', {'width': 0.25})
    """
    import models

    name, _, raw = spec.partition("=")
    name = name.strip()
    if name not in models.available():
        raise ValueError(f"--compare-models: unknown network {name!r}; choose from {', '.join(models.available())}")
    try:
        options = json.loads(raw) if raw else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"--compare-models {spec!r}: options must be a JSON object ({e})") from None
    if not isinstance(options, dict):
        raise ValueError(f"--compare-models {spec!r}: options must be a JSON object, got {type(options).__name__}")
    return name, options


def budget_epochs(seconds: float, images_per_second: float, images: int, minimum: int = 1) -> int:
    """Whole epochs of ``images`` that fit in ``seconds`` at ``images_per_second`` (at least ``minimum``).

    >>> budget_epochs(300, 10.0, 276)
    10
    """
    if seconds <= 0 or images_per_second <= 0 or images <= 0:
        raise ValueError(f"budget_epochs needs positive seconds, speed and images, got {seconds}, "
                         f"{images_per_second}, {images}")
    return max(minimum, int(seconds * images_per_second // images))


def pick_overlay_records(records: list[ImageRecord], n: int = 6, min_tags: int = 2) -> list[ImageRecord]:
    """``n`` images for the figure, chosen deterministically: evenly spaced over the ids (sorted)
    of the images with a mask and at least ``min_tags`` tags, topped up with other masked ones."""
    with_mask = sorted((r for r in records if r.has_mask), key=lambda r: r.image_id)
    multi = [r for r in with_mask if len(r.tags) >= min_tags]
    pool = multi if len(multi) >= n else multi + [r for r in with_mask if len(r.tags) < min_tags]
    if len(pool) <= n:
        return pool
    picks = np.unique(np.linspace(0, len(pool) - 1, n).round().astype(int))
    return [pool[i] for i in picks]


def _image_miou(pred: np.ndarray | None, gt: np.ndarray, n: int) -> float | None:
    if pred is None:
        return None
    return iou_from_confusion(confusion_matrix(pred, gt, n))[1]


def overlay_figure(store: Store, records: list[ImageRecord], sources: list[tuple[str, int, str]], out: Path) -> Path:
    """Rows of image | ground truth | each source, titled with the image's own mIoU."""
    from tasks.overlay import grid, overlay, write_png

    n = store.classes().n
    rows = []
    for rec in records:
        image = store.image(rec.image_id)
        gt = store.mask(rec.image_id)
        row = [(f"{rec.image_id}: {', '.join(rec.tags)}", image)]
        if gt is not None:
            row.append(("ground truth", overlay(image, gt)))
        for title, r, name in sources:
            label = store.pseudo(r, rec.image_id, name=name)
            if label is None:
                continue
            m = _image_miou(label, gt, n) if gt is not None else None
            row.append((title + ("" if m is None else f" {m:.2f}"), overlay(image, label)))
        rows.append(row)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_png(out, grid(rows))
    return out


# ============================================================================ report
def _f(v, p: int = 4) -> str:
    return "-" if v is None else (f"{v:.{p}f}" if isinstance(v, float) else str(v))


def markdown_report(res: dict) -> str:
    """The markdown table of a bench result (the dict written to FILE.json)."""
    b = res["baselines"]
    lines = [f"# Pseudo-label quality: {res['dataset']} ({res['split']}, {res['images']} images)", "",
             f"Pseudo-labels measured on `{res['split']}` (tags only for training, masks only here); "
             f"models measured on `{res['eval_split']}` ({res['eval_images']} images).", "",
             "| labels on " + res["split"] + " | mIoU | pixel acc. | changed | ignore |", "|---|---|---|---|---|",
             f"| CAM (round 0) | {_f(b['cam']['miou'])} | {_f(b['cam']['pixel_accuracy'])} | | 0.0000 |",
             f"| CAM + dense CRF | {_f(b['cam_crf']['miou'])} | {_f(b['cam_crf']['pixel_accuracy'])} | | 0.0000 |"]
    for r in res["rounds"]:
        lines.append(f"| ours, round {r['round']} | {_f(r['pseudo_label_miou'])} | | {_f(r['changed_share'])} | "
                     f"{_f(r['ignore_share'])} |")
    u = res.get("ungated")
    head = f"| models on {res['eval_split']} | mIoU{' (gated by the image classifier) | ungated' if u else ''} |"
    def row(name: str, key: str, p: int = 4) -> str:
        return f"| {name} | {_f(res[key], p)} |" + (f" {_f(u[key], p)} |" if u else "")
    lines += ["", head, "|---|---|" + ("---|" if u else ""),
              row("WSSS model (final round, pseudo-labels)", "wsss_model_miou"),
              row(f"supervised (masks of {res['split']}, {res['supervised_epochs']} epochs)", "supervised_model_miou"),
              row("WSSS / supervised", "wsss_over_supervised", 3)]
    ms = res.get("model_seeds")
    if ms:
        def spread(k: str, p: int = 4) -> str:
            v = ms.get(k)
            return f"{_f(v['mean'], p)} ({_f(v['min'], p)}-{_f(v['max'], p)})" if v else "n/a"
        tail = lambda k, p=4: f" {spread(k + '_ungated', p)} |" if u else ""
        lines += [f"| WSSS model, mean (min-max) over {len(ms['seeds'])} seeds | {spread('wsss')} |{tail('wsss')}",
                  f"| supervised, mean (min-max) over {len(ms['seeds'])} seeds | {spread('supervised')} |"
                  f"{tail('supervised')}",
                  f"| WSSS / supervised, mean (min-max) | {spread('ratio', 3)} |{tail('ratio', 3)}"]
    pc = res["per_class_iou"]
    names = list(pc["ours"])
    lines += ["", "## Per-class IoU (pseudo-labels)", "", "| class | CAM | CAM+CRF | ours |", "|---|---|---|---|"]
    lines += [f"| {c} | {_f(pc['cam'].get(c), 3)} | {_f(pc['cam_crf'].get(c), 3)} | {_f(pc['ours'].get(c), 3)} |"
              for c in names if any(pc[k].get(c) is not None for k in ("cam", "cam_crf", "ours"))]
    if res.get("ablations"):
        ref_r = res.get("ablation_round", res["final_round"])
        ref = res.get("ablation_reference_miou", res["pseudo_label_miou"])
        lines += ["", f"## Ablations (pseudo-label mIoU of round {ref_r} on {res['split']})", "",
                  "| variant | what | mIoU | vs main |", "|---|---|---|---|",
                  f"| main | as configured | {_f(ref)} | |"]
        for name, a in res["ablations"].items():
            m = a.get("pseudo_label_miou")
            note = a.get("skipped") or a.get("error")
            delta = "" if m is None or ref is None else f"{m - ref:+.4f}"
            lines.append(f"| {name} | {a['what']}{' — ' + note if note else ''} | {_f(m)} | {delta} |")
    if res.get("model_comparison"):
        lines += ["", f"## Networks at the same budget (from scratch, evaluated on {res['eval_split']})", "",
                  "| network | options | img/s | epochs | on pseudo-labels | on masks | ratio |",
                  "|---|---|---|---|---|---|---|"]
        for tag, c in res["model_comparison"].items():
            lines.append(f"| {c['model']} | `{json.dumps(c['options'])}` | {c['measured_images_per_second']:.2f} | "
                         f"{c['epochs']} ({c['budget_seconds']:.0f}s) | {_f(c['wsss']['miou'])} | "
                         f"{_f(c['supervised']['miou'])} | {_f(c['wsss_over_supervised'], 3)} |")
    if res.get("warnings"):
        lines += ["", "Warnings:", ""] + [f"- {w}" for w in res["warnings"]]
    lines += ["", f"Wall time {res['wall_seconds']:.0f}s ("
              + ", ".join(f"{k} {v:.0f}s" for k, v in res["stage_seconds"].items()) + ")."]
    return "\n".join(lines) + "\n"


# ============================================================================ the flow
@functools.cache
def _prefect_parts():
    """The Prefect task and flow of the bench, built on first use (after prepare())."""
    from prefect import flow, task

    from flows.wsss import SHARD_TASK

    crf_task = task(name="cam-crf-shard", **SHARD_TASK)(cam_crf_shard)
    bench_flow = flow(name="bench_quality")(_bench_flow)
    return crf_task, bench_flow


def _link_shared(main: Path, variant: Path, main_cfg, vcfg) -> None:
    """Let a variant reuse the main run's corpus, feature cache, image classifier and, when the
    classifier settings and shards agree, round 0's CAM preliminary result and CAM labels."""
    variant.mkdir(parents=True, exist_ok=True)
    for name in ("corpus", "cache", "classifier.pt"):
        src, dst = main / name, variant / name
        if src.exists() and not (dst.exists() or dst.is_symlink()):
            dst.symlink_to(src.resolve(), target_is_directory=src.is_dir())
    r0, v0 = main / "rounds" / "r000", variant / "rounds" / "r000"
    if (vcfg.classifier != main_cfg.classifier or vcfg.shard_size != main_cfg.shard_size
            or vcfg.split != main_cfg.split or not (r0 / "round.json").exists()):
        return
    (v0 / "done").mkdir(parents=True, exist_ok=True)
    for name in ("prelim.zarr", "cam.zarr"):
        if (r0 / name).exists() and not ((v0 / name).exists() or (v0 / name).is_symlink()):
            (v0 / name).symlink_to((r0 / name).resolve(), target_is_directory=True)
    for marker in (r0 / "done").glob("prelim-*.json"):
        if not (v0 / "done" / marker.name).exists():
            shutil.copy(marker, v0 / "done" / marker.name)


def ratio(wsss: float | None, supervised: float | None) -> float | None:
    """WSSS over supervised mIoU; None where either is missing or the reference scored 0."""
    return wsss / supervised if wsss is not None and supervised else None


def score_model(run: Path, eval_records: list[ImageRecord], eval_split: str, path: Path, eval_key: str,
                shard_size: int, gate: dict, stage: str) -> tuple[dict, dict]:
    """A segmentation checkpoint evaluated on ``eval_records``: its (gated, ungated) entries of
    :func:`flows.wsss.evaluate_sources` (``miou``, ``per_class_iou``, ...; the ungated one is
    empty without a gate, both are empty where no image has a mask)."""
    from flows.wsss import evaluate_sources

    ev = evaluate_sources(str(run), eval_records, [["model", eval_split]], shard_size, stage=stage,
                          model_path=str(path), key=eval_key, **gate)
    return ev.get(f"model:{eval_split}", {}), ev.get(f"model_ungated:{eval_split}", {})


def _bench_flow(data: str, run_dir: str, config, address: str, eval_split: str | None = None,
                ablate: list[str] | None = None, background: str | None = "auto",
                crf: dict | None = None, compare: list[str] | None = None,
                compare_seconds: float = 300.0, ablate_rounds: int = 1, model_seeds: int = 1) -> dict:
    """Steps 1-7 of the module docstring; returns the result dict (without writing files)."""
    from flows.wsss import (compute_all_features, evaluate_sources, final_model_config, gate_options, ingest,
                            run_shards, runner, shards_of, train_round_segmenter, train_wsss)

    crf_task, _ = _prefect_parts()
    t0 = time.perf_counter()
    stages: dict[str, float] = {}
    warnings: list[str] = []
    run = Path(run_dir)
    store = Store(run)
    split = config.split
    crf = {**CRF_DEFAULTS, **(crf or {})}

    # 1. corpus and the method (tags only)
    t = time.perf_counter()
    ingest.with_options(task_runner=runner(address))(data, str(run), config.shard_size, False, background)
    records = store.manifest(split)
    if not records:
        have = sorted({r.split for r in store.manifest()})
        raise ValueError(f"{data}: no image in split {split!r} (splits: {', '.join(have)}); pass --split")
    if not any(r.has_mask for r in records):
        raise ValueError(f"{data}: no image of split {split!r} has a mask (masks/<id>.png): nothing to measure")
    stages["ingest"] = time.perf_counter() - t
    t = time.perf_counter()
    summary = train_wsss.with_options(task_runner=runner(address))(str(run), config, address)
    stages["train_wsss"] = time.perf_counter() - t
    rounds = [r for r in summary["rounds"] if r["round"] != "cam"]
    final_r = int(rounds[-1]["round"])
    key = summary["feature_key"]

    # 2. baselines on the same images: CAM (stored by round 0) and CAM + CRF
    t = time.perf_counter()
    run_shards(crf_task, shards_of(records, config.shard_size), "cam+crf", run_dir=str(run), crf=crf)
    ev = evaluate_sources(str(run), records, [[0, "cam"], [0, "cam_crf"], [final_r, "pseudo"]],
                          config.shard_size, stage="evaluate pseudo-labels")
    stages["baselines"] = time.perf_counter() - t

    # 3. the final model on the eval split (gated by the image classifier per config.inference;
    # the ungated figures are kept beside the gated ones)
    t = time.perf_counter()
    gate = gate_options(str(run), config)
    eval_split = eval_split or "val"
    eval_records = store.manifest(eval_split)
    if not any(r.has_mask for r in eval_records):
        have = sorted({r.split for r in store.manifest()})
        warnings.append(f"split {eval_split!r} has no image with a mask (splits: {', '.join(have)}); models were "
                        f"evaluated on the training split {split!r} instead, which flatters them")
        eval_split, eval_records = split, records
    eval_key = compute_all_features(str(run), eval_records, config)
    final_model = store.round_dir(final_r) / "model.pt"
    wsss_ev, wsss_ev_u = score_model(run, eval_records, eval_split, final_model, eval_key, config.shard_size, gate,
                                     "evaluate WSSS model")
    stages["evaluate_model"] = time.perf_counter() - t

    # 4. supervised reference: the final model's recipe (network, start, total epochs, seed: round
    # final_r's), masks instead of pseudo-labels
    t = time.perf_counter()
    sup_cfg = final_model_config(config, len(rounds))
    sup_path, _ = train_round_segmenter(str(run), final_r, records, key, sup_cfg, None, label_round=None,
                                        out=run / "supervised" / "model.pt")
    sup_ev, sup_ev_u = score_model(run, eval_records, eval_split, sup_path, eval_key, config.shard_size, gate,
                                   "evaluate supervised model")
    stages["supervised"] = time.perf_counter() - t

    wsss_m, sup_m = wsss_ev.get("miou"), sup_ev.get("miou")
    wsss_u, sup_u = wsss_ev_u.get("miou"), sup_ev_u.get("miou")
    ours = ev[f"{final_r}:pseudo"]
    res: dict[str, Any] = {
        "dataset": Path(data).name, "data_dir": str(Path(data).resolve()), "run_dir": str(run.resolve()),
        "split": split, "eval_split": eval_split, "images": len(records), "eval_images": len(eval_records),
        "pseudo_label_miou": ours["miou"], "pseudo_label_pixel_accuracy": ours["pixel_accuracy"],
        "final_round": final_r, "converged": summary["converged"],
        "rounds": [{"round": int(r["round"]), "pseudo_label_miou": r["pseudo_label_miou"],
                    "changed_share": r["changed_share"], "ignore_share": r["ignore_share"],
                    "wall_seconds": r["wall_seconds"]} for r in rounds],
        "baselines": {name: {"miou": ev[f"0:{name}"]["miou"], "pixel_accuracy": ev[f"0:{name}"]["pixel_accuracy"]}
                      for name in ("cam", "cam_crf")},
        "wsss_model_miou": wsss_m, "supervised_model_miou": sup_m,
        "wsss_over_supervised": ratio(wsss_m, sup_m),
        "model_gate": "image classifier" if gate else None,
        "ungated": {"wsss_model_miou": wsss_u, "supervised_model_miou": sup_u,
                    "wsss_over_supervised": ratio(wsss_u, sup_u)} if gate else None,
        "supervised_epochs": sup_cfg.segmentation.epochs,
        "per_class_iou": {"ours": ours["per_class_iou"], "cam": ev["0:cam"]["per_class_iou"],
                          "cam_crf": ev["0:cam_crf"]["per_class_iou"]},
        "model_per_class_iou": {"wsss": wsss_ev.get("per_class_iou"), "supervised": sup_ev.get("per_class_iou")},
        "crf": crf, "config": config.model_dump(mode="json"), "feature_key": key,
        "final_model": str(final_model), "supervised_model": str(sup_path), "warnings": warnings,
    }

    # 4b. more seeds of both models (--model-seeds): on a small eval split the ratio moves by a few
    # hundredths with the seed alone; each further pair shares the labels, recipe and classifier
    if model_seeds > 1:
        t = time.perf_counter()
        res["model_seeds"] = model_seed_spread(
            run, records, eval_records, key, eval_key, sup_cfg, final_r, model_seeds, eval_split, gate,
            first={"seed": config.seed, "wsss": wsss_m, "supervised": sup_m, "wsss_ungated": wsss_u,
                   "supervised_ungated": sup_u})
        stages["model_seeds"] = time.perf_counter() - t

    # 6. ablations: one variant per part, sharing corpus, cache, classifier and round-0 CAMs; each
    # runs ``ablate_rounds`` label-only rounds and is compared with the main run's same round
    if ablate is not None:
        t = time.perf_counter()
        variants = ablation_variants(config)
        a_rounds = max(1, min(ablate_rounds, config.max_rounds))
        ref_round = min(a_rounds - 1, final_r)
        reference = next(r["pseudo_label_miou"] for r in rounds if int(r["round"]) == ref_round)
        res["ablation_round"], res["ablation_reference_miou"] = ref_round, reference
        unknown = [a for a in ablate if a not in variants]
        if unknown:
            raise ValueError(f"unknown ablation(s) {', '.join(unknown)}; choose from {', '.join(variants)}")
        chosen = {k: v for k, v in variants.items() if not ablate or k in ablate}
        res["ablations"] = {}
        for name, v in chosen.items():
            entry = {"what": v["what"], "overrides": v["overrides"]}
            res["ablations"][name] = entry
            skip = v.get("skip") or (f"acts from round {v['from_round']} on; pass --ablate-rounds "
                                     f"{v['from_round'] + 1} or more to measure it"
                                     if v.get("from_round", 0) >= a_rounds else None)
            if skip:
                entry["skipped"] = skip
                print(f"  [ablate {name}] skipped: {skip}", file=sys.stderr, flush=True)
                continue
            vdir = run / f"ablate-{name}"
            tv = time.perf_counter()
            try:
                vcfg = apply_overrides(config, {**v["overrides"], "max_rounds": a_rounds})
                _link_shared(run, vdir, config, vcfg)
                print(f"  [ablate {name}] {v['what']} -> {vdir}", file=sys.stderr, flush=True)
                s = train_wsss.with_options(task_runner=runner(address))(str(vdir), vcfg, address, False)
                last = [r for r in s["rounds"] if r["round"] != "cam"][-1]
                m = last["pseudo_label_miou"]
                entry.update({"pseudo_label_miou": m, "final_round": int(last["round"]),
                              "delta": None if m is None or reference is None else m - reference,
                              "per_class_iou": (Store(vdir).read_round(int(last["round"])) or {}).get("per_class_iou"),
                              "run_dir": str(vdir.resolve())})
            except Exception as e:  # one broken variant must not lose the others' numbers
                entry["error"] = f"{type(e).__name__}: {e}"
                print(f"  [ablate {name}] failed: {entry['error']}", file=sys.stderr, flush=True)
            entry["wall_seconds"] = time.perf_counter() - tv
        stages["ablations"] = time.perf_counter() - t

    # 7. networks side by side: same pseudo-labels, same masks, same wall-time budget
    if compare:
        t = time.perf_counter()
        res["model_comparison"] = compare_models(run, records, eval_records, key, eval_key, config, final_r,
                                                 compare, compare_seconds, eval_split)
        stages["model_comparison"] = time.perf_counter() - t
    res["stage_seconds"] = stages
    res["wall_seconds"] = time.perf_counter() - t0
    return res


def model_seed_spread(run: Path, records: list[ImageRecord], eval_records: list[ImageRecord], key: str,
                      eval_key: str, recipe, final_r: int, n: int, eval_split: str, gate: dict,
                      first: dict) -> dict:
    """The WSSS model (final round's labels) and the supervised reference (masks) trained again
    with ``recipe`` (:func:`flows.wsss.final_model_config`) under seeds ``recipe.seed + 1 ..
    + n - 1``, evaluated like the first pair; returns every seed's figures (``first`` is seed 0's,
    already measured) and the mean, minimum and maximum of each figure and of the ratio."""
    from flows.wsss import train_round_segmenter

    rows = [first]
    for k in range(1, n):
        cfg = recipe.model_copy(update={"seed": recipe.seed + k})
        folder = run / "seeds" / f"seed{cfg.seed:03d}"
        row: dict[str, Any] = {"seed": cfg.seed}
        for what, label_round in (("wsss", final_r), ("supervised", None)):
            path, _ = train_round_segmenter(str(run), final_r, records, key, cfg, None, label_round=label_round,
                                            out=folder / f"{what}.pt")
            gated, ungated = score_model(run, eval_records, eval_split, path, eval_key, recipe.shard_size, gate,
                                         f"evaluate seed {cfg.seed} {what}")
            row[what], row[f"{what}_ungated"] = gated.get("miou"), ungated.get("miou")
        rows.append(row)
    for r in rows:
        for sfx in ("", "_ungated"):
            r["ratio" + sfx] = ratio(r.get("wsss" + sfx), r.get("supervised" + sfx))
    summary: dict[str, Any] = {"seeds": rows}
    for name in ("wsss", "supervised", "ratio", "wsss_ungated", "supervised_ungated", "ratio_ungated"):
        v = [r[name] for r in rows if r.get(name) is not None]
        if v:
            summary[name] = {"mean": sum(v) / len(v), "min": min(v), "max": max(v)}
    return summary


def measure_train_speed(run: Path, records: list[ImageRecord], key: str, config, steps: int = 4) -> float:
    """Training images per second of ``config.segmentation``'s network through the real path
    (store, augmentation, DataLoader workers, the step), measured on the second of two short
    epochs of ``steps`` batches (the first one pays for start-up). A first version timed steps
    on random tensors: it saw 31 img/s where the real epochs ran at 20 (the loader's CPU and
    the store reads were missing), so budgets overran by half."""
    import tempfile

    from flows.wsss import train_round_segmenter

    seg = config.segmentation
    n = min(len(records), seg.batch_size * steps)
    cfg = config.model_copy(update={"segmentation": seg.model_copy(update={
        "epochs": 2, "max_seconds": None, "patience": 2, "finetune": False, "min_steps": 0,
        "encoder_init": "none"})})
    with tempfile.TemporaryDirectory(dir=run, prefix="speed-") as tmp:
        _, result = train_round_segmenter(str(run), 0, records[:n], key, cfg, None, label_round=None,
                                          out=Path(tmp) / "probe.pt")
    return n / max(result.history[-1]["seconds"], 1e-6)


def compare_models(run: Path, records: list[ImageRecord], eval_records: list[ImageRecord], key: str,
                   eval_key: str, config, final_r: int, specs: list[str], seconds: float,
                   eval_split: str) -> dict[str, dict]:
    """Each network of ``specs`` (plus the configured one) trained from scratch on the final
    round's pseudo-labels and on the masks of ``records``, for the same wall-time budget, and
    evaluated on ``eval_records``. The budget becomes whole epochs from each network's measured
    training speed, so every run completes its learning-rate schedule; ``fit``'s own time
    budget (``max_seconds``) stops a run that turns out slower than measured."""
    from flows.wsss import gate_options, train_round_segmenter

    seg = config.segmentation
    gate = gate_options(str(run), config)
    wanted = [(seg.model, dict(seg.options))] + [parse_model_spec(s) for s in specs]
    seen, nets = set(), []
    for name, options in wanted:
        tag = name if not options else f"{name}{json.dumps(options, sort_keys=True)}"
        if tag not in seen:
            seen.add(tag)
            nets.append((tag, name, options))
    out: dict[str, dict] = {}
    for i, (tag, name, options) in enumerate(nets):
        folder = run / "compare" / f"{i:02d}-{name}"
        net_cfg = config.model_copy(update={"segmentation": seg.model_copy(update={"model": name, "options": options})})
        ips = measure_train_speed(run, records, key, net_cfg)
        epochs = budget_epochs(seconds, ips, len(records))
        cfg = net_cfg.model_copy(update={"segmentation": net_cfg.segmentation.model_copy(update={
            "epochs": epochs, "max_seconds": 1.25 * seconds, "patience": epochs, "finetune": False,
            "min_steps": 0, "encoder_init": "none"})})  # from scratch: only `small` could start from the classifier
        entry: dict[str, Any] = {"model": name, "options": options, "budget_seconds": seconds,
                                 "measured_images_per_second": ips, "epochs": epochs}
        print(f"  [compare {tag}] {ips:.2f} img/s measured -> {epochs} epochs of {len(records)} images per "
              f"{seconds:.0f}s budget", file=sys.stderr, flush=True)
        for what, label_round in (("wsss", final_r), ("supervised", None)):
            t = time.perf_counter()
            path, result = train_round_segmenter(str(run), final_r, records, key, cfg, None, label_round=label_round,
                                                 out=folder / f"{what}.pt")
            train_s = time.perf_counter() - t
            m, _ = score_model(run, eval_records, eval_split, path, eval_key, config.shard_size, gate,
                               f"evaluate {tag} {what}")
            entry[what] = {"miou": m.get("miou"), "per_class_iou": m.get("per_class_iou"), "checkpoint": str(path),
                           "train_seconds": train_s if result is not None else None,
                           "epochs_run": result.epochs_run if result is not None else None,
                           "stopped": result.stopped if result is not None else None}
        entry["wsss_over_supervised"] = ratio(entry["wsss"]["miou"], entry["supervised"]["miou"])
        out[tag] = entry
    return out


def run_bench(data: str | os.PathLike, run_dir: str | os.PathLike, config, out: str | os.PathLike, *,
              eval_split: str | None = "val", ablate: list[str] | None = None, workers: int = 2,
              dask_address: str | None = None, background: str | None = "auto",
              crf: dict | None = None, compare: list[str] | None = None, compare_seconds: float = 300.0,
              ablate_rounds: int = 1, model_seeds: int = 1) -> dict:
    """Run the whole bench (one Dask cluster, one flow run) and write ``out`` (JSON), ``out``
    with suffix ``.md`` (markdown table) and ``.png`` (overlay figure). Returns the result.

    ``config.split`` is the split whose images the method is trained and measured on.
    """
    from flows.runtime import dask_cluster
    from flows.wsss import runner

    data = Path(data).resolve()
    run = Path(run_dir).resolve()
    out = Path(out).resolve()
    if not data.is_dir():
        raise FileNotFoundError(f"{data}: no such dataset folder (it needs images/ and labels.csv)")
    if out.suffix != ".json":
        raise ValueError(f"--out must name a .json file, got {out}")
    if model_seeds < 1:
        raise ValueError(f"--model-seeds must be at least 1, got {model_seeds}")
    run.mkdir(parents=True, exist_ok=True)
    # a run directory holds one dataset: mixing two in one corpus would corrupt both
    marker = run / "bench_source.json"
    source = {"data": str(data)}
    if marker.exists() and json.loads(marker.read_text()) != source:
        raise ValueError(f"{run} was used for {json.loads(marker.read_text())['data']}; pass another --run-dir "
                         f"for {data}")
    marker.write_text(json.dumps(source))
    t0 = time.perf_counter()
    _, bench_flow = _prefect_parts()
    with dask_cluster(dask_address, workers, run) as address:
        res = bench_flow.with_options(task_runner=runner(address))(
            str(data), str(run), config, address, eval_split, ablate, background, crf, compare, compare_seconds,
            ablate_rounds, model_seeds)
    res["wall_seconds"] = time.perf_counter() - t0
    out.parent.mkdir(parents=True, exist_ok=True)
    store = Store(run)
    picks = pick_overlay_records(store.manifest(config.split))
    overlay_figure(store, picks, [("CAM", 0, "cam"), ("CAM+CRF", 0, "cam_crf"),
                                  (f"ours r{res['final_round']}", res["final_round"], "pseudo")],
                   out.with_suffix(".png"))
    res["figure"], res["table"] = str(out.with_suffix(".png")), str(out.with_suffix(".md"))
    res["figure_images"] = [r.image_id for r in picks]
    out.write_text(json.dumps(res, indent=1, default=float))
    out.with_suffix(".md").write_text(markdown_report(res))
    return res


# ============================================================================ CLI
def add_bench_quality_parser(bench_subparsers) -> argparse.ArgumentParser:
    """Register ``wsseg bench quality``."""
    from flows.cli import _common, _config_args
    from flows.config import WSSSConfig

    p = bench_subparsers.add_parser(
        "quality", help="pseudo-label mIoU vs CAM and CAM+CRF, WSSS vs supervised model, ablations",
        description="Ingest a dataset folder (images/, labels.csv, optional classes.txt, masks/ and split files), "
                    "run the refresh rounds on --split with tags only, and measure against the masks: the "
                    "pseudo-labels of every round, the CAM and CAM + dense CRF baselines on the same images, the "
                    "final model and a model trained on the masks (same network and epochs) on --eval-split. "
                    "Writes FILE.json, FILE.md (table) and FILE.png (overlays).")
    p.add_argument("--data", required=True, type=Path, help="dataset folder (the layout of `wsseg ingest`)")
    p.add_argument("--split", default=None, help="split the method runs on (default: the config's, train)")
    p.add_argument("--eval-split", default="val",
                   help="split the models are evaluated on (default val; when it has no masked image the "
                        "training split is used and the JSON says so under warnings)")
    p.add_argument("--out", type=Path, default=None, help="result JSON (default: RUN_DIR/quality.json); "
                                                          ".md and .png are written beside it")
    p.add_argument("--ablate", nargs="*", default=None, metavar="NAME",
                   help="also run the ablation variants (all, or only those named); for the default "
                        f"configuration: {', '.join(ablation_variants(WSSSConfig()))} (the set follows the "
                        "configuration: e.g. no_iou_filter when the filter is on)")
    p.add_argument("--ablate-rounds", type=int, default=1, metavar="R",
                   help="label-only rounds each ablation variant runs (default 1: round 0's pseudo-labels, "
                        "compared with the main run's round 0); no_edges and no_round_prior act from round 1 "
                        "on and need 2, as do no_prelim_normalize and no_class_balance")
    p.add_argument("--compare-models", nargs="+", default=None, metavar="NAME[=JSON]",
                   help="also train these networks (and the configured one) from scratch on the final "
                        "pseudo-labels and on the masks, same wall-time budget each, evaluated on --eval-split; "
                        "e.g. --compare-models fusion='{\"width\": 0.25}'")
    p.add_argument("--compare-seconds", type=float, default=300.0,
                   help="training budget of each --compare-models run, in seconds (default 300)")
    p.add_argument("--model-seeds", type=int, default=1, metavar="N",
                   help="train the WSSS model and the supervised reference under N seeds each (default 1) "
                        "and report every seed's mIoU and the ratio's mean and range: on a small eval split "
                        "the seed alone moves the ratio by a few hundredths; each further seed costs two "
                        "trainings of the final model")
    p.add_argument("--background", default="auto",
                   help="implicit background class name, 'none', or 'auto' (first class named background)")
    _common(p, "runs/bench-quality")
    _config_args(p)
    p.set_defaults(func=main)
    return p


def main(args) -> int:
    from flows.cli import build_config

    check_overrides(args.overrides)
    for spec in args.compare_models or []:
        parse_model_spec(spec)  # a typo fails now, not after the rounds
    config = build_config(args)
    if args.split:
        config = config.model_copy(update={"split": args.split})
    run = Path(args.run_dir).resolve()
    out = Path(args.out) if args.out else run / "quality.json"
    res = run_bench(args.data, run, config, out, eval_split=args.eval_split, ablate=args.ablate,
                    workers=args.workers, dask_address=args.dask_address,
                    background=None if args.background == "none" else args.background,
                    compare=args.compare_models, compare_seconds=args.compare_seconds,
                    ablate_rounds=args.ablate_rounds, model_seeds=args.model_seeds)
    print()
    print(markdown_report(res))
    print(f"table:  {res['table']}\nfigure: {res['figure']}")
    print(out.resolve())
    return 0
