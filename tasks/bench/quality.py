"""The plain parts of ``wsseg bench quality`` (its Prefect wiring is :mod:`flows.bench_quality`).

* inputs: :func:`check_inputs`, :func:`split_records`, :func:`eval_records`;
* the result: :func:`method_rounds`, :func:`quality_result`, :func:`ratio`, :func:`seed_summary`;
* networks side by side at one wall-time budget: :func:`parse_model_spec`,
  :func:`compared_networks`, :func:`network_config`, :func:`speed_probe_config`,
  :func:`budget_epochs`, :func:`budget_config`;
* :func:`timed`: the seconds of each stage, for ``stage_seconds``.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any, Iterator

from wsseg.tasks.config import WSSSConfig
from wsseg.tasks.store import ImageRecord, Store

__all__ = ["check_inputs", "split_records", "eval_records", "method_rounds", "quality_result", "ratio",
           "seed_summary", "parse_model_spec", "compared_networks", "network_config", "speed_probe_config",
           "budget_epochs", "budget_config", "timed"]


# ---------------------------------------------------------------------------- inputs
def check_inputs(store: Store, data: str | os.PathLike, out: str | os.PathLike, model_seeds: int) -> None:
    """Refuse a bench that cannot run, before anything is computed: a missing dataset folder, an
    ``out`` that is no ``.json`` file, fewer than one seed, or a run directory that already
    holds another dataset (mixing two in one corpus would corrupt both). Records the dataset
    folder in the run directory (``bench_source``)."""
    data, out = Path(data).resolve(), Path(out).resolve()
    if not data.is_dir():
        raise FileNotFoundError(f"{data}: no such dataset folder (it needs images/ and labels.csv)")
    if out.suffix != ".json":
        raise ValueError(f"--out must name a .json file, got {out}")
    if model_seeds < 1:
        raise ValueError(f"--model-seeds must be at least 1, got {model_seeds}")
    source = {"data": str(data)}
    previous = store.read_json("bench_source")
    if previous is not None and previous != source:
        raise ValueError(f"{store.root} was used for {previous['data']}; pass another --run-dir for {data}")
    store.write_json("bench_source", source)


def split_records(store: Store, split: str, data: str) -> list[ImageRecord]:
    """The images of ``split`` the method runs on; at least one of them must have a mask."""
    records = store.manifest(split)
    if not records:
        have = sorted({r.split for r in store.manifest()})
        raise ValueError(f"{data}: no image in split {split!r} (splits: {', '.join(have)}); pass --split")
    if not any(r.has_mask for r in records):
        raise ValueError(f"{data}: no image of split {split!r} has a mask (masks/<id>.png): nothing to measure")
    return records


def eval_records(store: Store, eval_split: str | None, split: str,
                 records: list[ImageRecord]) -> tuple[str, list[ImageRecord], list[str]]:
    """(split, images, warnings) the models are evaluated on: ``eval_split`` (default val), or the
    training split ``split`` (``records``) with a warning when ``eval_split`` has no masked image."""
    eval_split = eval_split or "val"
    chosen = store.manifest(eval_split)
    if any(r.has_mask for r in chosen):
        return eval_split, chosen, []
    have = sorted({r.split for r in store.manifest()})
    return split, records, [f"split {eval_split!r} has no image with a mask (splits: {', '.join(have)}); models "
                            f"were evaluated on the training split {split!r} instead, which flatters them"]


# ---------------------------------------------------------------------------- the result
def method_rounds(summary: dict) -> list[dict]:
    """The refresh rounds of a ``train_wsss`` summary (without its ``cam`` row)."""
    return [r for r in summary["rounds"] if r["round"] != "cam"]


#: label sources of round 0 measured beside ours: the CAMs, CAM + dense CRF, and (implicit-background
#: corpora only) GrabCut from a box inset 10% from the border, per image
BASELINES = ("cam", "cam_crf", "box_grabcut")


def final_round(summary: dict) -> int:
    """The round whose labels are final in a ``train_wsss`` summary (``final_round``: see
    :mod:`tasks.wsss.stopping`; the last round run for older summaries)."""
    fr = summary.get("final_round")
    return int(method_rounds(summary)[-1]["round"]) if fr is None else int(fr)


def ratio(wsss: float | None, supervised: float | None) -> float | None:
    """WSSS over supervised mIoU; None where either is missing or the reference scored 0."""
    return wsss / supervised if wsss is not None and supervised else None


def quality_result(*, data: str, store: Store, config: WSSSConfig, records: list[ImageRecord], eval_split: str,
                   eval_images: int, summary: dict, labels: dict[str, dict], wsss: tuple[dict, dict],
                   supervised: tuple[dict, dict], gated: bool, supervised_epochs: int, crf: dict,
                   final_model: str, supervised_model: str, warnings: list[str]) -> dict[str, Any]:
    """The bench's result dict (``FILE.json``) from its measurements: ``labels``, the
    ``evaluate_sources`` entries of round 0's ``cam``, ``cam_crf`` (and ``box_grabcut`` on an
    implicit-background corpus) and the final round's ``pseudo`` (the summary's ``final_round``);
    ``wsss`` and ``supervised``, the (gated, ungated) evaluations of both models. The warnings
    are the run's (tag contrast) and ``warnings``."""
    rounds = method_rounds(summary)
    final_r = final_round(summary)
    (wsss_ev, wsss_ev_u), (sup_ev, sup_ev_u) = wsss, supervised
    wsss_m, sup_m = wsss_ev.get("miou"), sup_ev.get("miou")
    wsss_u, sup_u = wsss_ev_u.get("miou"), sup_ev_u.get("miou")
    ours = labels[f"{final_r}:pseudo"]
    base_names = [n for n in BASELINES if f"0:{n}" in labels]
    return {
        "dataset": Path(data).name, "data_dir": str(Path(data).resolve()), "run_dir": str(store.root),
        "split": config.split, "eval_split": eval_split, "images": len(records), "eval_images": eval_images,
        "pseudo_label_miou": ours["miou"], "pseudo_label_pixel_accuracy": ours["pixel_accuracy"],
        "pseudo_label_class_accuracy": ours.get("mean_class_accuracy"),
        "pseudo_label_chance_miou": ours.get("chance_miou"),
        "final_round": final_r, "converged": summary["converged"], "stop_reason": summary.get("stop_reason"),
        "foreground": summary.get("foreground"),
        "rounds": [{"round": int(r["round"]), "pseudo_label_miou": r["pseudo_label_miou"],
                    "pseudo_label_class_accuracy": r.get("pseudo_label_class_accuracy"),
                    "pseudo_label_chance_miou": r.get("pseudo_label_chance_miou"),
                    "changed_share": r["changed_share"], "ignore_share": r["ignore_share"],
                    "tag_coverage": r.get("tag_coverage"), "wall_seconds": r["wall_seconds"]} for r in rounds],
        "baselines": {name: {"miou": labels[f"0:{name}"]["miou"], "pixel_accuracy": labels[f"0:{name}"]["pixel_accuracy"],
                             "class_accuracy": labels[f"0:{name}"].get("mean_class_accuracy"),
                             "chance_miou": labels[f"0:{name}"].get("chance_miou")}
                      for name in base_names},
        "per_class_accuracy": ours.get("per_class_accuracy"),
        "wsss_model_class_accuracy": wsss_ev.get("mean_class_accuracy"),
        "supervised_model_class_accuracy": sup_ev.get("mean_class_accuracy"),
        "wsss_model_miou": wsss_m, "supervised_model_miou": sup_m,
        "wsss_over_supervised": ratio(wsss_m, sup_m),
        "model_gate": "image classifier" if gated else None,
        "ungated": {"wsss_model_miou": wsss_u, "supervised_model_miou": sup_u,
                    "wsss_over_supervised": ratio(wsss_u, sup_u)} if gated else None,
        "supervised_epochs": supervised_epochs,
        "per_class_iou": {"ours": ours["per_class_iou"]} | {n: labels[f"0:{n}"]["per_class_iou"] for n in base_names},
        "per_class_chance_iou": {"ours": ours.get("per_class_chance_iou")}
                                | {n: labels[f"0:{n}"].get("per_class_chance_iou") for n in base_names},
        "model_per_class_iou": {"wsss": wsss_ev.get("per_class_iou"), "supervised": sup_ev.get("per_class_iou")},
        "crf": crf, "config": config.model_dump(mode="json"), "feature_key": summary["feature_key"],
        "final_model": final_model, "supervised_model": supervised_model,
        "warnings": list(summary.get("warnings") or []) + list(warnings),
    }


def seed_summary(rows: list[dict]) -> dict[str, Any]:
    """``--model-seeds``: every seed's row (``seed``, ``wsss``, ``supervised`` and their
    ``_ungated`` figures; the ratios are added here) and the mean, minimum and maximum of each
    figure and of the ratio."""
    for r in rows:
        for sfx in ("", "_ungated"):
            r["ratio" + sfx] = ratio(r.get("wsss" + sfx), r.get("supervised" + sfx))
    summary: dict[str, Any] = {"seeds": rows}
    for name in ("wsss", "supervised", "ratio", "wsss_ungated", "supervised_ungated", "ratio_ungated"):
        v = [r[name] for r in rows if r.get(name) is not None]
        if v:
            summary[name] = {"mean": sum(v) / len(v), "min": min(v), "max": max(v)}
    return summary


# ---------------------------------------------------------------------------- networks at one budget
def parse_model_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``NAME`` or ``NAME={json options}`` (``--compare-models``) -> (registry name, options).

    >>> parse_model_spec('fusion={"width": 0.25}')
    ('fusion', {'width': 0.25})
    """
    from wsseg import models

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


def compared_networks(config: WSSSConfig, specs: list[str]) -> list[tuple[str, str, dict]]:
    """(tag, registry name, options) of the configured network and of each of ``specs``, once each;
    the tag is the name, followed by the options as sorted JSON when there are any."""
    seg = config.segmentation
    wanted = [(seg.model, dict(seg.options))] + [parse_model_spec(s) for s in specs]
    seen, nets = set(), []
    for name, options in wanted:
        tag = name if not options else f"{name}{json.dumps(options, sort_keys=True)}"
        if tag not in seen:
            seen.add(tag)
            nets.append((tag, name, options))
    return nets


def network_config(config: WSSSConfig, name: str, options: dict) -> WSSSConfig:
    """``config`` with another segmentation network."""
    seg = config.segmentation
    return config.model_copy(update={"segmentation": seg.model_copy(update={"model": name, "options": options})})


def speed_probe_config(config: WSSSConfig) -> WSSSConfig:
    """The short training that measures a network's speed: two epochs from the network's own
    start, no time budget, no early stop."""
    seg = config.segmentation
    return config.model_copy(update={"segmentation": seg.model_copy(update={
        "epochs": 2, "max_seconds": None, "patience": 2, "finetune": False, "min_steps": 0,
        "encoder_init": "none"})})


def budget_epochs(seconds: float, images_per_second: float, images: int, minimum: int = 1) -> int:
    """Whole epochs of ``images`` that fit in ``seconds`` at ``images_per_second`` (at least ``minimum``).

    >>> budget_epochs(300, 10.0, 276)
    10
    """
    if seconds <= 0 or images_per_second <= 0 or images <= 0:
        raise ValueError(f"budget_epochs needs positive seconds, speed and images, got {seconds}, "
                         f"{images_per_second}, {images}")
    return max(minimum, int(seconds * images_per_second // images))


def budget_config(config: WSSSConfig, epochs: int, seconds: float) -> WSSSConfig:
    """``config`` trained from scratch for ``epochs`` (its whole learning-rate schedule), stopped
    by ``fit``'s own time budget at 1.25 ``seconds`` if it runs slower than measured. From the
    network's own start (ImageNet for ``lite``, random for ``small``), not the image classifier's
    encoder, which only some networks could take."""
    seg = config.segmentation
    return config.model_copy(update={"segmentation": seg.model_copy(update={
        "epochs": epochs, "max_seconds": 1.25 * seconds, "patience": epochs, "finetune": False,
        "min_steps": 0, "encoder_init": "none"})})


# ---------------------------------------------------------------------------- stage times
@contextlib.contextmanager
def timed(stages: dict[str, float], name: str) -> Iterator[None]:
    """Add the seconds the block takes to ``stages[name]`` (also when it fails)."""
    t = time.perf_counter()
    try:
        yield
    finally:
        stages[name] = time.perf_counter() - t
