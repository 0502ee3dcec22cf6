"""Reading a source dataset: a folder with ``labels.csv`` or the PASCAL VOC layout.

Two layouts are understood:

* **folder**: ``DIR/images/<id>.<jpg|png|...>`` and ``DIR/labels.csv`` with columns
  ``image_id,labels`` (``;``-separated tags) and optionally ``split``; optional
  ``DIR/classes.txt`` (one class per line), ``DIR/masks/<id>.png`` (palette PNG, class index,
  255 = void; evaluation only) and ``DIR/<split>.txt`` files.
* **voc**: ``DIR/JPEGImages/``, ``DIR/ImageSets/Segmentation/<split>.txt``,
  ``DIR/SegmentationClass/`` (evaluation only) and tags from ``DIR/Annotations/<id>.xml``
  object names (or a ``labels.csv`` beside them).

Implicit background: when the class list starts with ``background`` and no image tags it,
the background class is implied for every image (PASCAL VOC, COCO). Otherwise every pixel
belongs to one of the image's tags (MSRC-21).
"""
from __future__ import annotations

import csv
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
from PIL import Image

from tasks.store import ClassSpec, valid_id

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff")
VOC_CLASSES = ("background", "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat",
               "chair", "cow", "diningtable", "dog", "horse", "motorbike", "person", "pottedplant",
               "sheep", "sofa", "train", "tvmonitor")


class IngestError(ValueError):
    """A source dataset has problems; ``problems`` lists each with the file it concerns."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        super().__init__(f"{len(problems)} problem(s) in the source data:\n  {shown}{more}")


@dataclass(frozen=True)
class SourceItem:
    image_id: str
    image_path: Path
    tags: tuple[str, ...]
    split: str
    mask_path: Path | None


def detect_layout(root: Path) -> str:
    if (root / "JPEGImages").is_dir():
        return "voc"
    if (root / "labels.csv").is_file():
        return "folder"
    raise IngestError([f"{root}: neither a folder with labels.csv nor a VOC layout (JPEGImages/)"])


def read_source(root: str | Path, *, classes: list[str] | None = None,
                background: str | None = "auto") -> tuple[list[SourceItem], ClassSpec]:
    """List a source dataset and check it, without reading pixels.

    Parameters
    ----------
    root : path of the dataset.
    classes : class names; default: ``classes.txt`` if present, else the VOC classes (voc) or the
        sorted union of the tags (folder).
    background : name of an implicit background class, ``None`` for none, or ``"auto"``: the first
        class if it is named ``background`` and no image tags it.

    Raises
    ------
    IngestError
        Listing every problem (missing file, unknown tag, bad id, duplicate) with its file.
    """
    root = Path(root)
    if not root.is_dir():
        raise IngestError([f"{root}: no such directory"])
    layout = detect_layout(root)
    problems: list[str] = []
    if classes is None and (root / "classes.txt").is_file():
        classes = [c.strip() for c in (root / "classes.txt").read_text().splitlines() if c.strip()]
    items = _read_voc(root, problems) if layout == "voc" else _read_folder(root, problems)
    if classes is None:
        classes = list(VOC_CLASSES) if layout == "voc" else sorted({t for it in items for t in it.tags})
    known = set(classes)
    src = root / ("Annotations" if layout == "voc" and (root / "Annotations").is_dir() else "labels.csv")
    for it in items:
        unknown = [t for t in it.tags if t not in known]
        if unknown:
            problems.append(f"{src}: image {it.image_id!r} has unknown tag(s) {unknown}; "
                            f"known classes: {', '.join(classes)}")
        if not it.tags:
            problems.append(f"{src}: image {it.image_id!r} has no tags")
    tagged = {t for it in items for t in it.tags}
    if background == "auto":
        background = classes[0] if classes and classes[0] == "background" and "background" not in tagged else None
    if background is not None and background not in known:
        problems.append(f"background class {background!r} is not among the classes")
    if problems:
        raise IngestError(problems)
    bg = classes.index(background) if background is not None else None
    return items, ClassSpec(tuple(classes), bg)


def _find_image(folder: Path, image_id: str) -> Path | None:
    for ext in IMAGE_EXTS + tuple(e.upper() for e in IMAGE_EXTS):
        p = folder / f"{image_id}{ext}"
        if p.is_file():
            return p
    return None


def _split_files(root: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for name in ("train", "val", "test"):
        for folder in (root, root / "ImageSets" / "Segmentation"):
            f = folder / f"{name}.txt"
            if f.is_file():
                for line in f.read_text().split():
                    out.setdefault(line.strip(), name)
    return out


def _read_folder(root: Path, problems: list[str]) -> list[SourceItem]:
    splits = _split_files(root)
    items: list[SourceItem] = []
    seen: set[str] = set()
    labels = root / "labels.csv"
    with open(labels, newline="") as f:
        reader = csv.DictReader(f)
        if not reader.fieldnames or not {"image_id", "labels"} <= set(reader.fieldnames):
            problems.append(f"{labels}: header must contain image_id and labels (optional split), "
                            f"got {reader.fieldnames}")
            return []
        for line_no, row in enumerate(reader, start=2):
            iid = (row["image_id"] or "").strip()
            if not valid_id(iid):
                problems.append(f"{labels}:{line_no}: bad image_id {iid!r} (letters, digits, . _ - only)")
                continue
            if iid in seen:
                problems.append(f"{labels}:{line_no}: duplicate image_id {iid!r}")
                continue
            seen.add(iid)
            img = _find_image(root / "images", iid)
            if img is None:
                problems.append(f"{root / 'images' / iid}.*: image file missing (listed in {labels}:{line_no})")
                continue
            tags = tuple(t.strip() for t in (row["labels"] or "").split(";") if t.strip())
            split = (row.get("split") or "").strip() or splits.get(iid, "train")
            mask = root / "masks" / f"{iid}.png"
            items.append(SourceItem(iid, img, tags, split, mask if mask.is_file() else None))
    return items


def _read_voc(root: Path, problems: list[str]) -> list[SourceItem]:
    splits = _split_files(root)
    csv_tags: dict[str, tuple[str, ...]] = {}
    if (root / "labels.csv").is_file():
        with open(root / "labels.csv", newline="") as f:
            for row in csv.DictReader(f):
                csv_tags[row["image_id"]] = tuple(t for t in row["labels"].split(";") if t)
    ids = sorted(splits) if splits else sorted(p.stem for p in (root / "JPEGImages").glob("*.jpg"))
    items = []
    for iid in ids:
        img = _find_image(root / "JPEGImages", iid)
        if img is None:
            problems.append(f"{root / 'JPEGImages' / iid}.jpg: image file missing (listed in ImageSets)")
            continue
        if iid in csv_tags:
            tags = csv_tags[iid]
        else:
            xml = root / "Annotations" / f"{iid}.xml"
            if not xml.is_file():
                problems.append(f"{xml}: annotation missing, so image {iid!r} has no tags")
                continue
            try:
                tags = tuple(sorted({o.findtext("name").strip() for o in ET.parse(xml).getroot().iter("object")}))
            except (ET.ParseError, AttributeError) as e:
                problems.append(f"{xml}: unreadable annotation ({e})")
                continue
        mask = root / "SegmentationClass" / f"{iid}.png"
        items.append(SourceItem(iid, img, tags, splits.get(iid, "train"), mask if mask.is_file() else None))
    return items


def load_image(path: Path) -> np.ndarray:
    """(H, W, 3) uint8 RGB; raises ValueError naming the file when it cannot be decoded."""
    data = np.fromfile(str(path), np.uint8)
    img = cv2.imdecode(data, cv2.IMREAD_COLOR) if data.size else None
    if img is None:
        raise ValueError(f"{path}: not a readable image (empty, truncated or unknown format)")
    return cv2.cvtColor(img, cv2.COLOR_BGR2RGB)


def load_mask(path: Path, shape: tuple[int, int]) -> np.ndarray:
    """(H, W) uint8 class-index mask from a palette or grayscale PNG, checked against the image size."""
    try:
        with Image.open(path) as im:
            if im.mode not in ("P", "L", "I", "I;16"):
                raise ValueError(f"{path}: mask must be a palette or grayscale PNG of class indices, "
                                 f"got mode {im.mode}")
            m = np.asarray(im)
    except (OSError, SyntaxError) as e:
        raise ValueError(f"{path}: unreadable mask ({e})") from e
    if m.shape != shape:
        raise ValueError(f"{path}: mask is {m.shape[1]}x{m.shape[0]} but the image is {shape[1]}x{shape[0]}")
    return m.astype(np.uint8)
