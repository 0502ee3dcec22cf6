"""Reading a source dataset: a folder with ``labels.csv`` or the PASCAL VOC layout.

Two layouts are understood:

* **folder**: ``DIR/images/<id>.<jpg|png|...>`` and ``DIR/labels.csv`` with columns
  ``image_id,labels`` (``;``-separated tags) and optionally ``split``; optional
  ``DIR/classes.txt`` (one class per line), ``DIR/masks/<id>.png`` (palette PNG, class index,
  255 = void; evaluation only) and ``DIR/<split>.txt`` files. ``classes.txt`` is required when
  masks come with the source (the mask values index it).
* **voc**: ``DIR/JPEGImages/``, ``DIR/ImageSets/Segmentation/<split>.txt``,
  ``DIR/SegmentationClass/`` (evaluation only) and tags from ``DIR/Annotations/<id>.xml``
  object names (or a ``labels.csv`` beside them).

Implicit background: when the class list starts with ``background`` and no image tags it,
the background class is implied for every image (PASCAL VOC, COCO). Otherwise every pixel
belongs to one of the image's tags (MSRC-21).

Checks. :func:`check_source` lists a source and checks everything that needs no pixels: the
listing (ids, duplicates, malformed rows, missing files, links leaving the source folder), the
tags, and each image's header (size against :data:`MAX_PIXELS` and :data:`MIN_SIDE`, read
without decoding). Per-row problems reject that row (with ``--skip-invalid`` the others are
ingested); source-level problems (no labels header, masks without ``classes.txt``) refuse the
whole source. Decoding problems and mask values are checked by the ingest workers
(:func:`decode_image`, :func:`load_mask`).
"""
from __future__ import annotations

import csv
import io
import sys
import xml.etree.ElementTree as ET
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import cv2
import numpy as np
import pyarrow as pa
from PIL import Image, ImageColor, ImageOps

from wsseg.tasks.store import ClassSpec, ImageRecord, Store, valid_id

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff")
VOC_CLASSES = ("background", "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat",
               "chair", "cow", "diningtable", "dog", "horse", "motorbike", "person", "pottedplant",
               "sheep", "sofa", "train", "tvmonitor")

# Defaults of the input checks (the CLI's `wsseg ingest` options and the ingest flow use these).
MAX_PIXELS = 89_478_485
"""Largest image (width x height, from its header) that is decoded: PIL's decompression-bomb
limit, about 89 Mpx (256 MiB of RGB). A decoded image costs 3 bytes a pixel per copy."""
MIN_SIDE = 32
"""Smallest image side in pixels: below it the superpixels (16 px regions) and the networks'
stride-8/16 maps degenerate (8 px or less crash OpenCV's superpixels)."""
ALPHA_BACKGROUND = "white"
"""Colour that images with transparent pixels are composited on (a name, ``#rrggbb`` or ``r,g,b``)."""
REFUSED_HINT = "(nothing was added to the corpus; fix these or pass --skip-invalid to ingest the other images)"


class IngestError(ValueError):
    """A source dataset has problems; ``problems`` lists each with the file it concerns (one
    line each: file, problem, what to do); ``hint`` is a closing line that is no problem."""

    def __init__(self, problems: Sequence[str], hint: str | None = None):
        self.problems = list(problems)
        self.hint = hint
        shown = "\n  ".join(self.problems[:20])
        more = f"\n  ... and {len(self.problems) - 20} more" if len(self.problems) > 20 else ""
        tail = f"\n  {hint}" if hint else ""
        super().__init__(f"{len(self.problems)} problem(s) in the source data:\n  {shown}{more}{tail}")

    def __reduce__(self):
        return (IngestError, (self.problems, self.hint))


@dataclass(frozen=True, slots=True)
class SourceItem:
    """One listed image. A flow holds one per image of the source while it ingests, so it is
    small: slots, the files' paths as strings (a :class:`~pathlib.Path` each on reading), the
    tags and split shared between images (a listing of msrc21's copies: 537 bytes an image held,
    against 1,322 with a Path per file and a dict per item)."""

    image_id: str
    image_file: str
    tags: tuple[str, ...]
    split: str
    mask_file: str | None
    line: int | None = None  # the row of labels.csv it comes from (None: VOC listing)

    @classmethod
    def of(cls, image_id: str, image_path: Path, tags: Iterable[str], split: str, mask_path: Path | None,
           line: int | None = None) -> "SourceItem":
        return cls(image_id, str(image_path), tuple(sys.intern(t) for t in tags), sys.intern(split),
                   None if mask_path is None else str(mask_path), line)

    @property
    def image_path(self) -> Path:
        return Path(self.image_file)

    @property
    def mask_path(self) -> Path | None:
        return None if self.mask_file is None else Path(self.mask_file)


@dataclass
class SourceCheck:
    """What :func:`check_source` found: ``items`` passed every check; each entry of ``rejected``
    (``image_id``, ``file``, ``line``, ``problems``) is one listed row that did not;
    ``fatal`` problems concern the whole source. ``listed`` = len(items) + len(rejected)."""

    root: Path
    items: list[SourceItem]
    classes: ClassSpec | None
    rejected: list[dict] = field(default_factory=list)
    fatal: list[str] = field(default_factory=list)
    listed: int = 0

    @property
    def problems(self) -> list[str]:
        return self.fatal + [p for r in self.rejected for p in r["problems"]]

    def skipped_lines(self, limit: int = 20) -> list[str]:
        """The rejected rows a user is told about on the console, one line each (its first
        problem, which names the file or the line of labels.csv): the first ``limit``, then a
        count of the rest."""
        lines = [f"  {r['problems'][0]}" for r in self.rejected[:limit]]
        if len(self.rejected) > limit:
            lines.append(f"  ... and {len(self.rejected) - limit} more")
        return lines

    def raise_for(self, skip_invalid: bool = False) -> None:
        """Raise :class:`IngestError` for source-level problems, for per-row ones unless
        ``skip_invalid``, and when nothing is left to ingest."""
        if self.fatal:
            raise IngestError(self.problems, hint="(nothing was added to the corpus; these concern the whole source)")
        if self.rejected and not skip_invalid:
            raise IngestError(self.problems, hint=REFUSED_HINT)
        if not self.items:
            what = "every listed image was rejected" if self.rejected else "no images listed"
            raise IngestError(self.problems or [f"{self.root}: no images listed; add rows to labels.csv"],
                              hint=f"(nothing was added to the corpus: {what})")


def detect_layout(root: Path) -> str:
    if (root / "JPEGImages").is_dir():
        return "voc"
    if (root / "labels.csv").is_file():
        return "folder"
    raise IngestError([f"{root}: neither a folder with labels.csv nor a VOC layout (JPEGImages/); "
                       "give a folder holding images/ and labels.csv"])


def read_source(root: str | Path, *, classes: list[str] | None = None,
                background: str | None = "auto") -> tuple[list[SourceItem], ClassSpec]:
    """List a source dataset and check it, without decoding pixels (see :func:`check_source`).

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
        Listing every problem (missing file, unknown tag, bad id, duplicate, malformed row,
        oversized or tiny image, link out of the source) with its file.
    """
    check = check_source(root, classes=classes, background=background)
    check.raise_for(skip_invalid=False)
    return check.items, check.classes


def check_source(root: str | Path, *, classes: list[str] | None = None, background: str | None = "auto",
                 max_pixels: int = MAX_PIXELS, min_side: int = MIN_SIDE,
                 allow_external_links: bool = False, headers: bool = True) -> SourceCheck:
    """List a source dataset and run every check that needs no decoding (the cheap checks, run
    before any worker starts). Never raises for problems of the data: see :class:`SourceCheck`
    and :meth:`SourceCheck.raise_for`.

    Parameters
    ----------
    max_pixels : images whose header gives more pixels are rejected (not decoded).
    min_side : images with a side under this many pixels are rejected.
    allow_external_links : accept image/mask files that are symbolic links leaving the source folder.
    headers : read each image's header (size limits); False when the caller has just done so with
        the same limits (the CLI checks before the cluster starts, the flow then need not again).
    """
    root = Path(root)
    out = SourceCheck(root, [], None)
    if not root.is_dir():
        out.fatal.append(f"{root}: no such directory; give the dataset folder")
        return out
    try:
        layout = detect_layout(root)
    except IngestError as e:
        out.fatal.extend(e.problems)
        return out
    rows = _Rows(root.resolve(), allow_external_links)
    classes_file = root / "classes.txt"
    if classes is None and classes_file.is_file():
        classes = [c.strip() for c in classes_file.read_text(encoding="utf-8-sig").splitlines() if c.strip()]
        dup = sorted({c for c in classes if classes.count(c) > 1})
        if dup:
            out.fatal.append(f"{classes_file}: class(es) {dup} listed more than once; list each class once")
    items = _read_voc(root, rows, out.fatal) if layout == "voc" else _read_folder(root, rows, out.fatal)
    if out.fatal:
        return out
    with_masks = sum(it.mask_path is not None for it in items)
    if classes is None and layout == "folder" and with_masks:
        out.fatal.append(f"{classes_file}: missing, but {with_masks} mask(s) come with the source in "
                         f"{root / 'masks'}; mask values are class indices, so list the classes one per line "
                         "in the masks' index order (the sorted tags need not be that order)")
        return out
    if classes is None:
        classes = list(VOC_CLASSES) if layout == "voc" else sorted({t for it in items for t in it.tags})
    known = set(classes)
    src = root / ("Annotations" if layout == "voc" and (root / "Annotations").is_dir() else "labels.csv")
    for it in items:
        at = f" on line {it.line}" if it.line else ""
        unknown = [t for t in it.tags if t not in known]
        if unknown:
            rows.reject(it, f"{src}: image {it.image_id!r} has unknown tag(s) {unknown}{at}; "
                            f"known classes: {', '.join(classes)} (fix the tag or add it to classes.txt)")
        if not it.tags:
            rows.reject(it, f"{src}: image {it.image_id!r} has no tags{at}; give at least one (separated by ';')")
    header = check_headers([it for it in items if not rows.is_rejected(it)], max_pixels=max_pixels,
                           min_side=min_side) if headers else {}
    for it in items:
        for p in header.get(it.image_id, []):
            rows.reject(it, p)
    tagged = {t for it in items for t in it.tags}
    if background == "auto":
        background = classes[0] if classes and classes[0] == "background" and "background" not in tagged else None
    if background is not None and background not in known:
        out.fatal.append(f"background class {background!r} is not among the classes; "
                         "pass --background none or a class name")
        return out
    out.items = [it for it in items if not rows.is_rejected(it)]
    out.rejected = rows.rejected()
    out.listed = rows.listed
    out.classes = ClassSpec(tuple(classes), classes.index(background) if background is not None else None)
    return out


class _Rows:
    """Per-row bookkeeping of a listing: rows rejected with their problems, in source order."""

    def __init__(self, root: Path, allow_external_links: bool):
        self.root, self.allow_links = root, allow_external_links
        self.listed = 0
        self._rejected: dict[int, dict] = {}
        self._row_of: dict[int, int] = {}

    def new_row(self) -> int:
        self.listed += 1
        return self.listed - 1

    def reject_row(self, row: int, image_id: str | None, file: Path, line: int | None, problem: str) -> None:
        entry = self._rejected.setdefault(row, dict(image_id=image_id, file=str(file), line=line, problems=[]))
        entry["problems"].append(problem)

    def add(self, row: int, item: SourceItem) -> SourceItem:
        self._row_of[id(item)] = row
        return item

    def reject(self, item: SourceItem, problem: str) -> None:
        self.reject_row(self._row_of[id(item)], item.image_id, item.image_path, item.line, problem)

    def is_rejected(self, item: SourceItem) -> bool:
        return self._row_of[id(item)] in self._rejected

    def rejected(self) -> list[dict]:
        return [self._rejected[k] for k in sorted(self._rejected)]

    def link_problem(self, path: Path) -> str | None:
        """A problem when ``path`` is (or lies under) a link resolving outside the source folder."""
        if self.allow_links:
            return None
        target = path.resolve()
        if target == self.root or self.root in target.parents:
            return None
        return (f"{path}: a symbolic link to {target}, outside the source folder {self.root}; copy the file into "
                "the source, or pass --allow-external-links if you trust the link")


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
                for line in f.read_text(encoding="utf-8-sig").split():
                    out.setdefault(line.strip(), name)
    return out


def _read_folder(root: Path, rows: _Rows, fatal: list[str]) -> list[SourceItem]:
    splits = _split_files(root)
    items: list[SourceItem] = []
    first_line: dict[str, int] = {}
    labels = root / "labels.csv"
    # utf-8-sig: a spreadsheet's export starts with a byte-order mark
    with open(labels, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        try:
            fieldnames = reader.fieldnames
        except (csv.Error, UnicodeDecodeError) as e:
            fatal.append(f"{labels}: unreadable ({e}); save it as UTF-8 CSV")
            return []
        if not fieldnames or not {"image_id", "labels"} <= {(n or "").strip() for n in fieldnames}:
            fatal.append(f"{labels}: header must contain image_id and labels (optional split), "
                         f"got {fieldnames}; make the first line image_id,labels[,split]")
            return []
        reader.fieldnames = [(n or "").strip() for n in fieldnames]
        header = ",".join(reader.fieldnames)
        while True:
            try:
                row = next(reader)
            except StopIteration:
                break
            except (csv.Error, UnicodeDecodeError) as e:
                fatal.append(f"{labels}:{reader.line_num + 1}: unreadable ({e}); save it as UTF-8 CSV")
                return []
            line_no = reader.line_num
            r = rows.new_row()
            iid = (row["image_id"] or "").strip()
            if any((v or "").strip() for v in row.get(None, [])):  # trailing empty fields are harmless
                n = len(reader.fieldnames) + len(row[None])
                rows.reject_row(r, iid or None, labels, line_no,
                                f"{labels}:{line_no}: {n} fields but the header ({header}) has "
                                f"{len(reader.fieldnames)}; separate tags with ';' (grass;sheep), not ','")
                continue
            if row["labels"] is None:
                rows.reject_row(r, iid or None, labels, line_no,
                                f"{labels}:{line_no}: the labels field is missing (header {header}); "
                                "add the image's tags separated by ';'")
                continue
            if not valid_id(iid):
                rows.reject_row(r, iid or None, labels, line_no,
                                f"{labels}:{line_no}: bad image_id {iid!r} (letters, digits, . _ - only); "
                                "rename the image and its row")
                continue
            if iid in first_line:
                rows.reject_row(r, iid, labels, line_no,
                                f"{labels}:{line_no}: duplicate image_id {iid!r} (first on line {first_line[iid]}); "
                                "keep one row per image")
                continue
            first_line[iid] = line_no
            img = _find_image(root / "images", iid)
            if img is None:
                rows.reject_row(r, iid, root / "images" / f"{iid}.*", line_no,
                                f"{root / 'images' / iid}.*: image file missing (listed in {labels}:{line_no}); "
                                "add the image or remove the row")
                continue
            mask = root / "masks" / f"{iid}.png"
            mask = mask if mask.is_file() else None
            link = rows.link_problem(img) or (rows.link_problem(mask) if mask is not None else None)
            if link:
                rows.reject_row(r, iid, img, line_no, link)
                continue
            tags = tuple(t.strip() for t in row["labels"].split(";") if t.strip())
            split = (row.get("split") or "").strip() or splits.get(iid, "train")
            items.append(rows.add(r, SourceItem.of(iid, img, tags, split, mask, line_no)))
    return items


def _read_voc(root: Path, rows: _Rows, fatal: list[str]) -> list[SourceItem]:
    splits = _split_files(root)
    csv_tags: dict[str, tuple[str, ...]] = {}
    if (root / "labels.csv").is_file():
        with open(root / "labels.csv", newline="", encoding="utf-8-sig") as f:
            for row in csv.DictReader(f):
                csv_tags[(row.get("image_id") or "").strip()] = tuple(
                    t.strip() for t in (row.get("labels") or "").split(";") if t.strip())
    ids = sorted(splits) if splits else sorted(p.stem for p in (root / "JPEGImages").glob("*.jpg"))
    items = []
    for iid in ids:
        r = rows.new_row()
        img = _find_image(root / "JPEGImages", iid)
        if not valid_id(iid):
            rows.reject_row(r, iid, root / "ImageSets", None,
                            f"{root / 'ImageSets'}: bad image id {iid!r} (letters, digits, . _ - only); rename it")
            continue
        if img is None:
            rows.reject_row(r, iid, root / "JPEGImages" / f"{iid}.jpg", None,
                            f"{root / 'JPEGImages' / iid}.jpg: image file missing (listed in ImageSets); "
                            "add the image or remove it from the split file")
            continue
        if iid in csv_tags:
            tags = csv_tags[iid]
        else:
            xml = root / "Annotations" / f"{iid}.xml"
            if not xml.is_file():
                rows.reject_row(r, iid, xml, None, f"{xml}: annotation missing, so image {iid!r} has no tags; "
                                                   "add it or give tags in labels.csv")
                continue
            try:
                tags = tuple(sorted({o.findtext("name").strip() for o in ET.parse(xml).getroot().iter("object")}))
            except (ET.ParseError, AttributeError) as e:
                rows.reject_row(r, iid, xml, None, f"{xml}: unreadable annotation ({e}); fix or remove it")
                continue
        mask = root / "SegmentationClass" / f"{iid}.png"
        mask = mask if mask.is_file() else None
        link = rows.link_problem(img) or (rows.link_problem(mask) if mask is not None else None)
        if link:
            rows.reject_row(r, iid, img, None, link)
            continue
        items.append(rows.add(r, SourceItem.of(iid, img, tags, splits.get(iid, "train"), mask)))
    return items


# ---------------------------------------------------------------------------- headers (no decoding)
@contextmanager
def _no_bomb_limit():
    """Read headers and decode whatever size the caller has already checked against its own
    limit: PIL's global limit would otherwise refuse (or warn) on its own."""
    old = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = None
    try:
        yield
    finally:
        Image.MAX_IMAGE_PIXELS = old


def image_size(path: str | Path) -> tuple[int, int]:
    """(width, height) from the file's header, without decoding pixels; ValueError naming the file."""
    try:
        with _no_bomb_limit(), Image.open(path) as im:
            return im.size
    except (OSError, SyntaxError, ValueError) as e:
        raise ValueError(f"{path}: not a readable image (empty, truncated or unknown format: {e}); "
                         "replace or remove the file") from e


def check_headers(items: Iterable[SourceItem], max_pixels: int = MAX_PIXELS, min_side: int = MIN_SIDE) -> dict[str, list[str]]:
    """Problems of each image (by id) found in its header and its mask's header, without
    decoding: unreadable, more than ``max_pixels`` pixels, a side under ``min_side``, a mask
    that is no palette/grayscale image."""
    out: dict[str, list[str]] = {}
    for it in items:
        problems = []
        try:
            w, h = image_size(it.image_path)
        except ValueError as e:
            problems.append(str(e))
        else:
            if w * h > max_pixels:
                problems.append(
                    f"{it.image_path}: {w}x{h} = {w * h / 1e6:.0f} Mpx (from its header) is above the limit of "
                    f"{max_pixels / 1e6:.1f} Mpx, so it was not decoded (it would take {w * h * 3 / 2**30:.1f} GiB "
                    "per copy); downscale it, or raise --max-pixels if the workers have the memory")
            if min(w, h) < min_side:
                problems.append(f"{it.image_path}: {w}x{h} has a side under the minimum of {min_side} px "
                                "(superpixels and the networks need more); remove or upscale it")
        if it.mask_path is not None:
            try:
                with _no_bomb_limit(), Image.open(it.mask_path) as m:
                    mode = m.mode
            except (OSError, SyntaxError, ValueError) as e:
                problems.append(f"{it.mask_path}: unreadable mask ({e}); replace or remove it")
            else:
                if mode not in MASK_MODES:
                    problems.append(_mask_mode_problem(it.mask_path, mode))
        if problems:
            out[it.image_id] = problems
    return out


# ---------------------------------------------------------------------------- decoding (workers)
def parse_colour(spec: str | Sequence[int]) -> tuple[int, int, int]:
    """An RGB triple from a colour name (``white``), ``#rrggbb``, ``r,g,b`` or a sequence."""
    try:
        if isinstance(spec, str):
            if "," in spec:
                rgb = tuple(int(v) for v in spec.split(","))
            else:
                rgb = tuple(ImageColor.getrgb(spec))[:3]
        else:
            rgb = tuple(int(v) for v in spec)
        if len(rgb) != 3 or not all(0 <= v <= 255 for v in rgb):
            raise ValueError
    except ValueError:
        raise ValueError(f"alpha background {spec!r}: not a colour; give a name (white), #rrggbb or r,g,b "
                         "with values 0..255") from None
    return rgb  # type: ignore[return-value]


def _has_alpha(data: np.ndarray) -> bool:
    try:
        with Image.open(io.BytesIO(data.tobytes())) as im:
            return im.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in im.info
    except (OSError, SyntaxError, ValueError):
        return False


def decode_image(path: str | Path, alpha_background: str | Sequence[int] = ALPHA_BACKGROUND
                 ) -> tuple[np.ndarray, str | None]:
    """(H, W, 3) uint8 RGB and a note when transparent pixels were composited on
    ``alpha_background`` (None otherwise). Images without transparency decode exactly as
    OpenCV's ``IMREAD_COLOR`` does. ValueError naming the file when it cannot be decoded."""
    path = Path(path)
    data = np.fromfile(str(path), np.uint8)
    img = cv2.imdecode(data, cv2.IMREAD_COLOR) if data.size else None
    if img is None:
        raise ValueError(f"{path}: not a readable image (empty, truncated or unknown format); "
                         "replace or remove the file")
    rgb = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
    if not _has_alpha(data):
        return rgb, None
    bg = parse_colour(alpha_background)
    try:
        with _no_bomb_limit(), Image.open(io.BytesIO(data.tobytes())) as im:
            turned = ImageOps.exif_transpose(im)
            rgba = np.asarray(turned.convert("RGBA"))
            if rgba.shape[:2] != rgb.shape[:2]:
                rgba = np.asarray(im.convert("RGBA"))
    except (OSError, SyntaxError, ValueError) as e:
        raise ValueError(f"{path}: transparency could not be read ({e}); save it without alpha") from e
    alpha = rgba[..., 3:].astype(np.uint32)
    n = int((alpha < 255).sum())
    if n == 0 or rgba.shape[:2] != rgb.shape[:2]:
        return rgb, None
    out = (rgba[..., :3].astype(np.uint32) * alpha + np.array(bg, np.uint32) * (255 - alpha) + 127) // 255
    note = (f"{path}: {n} of {alpha.size} pixels are (partly) transparent; composited on the background colour "
            f"{bg} (set it with --alpha-background)")
    return out.astype(np.uint8), note


def load_image(path: Path, alpha_background: str | Sequence[int] = ALPHA_BACKGROUND) -> np.ndarray:
    """(H, W, 3) uint8 RGB; raises ValueError naming the file when it cannot be decoded
    (transparent pixels composited on ``alpha_background``: see :func:`decode_image`)."""
    return decode_image(path, alpha_background)[0]


MASK_MODES = ("P", "L", "I", "I;16")


def _mask_mode_problem(path: Path, mode: str) -> str:
    return (f"{path}: mask must be a palette or grayscale PNG of class indices, got mode {mode}; "
            "save it as an 8-bit palette or grayscale PNG")


def load_mask(path: Path, shape: tuple[int, int], n_classes: int | None = None) -> np.ndarray:
    """(H, W) uint8 class-index mask from a palette or grayscale PNG, checked against the image
    size and, given ``n_classes``, its values (class indices 0..n_classes-1, or 255 = void)."""
    try:
        with _no_bomb_limit(), Image.open(path) as im:
            if im.mode not in MASK_MODES:
                raise ValueError(_mask_mode_problem(path, im.mode))
            m = np.asarray(im)
    except (OSError, SyntaxError) as e:
        raise ValueError(f"{path}: unreadable mask ({e}); replace or remove it") from e
    if m.shape != shape:
        raise ValueError(f"{path}: mask is {m.shape[1]}x{m.shape[0]} but the image is {shape[1]}x{shape[0]}; "
                         "a mask must match its image pixel for pixel")
    values = np.unique(m)
    top = 255 if n_classes is None else n_classes - 1
    bad = [int(v) for v in values if (v > top and v != 255) or v > 255 or v < 0]
    if bad:
        shown = bad[:10] + (["..."] if len(bad) > 10 else [])
        raise ValueError(f"{path}: mask holds value(s) {shown} outside the class indices 0..{top} (255 = void); "
                         "fix the mask, or classes.txt (one class per line in the masks' index order)")
    return m.astype(np.uint8)


# ---------------------------------------------------------------------------- corpus
def corpus_changes(previous: "pa.Table", current: "pa.Table") -> dict[str, list[str]]:
    """How ``current`` (the keys of the manifest an ingest is about to publish:
    :meth:`tasks.store.Store.manifest_keys`) differs from ``previous`` (the run directory's before),
    as lists of image ids in each manifest's order: ``added`` (new ids), ``removed`` (ids no longer
    listed or now rejected), ``changed`` (other file content: sha256) and ``retagged`` (same content,
    other tags or split); the other images are unchanged. Compared column by column in Arrow: about
    130 bytes an image of each manifest are held, not a Python record each.

    >>> import pyarrow as pa
    >>> def keys(*rows):
    ...     return pa.table({"image_id": [r[0] for r in rows], "sha256": [r[1] for r in rows],
    ...                      "tags": [["x"]] * len(rows), "split": ["train"] * len(rows)})
    >>> ch = corpus_changes(keys(("a", "1"), ("b", "2")), keys(("a", "1"), ("c", "3")))
    >>> ch["added"], ch["removed"], ch["changed"], ch["retagged"]
    (['c'], ['b'], [], [])
    """
    import pyarrow.compute as pc

    before = previous["image_id"].combine_chunks()
    ids = current["image_id"].combine_chunks()
    at = pc.index_in(ids, value_set=before)
    added = pc.is_null(at)
    old = previous.take(at)  # a null index takes a null row: an added image's old keys are null

    def differs(column: str) -> "pa.Array":
        a, b = current[column], old[column]
        if pa.types.is_list(a.type):  # tags: compared as one string each (a ';' never is in a tag)
            a, b = pc.binary_join(a, ";"), pc.binary_join(b, ";")
        return pc.fill_null(pc.not_equal(a, b), False)

    changed = differs("sha256")
    retagged = pc.and_(pc.invert(changed), pc.or_(differs("tags"), differs("split")))
    gone = pc.invert(pc.is_in(before, value_set=ids))
    return {"added": ids.filter(added).to_pylist(), "removed": before.filter(gone).to_pylist(),
            "changed": ids.filter(changed).to_pylist(), "retagged": ids.filter(retagged).to_pylist()}


def corpus_summary(store: Store, written: dict, classes: ClassSpec, *, skipped: int, listed: int | None = None,
                   rejected: Sequence[dict] = (), notes: Sequence[str] = (), decoded: int = 0,
                   settings: dict | None = None) -> dict:
    """Publish the corpus manifest the ingest shards' records were written to (in the source's
    order, by :meth:`tasks.store.Store.manifest_writer`; ``written``: its summary) and write the
    ingest report; return the summary: images, skipped, listed, problems, classes, implicit
    background, splits, composited (images with transparency: ``notes``), ``changes`` against the
    run directory's corpus before (counts of :func:`corpus_changes`, ``decoded``: images whose
    pixels were read, the others kept their stored arrays; ``classes`` when the class list changed)
    and the report's path. ``images + skipped == listed``, or RuntimeError. The report lists the ids
    of each change, except on a first ingest, where every image is added.

    Again on a run directory that holds a corpus, only new and changed images were decoded and
    written by the shards; here the removed images leave the corpus, and the round arrays
    (preliminary results, pseudo-labels) of removed, changed and retagged images are dropped,
    so that ``wsseg refresh`` labels them again and nothing stale is evaluated. Only the
    manifests' key columns are held (:func:`corpus_changes`), none on a first ingest."""
    images = written["images"]
    listed = images + skipped if listed is None else listed
    if images + skipped != listed:
        raise RuntimeError(f"ingest counts do not reconcile: {images} ingested + {skipped} rejected "
                           f"!= {listed} listed")
    first = not store.has_corpus()
    before_classes = None if first else store.classes()
    dropped_corrections: list[str] = []
    if first:
        changes: dict[str, list[str]] = {"added": [], "removed": [], "changed": [], "retagged": []}
        counts = {"added": images, "removed": 0, "changed": 0, "retagged": 0, "unchanged": 0}
    else:
        current = store.manifest_keys(staged=True)
        changes = corpus_changes(store.manifest_keys(), current)
        counts = {k: len(v) for k, v in changes.items()}
        counts["unchanged"] = images - counts["added"] - counts["changed"] - counts["retagged"]
        store.drop_labels(changes["removed"] + changes["changed"] + changes["retagged"])
        # a correction is of the pixels and the tags it was made for: kept for a retagged image only
        # while its classes are still among the image's tags (tasks.labels.corrections)
        corrected = store.corrections()
        check = [i for i in changes["retagged"] if i in corrected]
        stale = []
        if check:
            import pyarrow.compute as pc

            rows = current.filter(pc.is_in(current["image_id"], value_set=pa.array(check)))
            bg = {classes.names[classes.background]} if classes.background is not None else set()
            for iid, tags in zip(rows["image_id"].to_pylist(), rows["tags"].to_pylist()):
                if not set(corrected[iid]["classes"]) <= set(tags) | bg:
                    stale.append(iid)
        del current
        dropped_corrections = store.drop_corrections(changes["removed"] + changes["changed"] + stale)
        store.drop_images(changes["removed"])
    store.publish_manifest(classes)
    problems = sum(len(r["problems"]) for r in rejected)
    counts["decoded"] = decoded
    if before_classes is not None and before_classes != classes:
        counts["classes"] = {"before": list(before_classes.names), "now": list(classes.names)}
        from wsseg.tasks.labels.corrections import remap_corrections

        dropped_corrections += remap_corrections(store, before_classes, classes)
    if dropped_corrections:
        counts["corrections_dropped"] = sorted(dropped_corrections)
    report = store.write_ingest_report({
        "listed": listed, "ingested": images, "rejected": skipped, "problems": problems,
        "settings": settings or {}, "changes": counts,
        "changed_images": {} if first else changes,
        "rejected_images": list(rejected), "notes": list(notes)})
    from wsseg.tasks.corpus.tags import contrast_warnings, tag_statistics

    tags = (t for b in store.manifest_batches(columns=["tags"]) for t in b.column("tags").to_pylist())
    warnings = contrast_warnings(tag_statistics(tags, classes.names, classes.background))
    return {"images": images, "skipped": skipped, "classes": len(classes.names),
            "implicit_background": classes.names[classes.background] if classes.background is not None else None,
            "splits": {k: v["images"] for k, v in written["splits"].items()}, "listed": listed,
            "problems": problems, "composited": len(notes), "changes": counts, "warnings": warnings,
            "report": str(report)}
