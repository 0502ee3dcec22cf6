"""What a refresh round and a whole run report: pseudo-label shares from the shard statistics,
the figures of label sources from confusion matrices, the rows of the rounds table and their
markdown (the Prefect artifacts and the terminal show the same rows)."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from wsseg.tasks.common.metrics import (chance_iou_from_confusion, class_accuracy_from_confusion, iou_from_confusion,
                                  tag_coverage)

#: the columns of the rounds table
ROW_KEYS = ("round", "pseudo_label_miou", "pseudo_label_class_accuracy", "pseudo_label_chance_miou",
            "changed_share", "ignore_share", "tag_coverage",
            "wall_seconds")


def _pixel_counts(results: Sequence[dict]) -> dict[str, float]:
    """Pixel counts summed over :func:`tasks.wsss.pipeline.pseudo_shard`'s shard results (``pixels``,
    ``changed_pixels``, ``reverted_pixels``, ``ignore_pixels``); a shard finished by an older
    wsseg, which returned per-image ``stats`` (shares), is counted from those."""
    out = {"pixels": 0.0, "changed": 0.0, "reverted": 0.0, "ignore": 0.0}
    for res in results:
        if "stats" in res:
            for s in res["stats"]:
                out["pixels"] += s["pixels"]
                for k in ("changed", "reverted", "ignore"):
                    out[k] += s.get(k, 0.0) * s["pixels"]
        else:
            out["pixels"] += res["pixels"]
            for k in ("changed", "reverted", "ignore"):
                out[k] += res[f"{k}_pixels"]
    return out


def label_shares(results: Sequence[dict]) -> tuple[float, float]:
    """(changed share, ignore share) over every pixel of the pseudo-label shards' ``results``
    (:func:`tasks.wsss.pipeline.pseudo_shard`)."""
    c = _pixel_counts(results)
    return c["changed"] / max(c["pixels"], 1), c["ignore"] / max(c["pixels"], 1)


def reverted_of(results: Sequence[dict]) -> float:
    """The share of all pixels that the pseudo-label shards' ``results`` sent back to their label
    of two rounds before."""
    c = _pixel_counts(results)
    return c["reverted"] / max(c["pixels"], 1)


def coverage_of(results: Sequence[dict]) -> float | None:
    """The tag coverage (:func:`tasks.common.metrics.tag_coverage`) of the pseudo-label shards'
    ``results``; None when a shard was finished by an older wsseg that did not record it, or no
    image has a tag."""
    if not results or any("tag_log_shares" not in res for res in results):
        return None
    value = tag_coverage(np.sum([res["tag_log_shares"] for res in results], axis=0),
                         np.sum([res["tagged"] for res in results], axis=0))
    return None if np.isnan(value) else value


def source_scores(confusions: Sequence[dict], class_names: Sequence[str]) -> dict[str, dict]:
    """mIoU, pixel accuracy, mean per-class pixel accuracy (``mean_class_accuracy``), the mIoU of
    the same class shares placed at random (``chance_miou``:
    :func:`tasks.common.metrics.chance_iou_from_confusion`) and the per-class IoU, accuracy and chance IoU
    of each label source, from the per-shard confusion matrices of
    :func:`tasks.wsss.pipeline.evaluate_shard` (summed over the shards)."""
    out = {}
    if not confusions:
        return out
    by_name = lambda values: {class_names[i]: (None if np.isnan(v) else float(v))  # noqa: E731
                              for i, v in enumerate(values)}
    for k in confusions[0]:
        conf = sum(np.asarray(r[k], np.int64) for r in confusions)
        per_class, miou = iou_from_confusion(conf)
        per_class_acc, mean_acc = class_accuracy_from_confusion(conf)
        per_class_chance, chance = chance_iou_from_confusion(conf)
        out[k] = {"miou": float(miou), "pixel_accuracy": float(np.trace(conf[:, :-1]) / max(conf.sum(), 1)),
                  "mean_class_accuracy": float(mean_acc), "chance_miou": float(chance),
                  "per_class_iou": by_name(per_class), "per_class_accuracy": by_name(per_class_acc),
                  "per_class_chance_iou": by_name(per_class_chance)}
    return out


def row(summary: dict) -> dict:
    """The rounds-table row of a round's summary."""
    return {k: summary.get(k) for k in ROW_KEYS}


def warnings_markdown(warnings: Sequence[str]) -> str:
    """A "Warnings" paragraph for a Prefect artifact (empty without warnings)."""
    return "".join(["\n\n**Warnings**\n\n"] + [f"- {w}\n" for w in warnings]) if warnings else ""


def markdown_table(rows: list[dict]) -> str:
    """A markdown table of ``rows`` (the keys of the first row are the columns)."""
    if not rows:
        return ""
    cols = list(rows[0])
    fmt = lambda v: f"{v:.4f}" if isinstance(v, float) else ("" if v is None else str(v))  # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)
