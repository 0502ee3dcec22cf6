"""Build the panel of development corpora from the shared datasets (msrc21/ and coco128/ of a
data folder such as ../shared/data), each in the layout of ``wsseg ingest`` (images/, masks/,
labels.csv with tags and split, classes.txt starting with ``background``: an implicit
background, <split>.txt)::

    python tools/make_panel.py ../shared/data runs/panel
    python tools/make_panel.py ../shared/data runs/panel --corpora objects,coco-persons

One-class corpora (:data:`PANEL`): the images whose tags name one of the merged classes, tagged
with the one name; their masks are 1 on those classes, 0 (background) on every other class and
255 where the source is void. The many-class corpus ``msrc-objects``: msrc21's 13 object classes,
each keeping its name, and ``person`` (body and face), on the images that show one of them; the
stuff classes (building, grass, tree, sky, water, road) are background. msrc21's train/val split
is kept; a source with one split only (coco128) gets a seeded one (:data:`VAL_SHARE` of the
images to val, chosen by a hash of the seed and the image id). The same source gives the same
files, byte for byte. The sources are checked before anything is written: a missing or damaged
one is one line naming it. Prints images per corpus and split, and the classes.
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import json
import shutil
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np
from PIL import Image

#: msrc21's 13 object classes (its other 8: person's body and face, and the 6 stuff classes)
OBJECTS = ("cow", "sheep", "aeroplane", "car", "bicycle", "flower", "sign", "bird", "book", "chair", "cat",
           "dog", "boat")
#: msrc21's stuff classes: background in every corpus of the panel
STUFF = ("building", "grass", "tree", "sky", "water", "road")
#: share of the images a source with a single split gives to val, and the seed that picks them
VAL_SHARE, SEED = 0.2, 0
#: the mask value of a pixel not annotated (msrc21's void): kept as ignore
VOID = 255


class Corpus(NamedTuple):
    """A corpus of the panel: its source dataset and its classes, each the source classes merged
    into it (one class: a one-class corpus)."""
    source: str
    classes: dict[str, tuple[str, ...]]
    what: str = ""


#: the panel's corpora, in the order they are built and printed
PANEL: dict[str, Corpus] = {
    "animals": Corpus("msrc21", {"animal": ("cow", "sheep", "bird", "dog", "cat")}, "msrc21's animals"),
    "vehicles": Corpus("msrc21", {"vehicle": ("car", "bicycle", "aeroplane", "boat")}, "msrc21's vehicles"),
    "people": Corpus("msrc21", {"person": ("body", "face")}, "msrc21's people (body and face)"),
    "objects": Corpus("msrc21", {"object": OBJECTS}, "msrc21's 13 object classes as one"),
    "coco-persons": Corpus("coco128", {"person": ("person",)}, "coco128's persons"),
    "msrc-objects": Corpus("msrc21", {**{c: (c,) for c in OBJECTS[:3]}, "person": ("face", "body"),
                                      **{c: (c,) for c in OBJECTS[3:]}},
                           "msrc21's 13 object classes and person, each its own class; stuff is background"),
}


class SourceError(ValueError):
    """A source folder that is missing or damaged: one line naming the file and what is wrong."""


# ---------------------------------------------------------------------------- reading a source
def read_source(root: Path, needed: set[str]) -> tuple[list[str], list[dict]]:
    """(class names, rows of labels.csv) of the dataset folder ``root``, checked: its files are
    there, labels.csv has its header, ``needed`` classes are in classes.txt and every tag is one."""
    if not root.is_dir():
        raise SourceError(f"{root}: no such folder (the panel needs the dataset folders msrc21/ and coco128/, "
                          "see ../shared/data/README.md)")
    for part in ("classes.txt", "labels.csv", "images", "masks"):
        if not (root / part).exists():
            raise SourceError(f"{root}: no {part} (a dataset folder holds classes.txt, labels.csv, images/, masks/)")
    names = [c.strip() for c in (root / "classes.txt").read_text().splitlines() if c.strip()]
    missing = sorted(needed - set(names))
    if missing:
        raise SourceError(f"{root / 'classes.txt'}: no class {', '.join(missing)}")
    with open(root / "labels.csv", newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames != ["image_id", "split", "labels"]:
            raise SourceError(f"{root / 'labels.csv'}: header {','.join(reader.fieldnames or [])!r}, "
                              "expected 'image_id,split,labels'")
        rows = list(reader)
    for i, row in enumerate(rows, start=2):
        if not row["image_id"] or not row["split"] or row["labels"] is None:
            raise SourceError(f"{root / 'labels.csv'}: line {i} is incomplete")
        unknown = [t for t in row["labels"].split(";") if t and t not in names]
        if unknown:
            raise SourceError(f"{root / 'labels.csv'}: line {i} tags {unknown[0]!r}, which classes.txt does not name")
    return names, rows


def read_pair(root: Path, image_id: str, n_classes: int) -> tuple[Path, np.ndarray]:
    """The image file of ``image_id`` (checked: it decodes) and its mask (values: a class index or
    255, the image's size)."""
    image = sorted((root / "images").glob(f"{image_id}.*"))
    if not image:
        raise SourceError(f"{root / 'images'}: no image {image_id}.* (labels.csv lists it)")
    mask_path = root / "masks" / f"{image_id}.png"
    if not mask_path.is_file():
        raise SourceError(f"{mask_path}: missing (labels.csv lists {image_id})")
    try:
        with Image.open(image[0]) as im:
            im.load()
            size = im.size
        with Image.open(mask_path) as m:
            mask = np.asarray(m)
    except (OSError, SyntaxError, ValueError) as e:
        raise SourceError(f"{root}: {image_id} cannot be read ({e})") from None
    if mask.ndim != 2 or mask.shape != (size[1], size[0]):
        raise SourceError(f"{mask_path}: {'x'.join(map(str, mask.shape[::-1]))} is not a one-channel mask of its "
                          f"image's {size[0]}x{size[1]}")
    bad = sorted(set(np.unique(mask).tolist()) - set(range(n_classes)) - {VOID})
    if bad:
        raise SourceError(f"{mask_path}: value {bad[0]} is no class of classes.txt ({n_classes} classes) nor void")
    return image[0], mask


def seeded_split(ids: list[str], share: float = VAL_SHARE, seed: int = SEED) -> dict[str, str]:
    """Image id -> ``train`` or ``val``: the ``round(share * n)`` ids first by sha256 of seed and
    id go to val (the same ids give the same split, whatever their order)."""
    order = sorted(ids, key=lambda i: hashlib.sha256(f"{seed}:{i}".encode()).hexdigest())
    val = set(order[:round(share * len(ids))])
    return {i: "val" if i in val else "train" for i in ids}


# ---------------------------------------------------------------------------- writing a corpus
def build(source: Path, corpus: Corpus, out: Path, val_share: float = VAL_SHARE) -> dict:
    """Write ``corpus`` from the dataset folder ``source`` into ``out`` (replaced: written beside it,
    then moved in place); returns its summary (``classes``, ``images`` per split). Where the source
    has one split only, ``val_share`` of the images kept go to val (:func:`seeded_split`; 0: none)."""
    members = {m for ms in corpus.classes.values() for m in ms}
    names, rows = read_source(source, members)
    value = np.zeros(256, np.uint8)  # source value -> the corpus's: 0 (background) unless merged into a class
    for k, (cls, ms) in enumerate(corpus.classes.items(), start=1):
        value[[names.index(m) for m in ms]] = k
    value[VOID] = VOID
    kept = [r for r in rows if members & set(r["labels"].split(";"))]
    if not kept:
        raise SourceError(f"{source / 'labels.csv'}: no image tagged {', '.join(sorted(members))}")
    # read and check every image before anything is written
    pairs = {r["image_id"]: read_pair(source, r["image_id"], len(names)) for r in kept}
    splits = {r["image_id"]: r["split"] for r in kept}
    if len({r["split"] for r in rows}) == 1 and val_share:
        splits = seeded_split(list(splits), val_share)
    tmp = out.parent / f".{out.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "images").mkdir(parents=True)
    (tmp / "masks").mkdir()
    table, per_split = [], {}
    for r in kept:
        iid = r["image_id"]
        image, mask = pairs[iid]
        new = value[mask]
        tags = [cls for k, (cls, ms) in enumerate(corpus.classes.items(), start=1)
                if set(ms) & set(r["labels"].split(";"))]
        shown = sorted(set(np.unique(new).tolist()) - {0, VOID})
        if shown != [list(corpus.classes).index(t) + 1 for t in tags]:
            raise SourceError(f"{source / 'masks' / (iid + '.png')}: its classes do not match its tags in "
                              f"labels.csv ({r['labels']})")
        shutil.copyfile(image, tmp / "images" / image.name)
        Image.fromarray(new).save(tmp / "masks" / f"{iid}.png")
        table.append((iid, splits[iid], ";".join(tags)))
        per_split.setdefault(splits[iid], []).append(iid)
    (tmp / "classes.txt").write_text("background\n" + "".join(f"{c}\n" for c in corpus.classes))
    with open(tmp / "labels.csv", "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["image_id", "split", "labels"])
        w.writerows(table)
    for split, ids in sorted(per_split.items()):
        (tmp / f"{split}.txt").write_text("\n".join(ids) + "\n")
    if out.exists():
        if not (out / "labels.csv").is_file() and any(out.iterdir()):
            shutil.rmtree(tmp)
            raise SourceError(f"{out}: exists and holds no corpus; remove it or choose another panel folder")
        shutil.rmtree(out)
    tmp.rename(out)
    return {"source": corpus.source, "what": corpus.what, "classes": {c: list(ms) for c, ms in corpus.classes.items()},
            "images": {s: len(ids) for s, ids in sorted(per_split.items())}}


def build_panel(data: Path, panel: Path, corpora: list[str] | None = None) -> dict[str, dict]:
    """Write the corpora ``corpora`` (default: all of :data:`PANEL`) from the data folder ``data``
    into ``panel``/NAME, and ``panel``/panel.json (what each holds); every source they need is
    checked first. Returns ``{name: summary}``."""
    names = list(PANEL) if not corpora else corpora
    unknown = [n for n in names if n not in PANEL]
    if unknown:
        raise SourceError(f"no corpus {', '.join(unknown)} in the panel (corpora: {', '.join(PANEL)})")
    if not data.is_dir():
        raise SourceError(f"{data}: no such data folder (it holds msrc21/ and coco128/, e.g. ../shared/data)")
    for src in dict.fromkeys(PANEL[n].source for n in names):  # every source checked before anything is written
        read_source(data / src, {m for n in names if PANEL[n].source == src for ms in PANEL[n].classes.values()
                                 for m in ms})
    panel.mkdir(parents=True, exist_ok=True)
    done = {n: build(data / PANEL[n].source, PANEL[n], panel / n) for n in names}
    record = panel / "panel.json"
    try:
        merged = (json.loads(record.read_text()) if record.is_file() else {}) | done
    except (json.JSONDecodeError, TypeError):  # a damaged record: this build's alone
        merged = done
    ordered = {n: merged[n] for n in PANEL if n in merged} | {n: merged[n] for n in sorted(merged) if n not in PANEL}
    record.write_text(json.dumps(ordered, indent=1) + "\n")
    return done


def summary_lines(done: dict[str, dict]) -> list[str]:
    """Images per corpus and split, and the classes (merged source classes in brackets)."""
    splits = sorted({s for d in done.values() for s in d["images"]}, key=lambda s: (s != "train", s != "val", s))
    lines = [f"{'corpus':<14}" + "".join(f"{s:>7}" for s in splits) + f"{'all':>7}  classes (background implicit)"]
    for name, d in done.items():
        classes = ", ".join(c if list(ms) == [c] else f"{c} ({'+'.join(ms)})" for c, ms in d["classes"].items())
        lines.append(f"{name:<14}" + "".join(f"{d['images'].get(s, 0):>7}" for s in splits)
                     + f"{sum(d['images'].values()):>7}  {classes}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", type=Path, help="data folder holding msrc21/ and coco128/ (e.g. ../shared/data)")
    ap.add_argument("panel", type=Path, help="output folder: one corpus folder per panel corpus, and panel.json")
    ap.add_argument("--corpora", default=None,
                    help=f"comma-separated corpora to build (default: all: {', '.join(PANEL)})")
    args = ap.parse_args(argv)
    corpora = [c.strip() for c in args.corpora.split(",") if c.strip()] if args.corpora else None
    try:
        done = build_panel(args.data, args.panel, corpora)
    except SourceError as e:
        print(f"make_panel.py: error: {e}", file=sys.stderr)
        return 2
    print("\n".join(summary_lines(done)))
    print(f"-> {args.panel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
