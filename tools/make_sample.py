"""Copy the bundled demo/test sample out of a full msrc21-layout dataset.

Usage: python tools/make_sample.py SRC_DIR DST_DIR [--n 64] [--per-class 3] [--seed 0]

Picks train images so that every class appears in at least ``--per-class`` images (rarest
classes first), then fills up to ``--n`` with a seeded random choice of the rest. Copies
images, masks (for measuring only), classes.txt and a labels.csv restricted to the sample.
"""
from __future__ import annotations

import argparse
import csv
import random
import shutil
from collections import Counter
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--per-class", type=int, default=3)
    ap.add_argument("--split", default="train")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    rows = [r for r in csv.DictReader(open(args.src / "labels.csv")) if r["split"] == args.split]
    rng = random.Random(args.seed)
    rng.shuffle(rows)
    tags = {r["image_id"]: r["labels"].split(";") for r in rows}
    freq = Counter(t for ts in tags.values() for t in ts)
    chosen: list[str] = []
    have: Counter = Counter()
    for cls, _ in sorted(freq.items(), key=lambda kv: kv[1]):
        for r in rows:
            if have[cls] >= args.per_class:
                break
            if cls in tags[r["image_id"]] and r["image_id"] not in chosen:
                chosen.append(r["image_id"])
                have.update(tags[r["image_id"]])
    for r in rows:
        if len(chosen) >= args.n:
            break
        if r["image_id"] not in chosen:
            chosen.append(r["image_id"])
    chosen.sort()

    (args.dst / "images").mkdir(parents=True, exist_ok=True)
    (args.dst / "masks").mkdir(parents=True, exist_ok=True)
    for iid in chosen:
        shutil.copy(args.src / "images" / f"{iid}.jpg", args.dst / "images" / f"{iid}.jpg")
        shutil.copy(args.src / "masks" / f"{iid}.png", args.dst / "masks" / f"{iid}.png")
    shutil.copy(args.src / "classes.txt", args.dst / "classes.txt")
    with open(args.dst / "labels.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["image_id", "split", "labels"])
        for iid in chosen:
            w.writerow([iid, args.split, ";".join(tags[iid])])
    (args.dst / f"{args.split}.txt").write_text("\n".join(chosen) + "\n")
    final = Counter(t for iid in chosen for t in tags[iid])
    print(f"{len(chosen)} images, {len(final)} classes, min per class {min(final.values())}")


if __name__ == "__main__":
    main()
