"""The review queue: which images' labels are most likely wrong, computed without masks.

Every round's pseudo-label shards record, per image, what the round already has at hand
(:func:`image_signals`):

* ``disagreement``: the share of labelled pixels where the preliminary result (round 0: the
  classifier's CAMs; later: the previous round's segmenter) names another class than the
  pseudo-label: where a network trained on the corpus and the label of this image disagree, one
  of them is wrong about it;
* ``uncertainty``: one minus the mean, over pixels, of the preliminary result's top probability
  over the image's tags;
* ``changed``: the share of pixels whose label changed since the round before (round 0: since
  the CAM labels);
* ``ignore``: the share of pixels left undecided (255);
* ``missing_tags``: the share of the image's tags whose class holds under 1% of its pixels (the
  tags say they are there).

The score (:func:`scores`) is the mean of the signals' ranks over the round's images (each in
[0, 1]; a higher score: more worth a person's look); the ranks make signals of different
scales comparable and need no tuning to a corpus. It is stored with the round
(``rounds/rNNN/review/<shard>.parquet``), shown by ``wsseg review`` and the round's Prefect
artifact, and ``wsseg export --review N`` exports the N images at the top.

Measured on msrc21 train: see the README's "Export, review and corrections" section.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

IGNORE = 255
#: the signals a round records per image, in the order the table shows them
SIGNALS = ("disagreement", "uncertainty", "changed", "ignore", "missing_tags")
#: those the score combines (ranks averaged)
SCORED = ("disagreement", "uncertainty", "changed", "missing_tags")
#: a tag whose class holds less than this share of the image's pixels counts as missing
MISSING_SHARE = 0.01


def image_signals(label: np.ndarray, prelim: np.ndarray, allowed: np.ndarray, previous: np.ndarray | None,
                  tags: Sequence[int]) -> dict[str, float]:
    """The review signals of one image (see the module docstring).

    label : (H, W) uint8 pseudo-label (255 undecided); prelim : (K, H, W) preliminary
    probabilities; allowed : (K,) bool, the image's tags and implicit background; previous :
    the label map of the round before (or the CAM labels), None when there is none; tags : the
    object tags' class indices."""
    idx = np.flatnonzero(allowed)
    sub = prelim[idx]
    top = idx[sub.argmax(0)]
    labelled = label != IGNORE
    n = max(int(labelled.sum()), 1)
    counts = np.bincount(label[labelled].ravel(), minlength=len(allowed))
    return {
        "disagreement": float(np.count_nonzero((top != label) & labelled) / n),
        "uncertainty": float(1.0 - sub.max(0).mean()),
        "changed": float(np.count_nonzero(label != previous) / label.size) if previous is not None else 0.0,
        "ignore": float(1.0 - labelled.mean()),
        "missing_tags": float(np.mean([counts[t] < MISSING_SHARE * label.size for t in tags])) if len(tags) else 0.0,
    }


def ranks(values: np.ndarray) -> np.ndarray:
    """Each value's rank in [0, 1] (ties share their mean rank; one value: 0.5)."""
    from scipy.stats import rankdata

    values = np.asarray(values, float)
    if len(values) < 2:
        return np.full(len(values), 0.5)
    return (rankdata(values, method="average") - 1.0) / (len(values) - 1)


def scores(rows: Sequence[dict], signals: Sequence[str] = SCORED) -> np.ndarray:
    """The review score of each row (one image's signals): the mean rank of ``signals``."""
    if not rows:
        return np.zeros(0)
    return np.mean([ranks([row[s] for row in rows]) for s in signals], axis=0)


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation (Pearson's of the tie-averaged ranks)."""
    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = float(np.sqrt((ra ** 2).sum() * (rb ** 2).sum()))
    return float((ra * rb).sum() / den) if den > 0 else float("nan")


def image_iou(label: np.ndarray, mask: np.ndarray) -> float:
    """One image's mIoU against its mask: the mean IoU over the classes in either (void pixels of
    the mask left out); what the review score is measured against."""
    valid = mask != IGNORE
    a, b = label[valid], mask[valid]
    ious = []
    for c in np.union1d(np.unique(a), np.unique(b)):
        if c == IGNORE:
            continue
        inter = np.count_nonzero((a == c) & (b == c))
        union = np.count_nonzero((a == c) | (b == c))
        ious.append(inter / union)
    return float(np.mean(ious)) if ious else float("nan")


def backfill(store, r: int, progress=None) -> list[dict]:
    """The review rows of a round computed by a wsseg without the review queue, from what the
    round stored (its labels, its preliminary results, the labels of the round before or the CAM
    labels), written beside the round (``review/backfill.parquet``) and returned."""
    classes = store.classes()
    corrected = store.corrections()
    rows = []
    for rec in store.manifest():
        label = store.pseudo(r, rec.image_id)
        if label is None:
            continue
        previous = store.pseudo(r - 1, rec.image_id) if r > 0 else store.pseudo(0, rec.image_id, name="cam")
        object_tags = [c for c in (classes.index(x) for x in rec.tags) if c != classes.background]
        rows.append({"image_id": rec.image_id, "corrected": rec.image_id in corrected,
                     **image_signals(label, store.prelim(r, rec.image_id, classes.n), classes.tag_vector(rec.tags),
                                     previous, object_tags)})
        if progress is not None:
            progress()
    if rows:
        store.write_review(r, "backfill", rows)
    return rows


def review_table(store, r: int, *, top: int | None = None, measure: bool = True, progress=None) -> dict:
    """Round ``r``'s review queue: its images sorted by score, highest first (``rows``: image id,
    score, the signals, ``corrected``), ``top`` of them when given. A corrected image's labels are
    a person's: it scores 0 and sorts last. With ``measure``, where the corpus has masks (for
    measuring only), each row's ``iou`` (:func:`image_iou`) and ``spearman``, the rank correlation
    between the score and the IoU over the uncorrected images with masks (a good queue: strongly
    negative, the worst labels first). A round without review rows (an older wsseg's) gets them
    from its stored arrays first (:func:`backfill`)."""
    rows = store.review_rows(r) or backfill(store, r, progress)
    if not rows:
        return {"round": r, "rows": [], "images": 0, "spearman": None}
    open_rows = [x for x in rows if not x.get("corrected")]
    s = scores(open_rows)
    for x, v in zip(open_rows, s):
        x["score"] = float(v)
    for x in rows:
        x.setdefault("score", 0.0)
    rows.sort(key=lambda x: (-x["score"], x["image_id"]))
    rho, measured = None, 0
    if measure:
        pairs = []
        for x in rows:
            mask = store.mask(x["image_id"])
            label = store.pseudo(r, x["image_id"]) if mask is not None else None
            x["iou"] = image_iou(label, mask) if label is not None else None
            if x["iou"] is not None and not np.isnan(x["iou"]) and not x.get("corrected"):
                pairs.append((x["score"], x["iou"]))
        measured = len(pairs)
        if len(pairs) > 2:
            rho = spearman([p[0] for p in pairs], [p[1] for p in pairs])
    return {"round": r, "images": len(rows), "corrected": len(rows) - len(open_rows), "measured": measured,
            "spearman": rho, "rows": rows[:top] if top is not None else rows}
