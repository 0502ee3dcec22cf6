"""Per class, how large a run's labels make it: IoU against the masks and the labelled area over
the true area, for the CAM and each finished round of a run directory whose corpus has masks; with
``--class NAME``, that class's images one by one and which true classes its labelled pixels lie
on (how docs/benchmarks.md#msrc21-bench-quality found the weak classes' over-extension); with
``--by-tags``, on a corpus with an implicit background, the background's true and labelled share
and IoU over the images with 1, 2, ... object tags (how docs/benchmarks.md#coco128 found that the
objects take more of the background the more tags an image has).

    python tools/label_areas.py RUN_DIR [--rounds R ...] [--split train] [--class NAME] [--by-tags]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from wsseg.tasks.common.metrics import confusion_matrix, iou_from_confusion  # noqa: E402
from wsseg.tasks.store import Store  # noqa: E402


def area_table(confusion: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per class of a ``(K, K + 1)`` confusion (rows true, columns labelled, last column ignored):
    IoU and labelled area / true area (NaN where the class has no true pixel)."""
    k = confusion.shape[0]
    labelled, true = confusion[:, :k].sum(axis=0), confusion.sum(axis=1)
    return iou_from_confusion(confusion)[0], np.where(true > 0, labelled / np.maximum(true, 1), np.nan)


def background_by_tags(rows: list[tuple[int, np.ndarray, list[np.ndarray]]], background: int) -> dict[int, dict]:
    """Per number of object tags: images, the background's true share and, for each label source,
    its labelled share and IoU (pixels pooled over those images; ignore 255 left out). ``rows``:
    (object tags, mask, [label map of each source]) per image.

    >>> m = np.array([[0, 0, 1, 1]])
    >>> background_by_tags([(1, m, [m]), (2, m, [np.ones_like(m)])], 0)[2]
    {'images': 1, 'true': 0.5, 'labelled': [0.0], 'iou': [0.0]}
    """
    out: dict[int, dict] = {}
    for n, mask, labels in rows:
        e = out.setdefault(n, {"images": 0, "valid": 0, "true": 0, "lab": [0] * len(labels), "inter": [0] * len(labels),
                               "union": [0] * len(labels)})
        valid = mask != 255
        true = (mask == background) & valid
        e["images"] += 1
        e["valid"] += int(valid.sum())
        e["true"] += int(true.sum())
        for i, label in enumerate(labels):
            lab = (label == background) & valid
            e["lab"][i] += int(lab.sum())
            e["inter"][i] += int((lab & true).sum())
            e["union"][i] += int((lab | true).sum())
    return {n: {"images": e["images"], "true": round(e["true"] / max(e["valid"], 1), 3),
                "labelled": [round(x / max(e["valid"], 1), 3) for x in e["lab"]],
                "iou": [round(i / max(u, 1), 3) for i, u in zip(e["inter"], e["union"])]} for n, e in sorted(out.items())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="a run directory of `wsseg train` or `wsseg bench quality` (corpus with masks)")
    p.add_argument("--rounds", type=int, nargs="+", default=None, help="rounds to measure (default: every finished one)")
    p.add_argument("--split", default="train", help="split whose labelled images are measured (default train)")
    p.add_argument("--class", dest="cls", default=None, metavar="NAME",
                   help="also list this class's images: true and labelled share, where its labels lie")
    p.add_argument("--by-tags", action="store_true",
                   help="also the background's share and IoU by the number of object tags (implicit background)")
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
    per_image, by_tags = [], []
    background = store.classes().background
    if args.by_tags and background is None:
        print(f"{args.run_dir}: --by-tags needs an implicit background class; this corpus has none", file=sys.stderr)
        return 1
    for rec in store.manifest(args.split):
        mask = store.mask(rec.image_id)
        if mask is None:
            continue
        labels = {s: store.pseudo(s[0], rec.image_id, s[1]) for s in sources}
        if args.by_tags and all(v is not None for v in labels.values()):
            n_tags = sum(1 for t in rec.tags if names.index(t) != background)
            by_tags.append((n_tags, mask, list(labels.values())))
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
    print(f"{'mIoU':12s}" + "".join(f"{iou_from_confusion(conf[s])[1]:12.3f}{'':7s}" for s in sources))
    if args.by_tags:
        print(f"\nbackground by object tags: images, true share, then labelled share / IoU of {', '.join(heads)}")
        for n, e in background_by_tags(by_tags, background).items():
            print(f"  {n:3d} tags {e['images']:4d} {e['true']:6.3f}  "
                  + "  ".join(f"{a:.3f} / {b:.3f}" for a, b in zip(e["labelled"], e["iou"])))
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
