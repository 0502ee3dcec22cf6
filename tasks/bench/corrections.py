"""``wsseg bench corrections``' pure parts: which images a person corrects in each variant, and
the table of what that bought.

The loop measured: a finished run on a corpus with masks; a share of its training images is
corrected (their masks stand in for a person's corrections), chosen by the review queue
(:mod:`tasks.labels.review`) or at random under several seeds, and the rounds run again with the
corrections (:mod:`tasks.labels.corrections`). Reported per variant: the pseudo-label mIoU of the
images nobody corrected, beside the run without corrections on the same images; the mIoU of the
whole corpus's labels; the final model's mIoU on the evaluation split.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def pick_count(n_images: int, share: float) -> int:
    """How many of ``n_images`` a ``share`` corrects (at least one)."""
    if not 0 < share < 1:
        raise ValueError(f"--share must lie between 0 and 1 (a share of the images), got {share}")
    return max(1, int(round(share * n_images)))


def random_pick(ids: Sequence[str], n: int, seed: int) -> list[str]:
    """``n`` of ``ids`` at random (numpy's generator under ``seed``), in corpus order."""
    chosen = set(np.random.default_rng(seed).choice(len(ids), size=n, replace=False).tolist())
    return [i for k, i in enumerate(ids) if k in chosen]


def variants(queue: Sequence[str], ids: Sequence[str], n: int, seeds: int) -> dict[str, list[str]]:
    """The picks: ``queue`` (the review queue's top ``n``) and ``random-<seed>`` for seeds
    0 .. ``seeds`` - 1."""
    out = {"queue": list(queue[:n])}
    for s in range(seeds):
        out[f"random-{s}"] = random_pick(ids, n, s)
    return out


def summary_rows(result: dict) -> list[dict]:
    """One row per variant (and the mean of the random ones) for the table."""
    rows = []
    for name, v in result["variants"].items():
        rows.append({"variant": name, "corrected": v["corrected"],
                     "others_miou": v["others_miou"], "others_miou_before": v["others_miou_before"],
                     "others_gain": _diff(v["others_miou"], v["others_miou_before"]),
                     "corpus_miou": v["corpus_miou"], "model_miou": v["model_miou"]})
    rand = [r for r in rows if r["variant"].startswith("random-")]
    if rand:
        mean = {"variant": f"random (mean of {len(rand)})", "corrected": rand[0]["corrected"]}
        for k in ("others_miou", "others_miou_before", "others_gain", "corpus_miou", "model_miou"):
            vals = [r[k] for r in rand if r[k] is not None]
            mean[k] = float(np.mean(vals)) if vals else None
        rows.append(mean)
    base = result["baseline"]
    rows.insert(0, {"variant": "none", "corrected": 0, "others_miou": None, "others_miou_before": None,
                    "others_gain": None, "corpus_miou": base["corpus_miou"], "model_miou": base["model_miou"]})
    return rows


def _diff(a, b):
    return None if a is None or b is None else a - b


def markdown(result: dict) -> str:
    cols = ("variant", "corrected", "others_miou", "others_miou_before", "others_gain", "corpus_miou", "model_miou")
    fmt = lambda v: "-" if v is None else (f"{v:+.4f}" if isinstance(v, float) and v < 0 else  # noqa: E731
                                          f"{v:.4f}" if isinstance(v, float) else str(v))
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in summary_rows(result)]
    notes = (f"\n\n{result['images']} images of split {result['split']!r}, {result['corrected_per_variant']} "
             f"corrected per variant ({100 * result['share']:.0f}%); others_*: the pseudo-label mIoU of the images "
             f"not corrected, after and before (the run without corrections on the same images); corpus_miou: "
             f"every image's labels; model_miou: the final model on {result['eval_split']!r}"
             f"{' (gated)' if result.get('gated') else ''}. Review score against per-image IoU (round "
             f"{result['baseline']['round']}): Spearman {result['review_spearman']:+.3f}.")
    return "\n".join(lines) + notes
