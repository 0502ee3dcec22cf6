"""Per class, how large a run's labels make it: IoU against the masks and the labelled area over
the true area, for the CAM and each finished round of a run directory whose corpus has masks; with
``--class NAME``, that class's images one by one and which true classes its labelled pixels lie
on (how docs/benchmarks.md#msrc21-bench-quality found the weak classes' over-extension).

    python tools/label_areas.py RUN_DIR [--rounds R ...] [--split train] [--class NAME]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from tasks.common.metrics import confusion_matrix, iou_from_confusion  # noqa: E402
from tasks.store import Store  # noqa: E402


def area_table(confusion: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per class of a ``(K, K + 1)`` confusion (rows true, columns labelled, last column ignored):
    IoU and labelled area / true area (NaN where the class has no true pixel)."""
    k = confusion.shape[0]
    labelled, true = confusion[:, :k].sum(axis=0), confusion.sum(axis=1)
    return iou_from_confusion(confusion)[0], np.where(true > 0, labelled / np.maximum(true, 1), np.nan)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="a run directory of `wsseg train` or `wsseg bench quality` (corpus with masks)")
    p.add_argument("--rounds", type=int, nargs="+", default=None, help="rounds to measure (default: every finished one)")
    p.add_argument("--split", default="train", help="split whose labelled images are measured (default train)")
    p.add_argument("--class", dest="cls", default=None, metavar="NAME",
                   help="also list this class's images: true and labelled share, where its labels lie")
    args = p.parse_args(argv)
    store = Store(args.run_dir)
    names = store.classes().names
    k = len(names)
    rounds = args.rounds if args.rounds is not None else store.finished_rounds()
    if not rounds:
        print(f"{args.run_dir}: no finished round", file=sys.stderr)
        return 1
    if args.cls is not None and args.cls not in names:
        print(f"{args.run_dir}: no class {args.cls!r} (classes: {', '.join(names)})", file=sys.stderr)
        return 1
    sources = [(0, "cam")] + [(r, "pseudo") for r in rounds]
    conf = {s: np.zeros((k, k + 1), np.int64) for s in sources}
    per_image = []
    for rec in store.manifest(args.split):
        mask = store.mask(rec.image_id)
        if mask is None:
            continue
        labels = {s: store.pseudo(s[0], rec.image_id, s[1]) for s in sources}
        for s, label in labels.items():
            if label is not None:
                conf[s] += confusion_matrix(label, mask, k)
        if args.cls is not None and (mask == names.index(args.cls)).any():
            per_image.append((rec.image_id, mask, labels[sources[-1]]))
    heads = ["CAM"] + [f"round {r}" for r in rounds]
    print(f"{'class':12s}" + "".join(f"{h + ' IoU':>12s}{'area':>7s}" for h in heads))
    tables = [area_table(conf[s]) for s in sources]
    for c in range(k):
        print(f"{names[c]:12s}" + "".join(f"{iou[c]:12.3f}{area[c]:7.2f}" for iou, area in tables))
    print(f"{'mIoU':12s}" + "".join(f"{np.nanmean(iou):12.3f}{'':7s}" for iou, _ in tables))
    if args.cls is not None:
        c = names.index(args.cls)
        print(f"\n{args.cls}, {heads[-1]}: image, true share, labelled share, true classes under its labels")
        for image_id, mask, label in per_image:
            if label is None:
                continue
            valid = mask != 255
            on = (label == c) & valid
            under = {names[t]: round(float(np.count_nonzero(on & (mask == t)) / max(np.count_nonzero(on), 1)), 2)
                     for t in np.unique(mask[valid])}
            print(f"  {image_id:16s} {np.mean(mask[valid] == c):.3f} {np.mean(label[valid] == c):.3f} {under}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
