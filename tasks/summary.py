"""What a refresh round and a whole run report: pseudo-label shares from the shard statistics,
the figures of label sources from confusion matrices, the rows of the rounds table and their
markdown (the Prefect artifacts and the terminal show the same rows)."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from tasks.metrics import iou_from_confusion

#: the columns of the rounds table
ROW_KEYS = ("round", "pseudo_label_miou", "changed_share", "ignore_share", "wall_seconds")


def label_shares(stats: Sequence[dict]) -> tuple[float, float]:
    """(changed share, ignore share) over every pixel of the per-image ``stats`` of
    :func:`tasks.pipeline.pseudo_shard` (each with ``pixels``, ``changed``, ``ignore``)."""
    pixels = sum(s["pixels"] for s in stats)
    changed = sum(s["changed"] * s["pixels"] for s in stats) / pixels
    ignored = sum(s["ignore"] * s["pixels"] for s in stats) / pixels
    return changed, ignored


def source_scores(confusions: Sequence[dict], class_names: Sequence[str]) -> dict[str, dict]:
    """mIoU, pixel accuracy and per-class IoU of each label source, from the per-shard
    confusion matrices of :func:`tasks.pipeline.evaluate_shard` (summed over the shards)."""
    out = {}
    if not confusions:
        return out
    for k in confusions[0]:
        conf = sum(np.asarray(r[k], np.int64) for r in confusions)
        per_class, miou = iou_from_confusion(conf)
        out[k] = {"miou": float(miou), "pixel_accuracy": float(np.trace(conf[:, :-1]) / max(conf.sum(), 1)),
                  "per_class_iou": {class_names[i]: (None if np.isnan(v) else float(v))
                                    for i, v in enumerate(per_class)}}
    return out


def row(summary: dict) -> dict:
    """The rounds-table row of a round's summary."""
    return {k: summary.get(k) for k in ROW_KEYS}


def markdown_table(rows: list[dict]) -> str:
    """A markdown table of ``rows`` (the keys of the first row are the columns)."""
    if not rows:
        return ""
    cols = list(rows[0])
    fmt = lambda v: f"{v:.4f}" if isinstance(v, float) else ("" if v is None else str(v))  # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)
