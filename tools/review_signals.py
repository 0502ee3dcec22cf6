"""Each review signal's Spearman correlation with the per-image IoU, alone and in every
combination, for the rounds of a finished run directory whose corpus has masks (how the review
score's signals were chosen: docs/benchmarks.md#review-queue-and-corrections).

    python tools/review_signals.py RUN_DIR [ROUND ...]     (default: every finished round)
"""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from wsseg.tasks.labels.review import SIGNALS, image_iou, image_signals, scores, spearman  # noqa: E402
from wsseg.tasks.store import Store  # noqa: E402


def main(argv: list[str]) -> int:
    store = Store(argv[0])
    classes = store.classes()
    for r in [int(a) for a in argv[1:]] or store.finished_rounds():
        rows, ious = [], []
        for rec in store.manifest():
            label, mask = store.pseudo(r, rec.image_id), store.mask(rec.image_id)
            if label is None or mask is None:
                continue
            previous = store.pseudo(r - 1, rec.image_id) if r > 0 else store.pseudo(0, rec.image_id, name="cam")
            tags = [c for c in (classes.index(t) for t in rec.tags) if c != classes.background]
            rows.append(image_signals(label, store.prelim(r, rec.image_id, classes.n), classes.tag_vector(rec.tags),
                                      previous, tags))
            ious.append(image_iou(label, mask))
        print(f"round {r}: {len(rows)} images, mean per-image IoU {np.nanmean(ious):.3f}")
        for k in range(1, len(SIGNALS) + 1):
            for combo in itertools.combinations(SIGNALS, k):
                print(f"  {' + '.join(combo):60s} {spearman(scores(rows, combo), ious):+.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
