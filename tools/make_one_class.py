"""Build a one-class corpus with an implicit background from a dataset folder (the layout of
``wsseg ingest``: classes.txt, labels.csv, images/, masks/).

Every image that shows one of ``--classes`` is kept, tagged with ``--name`` only; its mask
becomes 1 where it shows one of those classes, 0 (background) elsewhere, 255 where the source
mask is void. The classes file is ``background`` and ``--name``. Examples::

    python tools/make_one_class.py --source ../shared/data/coco128 --classes person --out /tmp/person
    python tools/make_one_class.py --source ../shared/data/msrc21 --name object \\
        --classes cow,sheep,aeroplane,car,bicycle,flower,sign,bird,book,chair,cat,dog,boat --out /tmp/objects
"""
from __future__ import annotations

import argparse
import csv
import shutil
import sys
from pathlib import Path

import numpy as np
from PIL import Image


def build(source: Path, classes: list[str], name: str, out: Path) -> int:
    """Write the corpus to ``out``; returns the number of images kept."""
    names = [c.strip() for c in (source / "classes.txt").read_text().splitlines() if c.strip()]
    unknown = [c for c in classes if c not in names]
    if unknown:
        raise SystemExit(f"{source / 'classes.txt'}: no class {', '.join(unknown)}")
    wanted = np.array([names.index(c) for c in classes])
    rows = list(csv.DictReader(open(source / "labels.csv", newline="")))
    (out / "images").mkdir(parents=True, exist_ok=True)
    (out / "masks").mkdir(parents=True, exist_ok=True)
    (out / "classes.txt").write_text(f"background\n{name}\n")
    kept, splits = [], {}
    for row in rows:
        if not set(row["labels"].split(";")) & set(classes):
            continue
        iid = row["image_id"]
        image = next((p for p in (source / "images").glob(f"{iid}.*")), None)
        mask_path = source / "masks" / f"{iid}.png"
        if image is None or not mask_path.is_file():
            continue
        m = np.asarray(Image.open(mask_path))
        new = np.where(np.isin(m, wanted), 1, 0).astype(np.uint8)
        new[m == 255] = 255
        if not (new == 1).any():
            continue
        shutil.copyfile(image, out / "images" / image.name)
        Image.fromarray(new).save(out / "masks" / f"{iid}.png")
        kept.append((iid, row["split"]))
        splits.setdefault(row["split"], []).append(iid)
    with open(out / "labels.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["image_id", "split", "labels"])
        w.writerows([(iid, split, name) for iid, split in kept])
    for split, ids in splits.items():
        (out / f"{split}.txt").write_text("\n".join(ids) + "\n")
    return len(kept)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", required=True, type=Path, help="dataset folder (classes.txt, labels.csv, images/, masks/)")
    ap.add_argument("--classes", required=True, help="comma-separated source classes that make up the one class")
    ap.add_argument("--name", default=None, help="name of the one class (default: the first of --classes)")
    ap.add_argument("--out", required=True, type=Path, help="output folder (created)")
    args = ap.parse_args(argv)
    classes = [c.strip() for c in args.classes.split(",") if c.strip()]
    n = build(args.source, classes, args.name or classes[0], args.out)
    print(f"{n} images -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
