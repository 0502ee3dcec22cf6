"""A person's corrections in: ``wsseg ingest --run-dir R --corrections PATH``.

``PATH`` is either

* a folder of PNG label maps named ``<image id>.png`` (the ``png`` export's layout: found under
  ``VOCdevkit/VOC2012/SegmentationClass/``, ``SegmentationClass/`` or the folder itself): palette
  or greyscale PNGs of class indices (255 = not labelled), or RGB PNGs in the export's colours
  (``palette.json``); or
* Label Studio's JSON export of a project made from ``wsseg export --format labelstudio``
  (:func:`tasks.labels.labelstudio.read_export`): each task's latest submitted annotation.

A correction is checked against the corpus before it is kept: a known image, its size, class
indices of the class list, and classes among the image's tags (or the implicit background): a
correction that names a class the image is not tagged with is refused with how to retag it.
Each refused file is one line; the others are stored. A correction of an image replaces its
earlier one. Stored corrections are trusted labels from then on: every round's pseudo-label of
the image is the correction, and the MIL and proposal classifiers train on it (see
:func:`corrected_prelim` and :mod:`tasks.wsss.pipeline`).
"""
from __future__ import annotations

import datetime
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from wsseg.tasks.store import ClassSpec, ImageRecord, Store
from wsseg.tasks.store.files import palette

IGNORE = 255


class CorrectionsError(ValueError):
    """A corrections source that cannot be read at all (one line)."""


@dataclass
class Correction:
    """One corrected label map as read from a source (``label`` None when it could not be read:
    ``problem`` says why)."""
    image_id: str | None
    label: np.ndarray | None
    file: str
    problem: str | None = None


# ---------------------------------------------------------------------------- reading
def png_folder(path: Path) -> Path:
    """The folder holding the PNGs of a ``png`` export (or of a plain folder of PNGs)."""
    for sub in (Path("VOCdevkit") / "VOC2012" / "SegmentationClass", Path("SegmentationClass")):
        if (path / sub).is_dir():
            return path / sub
    return path


def _png_label(file: Path, colours: dict[tuple[int, int, int], int]) -> np.ndarray:
    """(H, W) uint8 class indices of one PNG: its indices (palette or greyscale), or its RGB
    colours looked up in ``colours``."""
    from PIL import Image

    with Image.open(file) as im:
        if im.mode in ("P", "L"):
            return np.asarray(im, dtype=np.uint8).copy()
        if im.mode not in ("RGB", "RGBA"):
            raise ValueError(f"a PNG of mode {im.mode}; give class indices (palette or greyscale) or the export's colours")
        rgb = np.asarray(im.convert("RGB"))
    code = (rgb[..., 0].astype(np.int64) << 16) | (rgb[..., 1].astype(np.int64) << 8) | rgb[..., 2]
    values, inverse = np.unique(code, return_inverse=True)
    lut = np.empty(len(values), np.uint8)
    for k, v in enumerate(values.tolist()):
        c = colours.get(((v >> 16) & 255, (v >> 8) & 255, v & 255))
        if c is None:
            raise ValueError(f"colour #{v:06x} is not the colour of a class (palette.json of the png export)")
        lut[k] = c
    return lut[inverse.reshape(code.shape)]


def export_colours(n_classes: int) -> dict[tuple[int, int, int], int]:
    """RGB -> class index of the ``png`` export's colour map (255: the void colour)."""
    pal = palette(max(3, n_classes))
    out = {tuple(pal[3 * i: 3 * i + 3]): i for i in range(n_classes)}
    out[tuple(pal[765:768])] = IGNORE
    return out


def read_png_folder(path: Path, n_classes: int) -> Iterator[Correction]:
    folder = png_folder(path)
    files = sorted(folder.glob("*.png"))
    if not files:
        raise CorrectionsError(f"{path}: no PNG label maps here (nor under VOCdevkit/VOC2012/SegmentationClass "
                               "or SegmentationClass); give the folder of a png export, or a Label Studio JSON export")
    colours = export_colours(n_classes)
    for f in files:
        try:
            yield Correction(f.stem, _png_label(f, colours), str(f))
        except (OSError, ValueError, SyntaxError) as e:
            yield Correction(f.stem, None, str(f), f"{f}: unreadable correction ({e})")


def read_corrections(path: str | os.PathLike, classes: ClassSpec) -> Iterator[Correction]:
    """The corrections of ``path`` (a PNG folder or a Label Studio JSON export), one at a time."""
    path = Path(path)
    if path.is_dir():
        yield from read_png_folder(path, classes.n)
        return
    if not path.is_file():
        raise CorrectionsError(f"{path}: no such file or folder; give a folder of PNG label maps or a Label Studio "
                               "JSON export")
    if path.suffix.lower() != ".json":
        raise CorrectionsError(f"{path}: not a folder of PNGs nor a .json file (Label Studio's JSON export)")
    from wsseg.tasks.labels.labelstudio import read_export

    for image_id, label, problem in read_export(path, classes.names):
        yield Correction(image_id, label, str(path), problem)


# ---------------------------------------------------------------------------- checking and storing
def allowed_names(rec: ImageRecord, classes: ClassSpec) -> set[str]:
    return set(rec.tags) | ({classes.names[classes.background]} if classes.background is not None else set())


def problem_of(c: Correction, rec: ImageRecord | None, classes: ClassSpec) -> str | None:
    """Why correction ``c`` of the image ``rec`` cannot be kept, or None."""
    where = c.file if c.image_id is None or not c.file.endswith(".json") else f"{c.file} (image {c.image_id})"
    if c.problem:
        return c.problem
    if rec is None:
        return f"{where}: image {c.image_id!r} is not in the corpus; corrections are of ingested images"
    if c.label.shape != (rec.height, rec.width):
        return (f"{where}: the label map is {c.label.shape[1]}x{c.label.shape[0]} but image {rec.image_id} is "
                f"{rec.width}x{rec.height}")
    values = set(np.unique(c.label).tolist()) - {IGNORE}
    unknown = sorted(v for v in values if v >= classes.n)
    if unknown:
        return (f"{where}: value(s) {unknown[:10]} are no class index of the {classes.n} classes (0..{classes.n - 1}, "
                f"255 = not labelled)")
    if not values:
        return f"{where}: every pixel is 255 (not labelled); nothing to correct"
    untagged = sorted(classes.names[v] for v in values if classes.names[v] not in allowed_names(rec, classes))
    if untagged:
        return (f"{where}: class(es) {', '.join(untagged)} are not among image {rec.image_id}'s tags "
                f"({', '.join(rec.tags) or 'none'}); add them to its tags in labels.csv and ingest again")
    return None


def ingest_corrections(store: Store, path: str | os.PathLike, progress=None) -> dict:
    """Check and store the corrections of ``path`` (see the module docstring); returns
    ``stored`` (image ids), ``replaced`` (those that had a correction before), ``refused``
    (one line each), ``total`` (corrected images in the run now) and ``digest``."""
    if not store.has_corpus():
        raise CorrectionsError(f"{store.root}: no corpus here; ingest the images before their corrections")
    classes = store.classes()
    records = {r.image_id: r for r in store.manifest()}
    index = store.corrections()
    stored, replaced, refused = [], [], []
    at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    for c in read_corrections(path, classes):
        problem = problem_of(c, records.get(c.image_id), classes)
        if progress is not None:
            progress()
        if problem:
            refused.append(problem)
            continue
        sha = hashlib.sha256(np.ascontiguousarray(c.label).tobytes()).hexdigest()
        names = sorted(classes.names[v] for v in set(np.unique(c.label).tolist()) - {IGNORE})
        info = {"file": c.file, "sha256": sha, "at": at, "classes": names}
        store.put_correction(c.image_id, c.label, info)
        if c.image_id in index:
            replaced.append(c.image_id)
        index[c.image_id] = info
        stored.append(c.image_id)
    if stored:
        store.write_corrections(index)
    return {"stored": stored, "replaced": replaced, "refused": refused, "total": len(index),
            "digest": corrections_digest(index)}


def corrections_digest(index: dict[str, dict]) -> str | None:
    """A short digest of a run's corrections (ids and contents): part of every round's inputs, so
    that rounds computed before a correction are computed again. None without corrections."""
    if not index:
        return None
    h = hashlib.sha256()
    for iid in sorted(index):
        h.update(f"{iid}\t{index[iid]['sha256']}\n".encode())
    return h.hexdigest()[:16]


def corrections_entry(store: Store, records: Iterable[ImageRecord]) -> dict | None:
    """The corrections of ``records`` (a list, or a split's rows streamed) as a round's input (count
    and digest), None without any."""
    every = store.corrections()
    if not every:
        return None
    ids = {rec.image_id for rec in records if rec.image_id in every}  # the corrected ones only: streamed rows stay so
    index = {k: v for k, v in every.items() if k in ids}
    return {"images": len(index), "digest": corrections_digest(index)} if index else None


def remap_corrections(store: Store, before: ClassSpec, now: ClassSpec) -> list[str]:
    """After the class list changed from ``before`` to ``now``: each correction's class indices
    moved to the new list by name; corrections with a class no longer listed are dropped
    (returned)."""
    index = store.corrections()
    lut = np.full(256, IGNORE, np.uint8)
    for i, name in enumerate(before.names):
        lut[i] = now.names.index(name) if name in now.names else IGNORE
    dropped = [iid for iid, e in index.items() if not set(e["classes"]) <= set(now.names)]
    for iid, info in index.items():
        if iid in dropped:
            continue
        label = store.correction(iid)
        if label is not None:
            store.put_correction(iid, lut[label], info)
    store.drop_corrections(dropped)
    return dropped


# ---------------------------------------------------------------------------- in the rounds
def corrected_prelim(label: np.ndarray, prob: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """(K, H, W) probabilities of a corrected image: one-hot of its correction ``label`` where it
    labels a pixel, ``prob`` (the round's own preliminary result) where it is 255. What the MIL
    and proposal classifiers train on and fusion starts from."""
    out = prob.copy()
    known = label != IGNORE
    idx = np.flatnonzero(allowed)
    out[idx] = np.where(known[None], (label[None] == idx[:, None, None]).astype(np.float32), prob[idx])
    return out


def summary_line(result: dict) -> str:
    return (f"stored {len(result['stored'])} correction(s) ({len(result['replaced'])} replacing earlier ones), "
            f"refused {len(result['refused'])}; {result['total']} corrected image(s) in the run")
