"""``wsseg export``: a round's pseudo-labels as the files other tools read.

* ``png``: the PASCAL VOC 2012 layout under ``OUT/VOCdevkit/VOC2012`` (what torchvision's
  ``VOCSegmentation(OUT, image_set=...)`` and mmsegmentation's ``PascalVOCDataset`` read):
  ``SegmentationClass/<id>.png`` (8-bit palette PNG of class indices, 255 = ignore, the VOC
  colour map), ``JPEGImages/<id>.jpg`` (the corpus's pixels, JPEG quality 95; ``images=False``
  leaves them out), ``ImageSets/Segmentation/<split>.txt`` per split of the corpus and
  ``trainval.txt`` with every exported image, ``classes.txt`` (one name per index) and
  ``palette.json`` (name -> RGB).
* ``coco``: ``OUT/labels.json`` in the COCO-stuff layout for semantic labels: one annotation per
  class present in an image, its mask as compressed RLE (pycocotools), its area and box;
  categories are the class list (``id`` = class index + 1); ignored pixels carry no
  annotation. ``OUT/images/<id>.jpg`` beside it (unless ``images=False``).
* ``labelstudio``: ``OUT/tasks.json``, one Label Studio task per image with the labels as a
  prediction (one brush per class present, Label Studio's brush RLE; ignored pixels carry none),
  ``OUT/labeling_config.xml`` (the project's labelling interface: a brush label per class in
  colours told apart on photos, :func:`tasks.labels.labelstudio.label_colours`) and
  ``OUT/images/<id>.jpg``, which the tasks name by Label Studio's local-files URL with ``OUT`` as
  the document root (:mod:`tasks.labels.labelstudio`, whose ``read_export`` reads
  a project's JSON export back).

All stream: the manifest is read a Parquet batch at a time, one image's labels are held at a
time, the VOC split lists are written as the images are, the COCO file's images and annotations
are written to two scratch files and joined at the end, Label Studio's tasks are written one a
line, so memory does not grow with the corpus (``--review N`` holds the queue's N records).
Every export names the round and the run's configuration digest (``export.json``, and the
COCO file's ``info``). It is written to ``OUT.partial`` and renamed to ``OUT`` when complete:
an export cut short is never taken for a whole one.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
from collections import Counter
from pathlib import Path
from typing import IO, Callable, Iterable, Iterator

import numpy as np

from wsseg.tasks.labels.formats import FORMATS
from wsseg.tasks.runtime.progress import Progress
from wsseg.tasks.store import ImageRecord, Store, params_key
from wsseg.tasks.store.files import palette, write_jpeg, write_palette_png

IGNORE = 255
#: where the VOC layout lies under the export folder (torchvision's ``VOCSegmentation(root)``)
VOC_DIR = Path("VOCdevkit") / "VOC2012"


class ExportError(ValueError):
    """What cannot be exported, in one line (the CLI prints it as ``wsseg: error: ...``)."""


def export_round(store: Store, which: str | int) -> int:
    """The round ``which`` names: ``"final"`` (the finished run's final round, summary.json) or
    a round index whose labels are finished (round.json written)."""
    finished = store.finished_rounds()
    listed = ", ".join(map(str, finished)) or "none"
    if which == "final":
        summary = store.read_summary()
        if summary is None or summary.get("final_round") is None:
            raise ExportError(f"{store.root}: the run has not finished (no {store.summary_path.name}), so no "
                              f"round's labels are final; finish it with `wsseg train --run-dir {store.root}`, or export a finished round "
                              f"with --round N (finished rounds: {listed})")
        r = int(summary["final_round"])
        if r not in finished:
            raise ExportError(f"{store.summary_path} names round {r} final, but that round is not finished "
                              f"(finished rounds: {listed}); run `wsseg train --run-dir {store.root}` again")
        return r
    try:
        r = int(which)
    except ValueError:
        raise ExportError(f"--round {which!r}: give 'final' or a round number") from None
    if r not in finished:
        raise ExportError(f"{store.root}: round {r} has no finished labels (finished rounds: {listed})")
    return r


def config_digest(store: Store) -> str | None:
    """A short digest of the run's configuration (config.json), which names what made the labels;
    where the work ran is no part of it (scope RUNTIME of :data:`tasks.config.OPTIONS`, an older record's too)."""
    from wsseg.tasks.config import recorded_config

    config = recorded_config(store.read_config())
    return params_key(config) if config is not None else None


def _labels(store: Store, r: int, records: Iterable[ImageRecord], missing: Counter,
            advance: Callable[[], None]) -> Iterator[tuple[ImageRecord, np.ndarray]]:
    """Round ``r``'s label map of each of ``records`` that has one (each read once); those without
    are counted in ``missing`` by split (the rounds label the tagged split only). ``advance`` after
    each record, once it is written. ``records`` may be the manifest streamed: nothing is kept
    per image."""
    for rec in records:
        label = store.pseudo(r, rec.image_id)
        if label is None:
            missing[rec.split] += 1
        else:
            yield rec, label
        advance()


def _write_voc(store: Store, r: int, records: Iterable[ImageRecord], missing: Counter, dest: Path,
               images: bool, advance: Callable[[], None]) -> dict:
    voc = dest / VOC_DIR
    sets = voc / "ImageSets" / "Segmentation"
    (voc / "SegmentationClass").mkdir(parents=True)
    sets.mkdir(parents=True)
    if images:
        (voc / "JPEGImages").mkdir()
    classes = store.classes()
    pal = palette(max(3, classes.n))  # the VOC colour map (index 255: VOC's void colour)
    splits: dict[str, int] = {}  # images a split's list holds, the splits in the order first met
    with contextlib.ExitStack() as stack:  # each split's list written as the images are: nothing held per image
        lists: dict[str, IO[str]] = {}
        for rec, label in _labels(store, r, records, missing, advance):
            write_palette_png(voc / "SegmentationClass" / f"{rec.image_id}.png", label.shape[0], label.shape[1],
                              [label], pal)
            if images:
                write_jpeg(voc / "JPEGImages" / f"{rec.image_id}.jpg", store.image(rec.image_id))
            split = rec.split or "train"
            if split not in lists:
                lists[split] = stack.enter_context(open(sets / f"{split}.txt", "w"))
            lists[split].write(f"{rec.image_id}\n")
            splits[split] = splits.get(split, 0) + 1
    with open(sets / "trainval.txt", "wb") as trainval:  # the split lists one after another
        for split in splits:
            with open(sets / f"{split}.txt", "rb") as f:
                shutil.copyfileobj(f, trainval)
    (voc / "classes.txt").write_text("".join(f"{n}\n" for n in classes.names))
    (voc / "palette.json").write_text(json.dumps(
        {n: pal[3 * i: 3 * i + 3] for i, n in enumerate(classes.names)} | {"ignore (255)": pal[765:768]}, indent=1))
    return {"layout": str(VOC_DIR), "images": sum(splits.values()), "splits": splits}


def _rle(mask: np.ndarray) -> dict:
    from pycocotools import mask as cocomask

    rle = cocomask.encode(np.asfortranarray(mask.astype(np.uint8)))
    area = int(cocomask.area(rle))
    box = [float(v) for v in cocomask.toBbox(rle)]
    return {"segmentation": {"size": [int(v) for v in rle["size"]], "counts": rle["counts"].decode("ascii")},
            "area": area, "bbox": box}


def _write_coco(store: Store, r: int, records: Iterable[ImageRecord], missing: Counter, dest: Path,
                images: bool, info: dict, advance: Callable[[], None]) -> dict:
    classes = store.classes()
    if images:
        (dest / "images").mkdir(parents=True)
    scratch_images, scratch_anns = dest / ".images.jsonl", dest / ".annotations.jsonl"
    n_ann = k = 0
    with open(scratch_images, "w") as fi, open(scratch_anns, "w") as fa:
        for k, (rec, label) in enumerate(_labels(store, r, records, missing, advance), start=1):
            fi.write(json.dumps({"id": k, "file_name": f"{rec.image_id}.jpg", "height": int(label.shape[0]),
                                 "width": int(label.shape[1]), "wsseg_image_id": rec.image_id,
                                 "split": rec.split}) + "\n")
            for c in np.unique(label).tolist():
                if c == IGNORE:
                    continue
                n_ann += 1
                fa.write(json.dumps({"id": n_ann, "image_id": k, "category_id": int(c) + 1, "iscrowd": 0,
                                     **_rle(label == c)}) + "\n")
            if images:
                write_jpeg(dest / "images" / f"{rec.image_id}.jpg", store.image(rec.image_id))
    categories = [{"id": i + 1, "name": n, "supercategory": "background" if i == classes.background else "class"}
                  for i, n in enumerate(classes.names)]
    with open(dest / "labels.json", "w") as out:  # the two lists copied line by line: nothing held whole
        out.write('{"info": ' + json.dumps(info) + ', "licenses": [], "categories": ' + json.dumps(categories))
        for key, scratch in (("images", scratch_images), ("annotations", scratch_anns)):
            out.write(f', "{key}": [')
            with open(scratch) as f:
                for i, line in enumerate(f):
                    out.write(("," if i else "") + line.rstrip("\n"))
            out.write("]")
        out.write("}\n")
    scratch_images.unlink()
    scratch_anns.unlink()
    return {"file": "labels.json", "images": k, "annotations": n_ann, "categories": len(categories)}


def _write_labelstudio(store: Store, r: int, records: Iterable[ImageRecord], missing: Counter, dest: Path,
                      images: bool, info: dict, advance: Callable[[], None]) -> dict:
    from wsseg.tasks.labels.labelstudio import HOW_TO_OPEN, label_colours, write_tasks

    classes = store.classes()
    colours = label_colours(classes.n)  # told apart on photos (VOC's colours are not: black, near twins)
    version = f"wsseg round {r} {info['config_digest']}"
    labels = ((rec.image_id, label) for rec, label in _labels(store, r, records, missing, advance))
    written = write_tasks(labels, dest, list(classes.names), colours, version,
                          (lambda i, path: write_jpeg(path, store.image(i))) if images else None)
    return written | {"open_with": HOW_TO_OPEN.format(out=Path(info["out"]).resolve())}


def export_labels(store: Store, out: str | os.PathLike, *, which: str | int = "final", fmt: str = "png",
                  images: bool = True, force: bool = False, review: int | None = None) -> dict:
    """Export round ``which``'s pseudo-labels of every image that has them to folder ``out`` in
    format ``fmt`` (see the module's docstring); returns what was written (also ``out/export.json``).
    ``review``: only the ``review`` images at the top of the round's review queue
    (:func:`tasks.labels.review.review_table`: the labels most likely wrong), in queue order.

    Raises :class:`ExportError` (one line) for a run without a corpus, a round that is not finished,
    an unknown format, or an ``out`` that exists and is not an earlier export (``force`` replaces an
    earlier export)."""
    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r}: one of {', '.join(FORMATS)}")
    if not store.has_corpus():
        raise ExportError(f"{store.root}: no corpus here (run `wsseg ingest` and `wsseg train` first)")
    r = export_round(store, which)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        if not (out / "export.json").is_file():
            raise ExportError(f"{out}: exists and is not an earlier export; give an empty or new folder")
        if not force:
            raise ExportError(f"{out}: holds an earlier export; --force replaces it")
    # the manifest streamed, a Parquet batch at a time: an export's memory does not grow with the corpus
    records: Iterable[ImageRecord] = store.split_rows(None)
    missing: Counter = Counter()  # images without labels, by split
    if review is not None:
        from wsseg.tasks.labels.review import review_table

        if review < 1:
            raise ExportError(f"--review {review}: give how many of the review queue's top images to export (1 or more)")
        queue = [x["image_id"] for x in review_table(store, r, top=review, measure=False)["rows"]]
        wanted = set(queue)
        by_id = {rec.image_id: rec for rec in store.manifest_records() if rec.image_id in wanted}
        records = [by_id[i] for i in queue if i in by_id]
    digest = config_digest(store)
    info = {"description": f"wsseg pseudo-labels of round {r}" + (f", the review queue's top {review}"
                                                                  if review is not None else ""),
            "run_dir": str(store.root), "round": r, "review_top": review,
            "config_digest": digest, "format": fmt,
            "date_created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # what an export cut short left
    partial.mkdir(parents=True)
    prog = Progress(f"export {fmt}", len(records))
    step = max(1, min(256, len(records) // 20))  # about 20 progress lines
    seen = 0

    def advance() -> None:  # after each image looked at (labelled or not)
        nonlocal seen
        seen += 1
        if seen % step == 0:
            prog.advance(step)

    try:
        if fmt == "png":
            written = _write_voc(store, r, records, missing, partial, images, advance)
        elif fmt == "coco":
            written = _write_coco(store, r, records, missing, partial, images, info, advance)
        else:
            written = _write_labelstudio(store, r, records, missing, partial, images, info | {"out": str(out)},
                                         advance)
        if seen % step:
            prog.advance(seen % step)
        if not written["images"]:
            raise ExportError(f"{store.root}: round {r} has labels of no image")
        result = info | {"images_without_labels": sum(missing.values()), "classes": list(store.classes().names),
                         "with_images": images, **written}
        (partial / "export.json").write_text(json.dumps(result, indent=1))
        if out.exists():
            shutil.rmtree(out)
        partial.rename(out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return result | {"out": str(out), "missing_splits": sorted(missing)}
