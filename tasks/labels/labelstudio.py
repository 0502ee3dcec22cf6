"""Label Studio: a round's pseudo-labels as its tasks with predictions, and its JSON export read back.

* :func:`brush_rle_encode` / :func:`brush_rle_decode`: Label Studio's brush RLE (what a
  ``BrushLabels`` result's ``value.rle`` holds). It is thi-ng's ``rle-pack`` applied to the
  mask's flattened RGBA image (``H * W * 4`` bytes, row by row): a 32-bit count of values, the word
  size less one in 5 bits (8 here), four run-length field sizes less one in 4 bits each
  (``[3, 4, 8, 16]``), then runs: a repeat bit, a 2-bit index into the field sizes, the run length
  less one in that many bits, then one word (a repeated run) or ``length`` words (a literal run);
  bits most significant first, the last byte padded with zeros. A mask pixel is written as 255 in
  all four channels (what label-studio-converter writes); read back, a pixel is set where its alpha
  byte is above 0 (the alpha channel is what label-studio-converter's ``decode_from_annotation``
  reads; Label Studio's editor paints RGBA in the label's colour).
* :func:`label_colours`: the brush colours of the labelling configuration, told apart on photos
  (not the ``png`` export's VOC colours: VOC's class 0 is black, whose brush only darkens the image,
  and several of its colours are near twins such as msrc21's ``road`` and ``tree``, two greens).
* :func:`labeling_config`: the project's labelling configuration, one ``BrushLabels`` label per
  class in :func:`label_colours`.
* :func:`write_tasks`: the export (``wsseg export --format labelstudio``): ``OUT/tasks.json``, one
  task per image with the round's labels as a prediction (one brush per class present; ignored
  pixels carry none), ``OUT/labeling_config.xml`` and ``OUT/images/<id>.jpg``. A task's image is
  Label Studio's local-files URL of ``images/<id>.jpg`` relative to ``OUT``: Label Studio serves it
  when started with ``LABEL_STUDIO_LOCAL_FILES_SERVING_ENABLED=true`` and
  ``LABEL_STUDIO_LOCAL_FILES_DOCUMENT_ROOT=OUT`` and once the project has a local storage whose
  path is ``OUT/images`` (see :data:`HOW_TO_OPEN`).
* :func:`read_export`: a project's JSON export (tasks with the annotations people made) back to
  label maps, task by task, with a one-line problem for what cannot be read.
"""
from __future__ import annotations

import datetime
import functools
import json
import os
from pathlib import Path
from typing import Callable, Iterable, Iterator
from urllib.parse import quote
from xml.sax.saxutils import quoteattr

import numpy as np

IGNORE = 255
WORD_SIZE = 8
RLE_SIZES = (3, 4, 8, 16)
#: the labelling configuration's tag names (a result's ``from_name`` / ``to_name``)
FROM_NAME, TO_NAME = "label", "image"
#: how a person opens an export in Label Studio; ``{out}`` is the export folder (absolute)
HOW_TO_OPEN = ("LABEL_STUDIO_LOCAL_FILES_SERVING_ENABLED=true LABEL_STUDIO_LOCAL_FILES_DOCUMENT_ROOT={out} "
               "label-studio start --internal-host 127.0.0.1 --port 8080; create a project with labeling_config.xml "
               "as its labelling interface (Settings > Labeling Interface > Code), add a source storage (Settings > "
               "Cloud Storage > Add Source Storage > Local Files) with the absolute path {out}/images and Save it "
               "without syncing it, then import tasks.json (step by step: docs/labels.md)")

_HEADER_BITS = 32 + 5 + 4 * len(RLE_SIZES)


def _bits(values: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """The bits of each ``values[i]`` in ``widths[i]`` bits, most significant first, all concatenated."""
    top = int(widths.max()) if len(widths) else 0
    shifts = np.arange(top - 1, -1, -1, dtype=np.uint64)
    table = (values.astype(np.uint64)[:, None] >> shifts[None, :]) & np.uint64(1)
    keep = np.arange(top)[None, :] >= (top - widths)[:, None]  # the low widths[i] bits of row i
    return table[keep].astype(np.uint8)


def brush_rle_encode(mask: np.ndarray) -> list[int]:
    """Label Studio's brush RLE of an (H, W) boolean mask: its RGBA image with set pixels 255 in
    every channel, as a list of byte values (what ``value.rle`` holds). Vectorised: the runs of
    the mask are the runs of the RGBA bytes, four times as long; a run longer than 2**16 values is
    split in several."""
    flat = np.ascontiguousarray(mask, dtype=bool).ravel()
    num = 4 * flat.size
    if flat.size:
        edges = np.flatnonzero(flat[1:] != flat[:-1]) + 1
        starts = np.concatenate([[0], edges])
        lengths = 4 * np.diff(np.concatenate([starts, [flat.size]]))
        words = np.where(flat[starts], 255, 0)
        longest = 1 << RLE_SIZES[-1]
        pieces = -(-lengths // longest)  # a run of more than 2**16 values goes in several
        k = np.arange(pieces.sum()) - np.repeat(np.cumsum(pieces) - pieces, pieces)  # the piece's index in its run
        words = np.repeat(words, pieces)
        lengths = np.minimum(np.repeat(lengths, pieces) - longest * k, longest)
    else:
        words = lengths = np.zeros(0, np.int64)
    sizes = np.asarray(RLE_SIZES)
    index = np.searchsorted(1 << sizes, lengths, side="left")  # the smallest field that holds length - 1
    field = sizes[index] if len(index) else np.zeros(0, np.int64)
    width = 1 + 2 + field + WORD_SIZE
    code = ((1 << (2 + field + WORD_SIZE)) | (index << (field + WORD_SIZE)) | ((lengths - 1) << WORD_SIZE) | words)
    header = _bits(np.array([num, WORD_SIZE - 1, *[s - 1 for s in RLE_SIZES]]),
                   np.array([32, 5] + [4] * len(RLE_SIZES)))
    bits = np.concatenate([header, _bits(code, width)]) if len(code) else header
    return np.packbits(bits).tolist()


def brush_rle_decode(rle: Iterable[int], height: int, width: int) -> np.ndarray:
    """The (H, W) boolean mask of a Label Studio brush RLE: a pixel is set where its alpha byte is
    above 0. Raises ``ValueError`` (one line) for an RLE that does not decode or whose count of
    values is not ``height * width * 4``."""
    data = np.asarray(rle, dtype=np.int64)
    if data.ndim != 1 or (data.size and (data.min() < 0 or data.max() > 255)):
        raise ValueError("the RLE is not a list of byte values")
    bits = np.unpackbits(data.astype(np.uint8))
    if bits.size < _HEADER_BITS:
        raise ValueError(f"the RLE is {data.size} bytes, shorter than its header")
    pos = 0

    def read(n: int) -> int:
        nonlocal pos
        if pos + n > bits.size:
            raise ValueError(f"the RLE ends in the middle of a run (bit {pos} of {bits.size})")
        v = 0
        for b in bits[pos: pos + n].tolist():
            v = (v << 1) | b
        pos += n
        return v

    num = read(32)
    word = read(5) + 1
    sizes = [read(4) + 1 for _ in range(4)]
    if num != height * width * 4:
        raise ValueError(f"the RLE holds {num} values, not {height}x{width}x4 = {height * width * 4}")
    if word > 8:
        raise ValueError(f"the RLE's words are {word} bits, not bytes")
    weights = 1 << np.arange(word - 1, -1, -1)
    out = np.empty(num, np.uint8)
    i = 0
    while i < num:
        repeat = read(1)
        j = i + 1 + read(sizes[read(2)])
        if j > num:
            raise ValueError(f"the RLE's runs cover more than its {num} values")
        if repeat:
            out[i:j] = read(word)
        else:
            n = (j - i) * word
            if pos + n > bits.size:
                raise ValueError(f"the RLE ends in the middle of a run (bit {pos} of {bits.size})")
            out[i:j] = bits[pos: pos + n].reshape(j - i, word) @ weights
            pos += n
        i = j
    return out.reshape(height, width, 4)[:, :, 3] > 0


#: the brush colours' bounds in CIELAB (D65): lightness (no near-black, whose brush only darkens
#: the image; no pale colour, which vanishes on a bright sky or wall and, as the region list's text
#: on white, cannot be read) and chroma (no greys, read as shading on a photo)
COLOUR_LIGHTNESS = (35.0, 70.0)
COLOUR_MIN_CHROMA = 30.0


@functools.lru_cache(maxsize=8)
def _colour_order(n: int) -> tuple[tuple[int, int, int], ...]:
    from skimage.color import deltaE_ciede2000, rgb2lab

    levels = np.arange(0, 256, 15)  # 18 levels a channel, 0 and 255 among them
    rgb = np.stack(np.meshgrid(levels, levels, levels, indexing="ij"), -1).reshape(-1, 3)
    lab = rgb2lab(rgb[None] / 255.0)[0]
    chroma = np.hypot(lab[:, 1], lab[:, 2])
    keep = (lab[:, 0] >= COLOUR_LIGHTNESS[0]) & (lab[:, 0] <= COLOUR_LIGHTNESS[1]) & (chroma >= COLOUR_MIN_CHROMA)
    rgb, lab, chroma = rgb[keep], lab[keep], chroma[keep]
    pick = [int(np.argmax(chroma))]  # the most vivid first, then each the farthest from those picked
    nearest = deltaE_ciede2000(lab, np.broadcast_to(lab[pick[0]], lab.shape))
    for _ in range(n - 1):
        pick.append(int(np.argmax(nearest)))
        nearest = np.minimum(nearest, deltaE_ciede2000(lab, np.broadcast_to(lab[pick[-1]], lab.shape)))
    return tuple(tuple(int(v) for v in rgb[i]) for i in pick)


def label_colours(n: int) -> list[tuple[int, int, int]]:
    """``n`` brush colours (RGB) that a person tells apart on a photo, class ``i`` the ``i``-th.

    The candidates are an sRGB grid (18 levels a channel) within CIELAB lightness
    :data:`COLOUR_LIGHTNESS` and chroma at least :data:`COLOUR_MIN_CHROMA`; the first is the most
    vivid, each next one the candidate farthest, by CIEDE2000, from the nearest of those before
    (greedy farthest-point), so the list is deterministic and a class's colour does not depend on
    how many classes follow it. The smallest CIEDE2000 between two of them: 17.3 for 21 classes
    (msrc21), 14.0 for 30, 9.1 for 80 and 9.0 for 81 (COCO's and a background), where about 1 is
    the least difference a person sees side by side and from 2 to 10 one seen at a glance
    (tests/test_labelstudio.py)."""
    if n <= 0:
        return []
    return list(_colour_order(max(n, 32))[:n])  # one computation serves every class list up to 32


def labeling_config(class_names: Iterable[str], colours: Iterable[tuple[int, int, int]]) -> str:
    """The labelling configuration (XML) of a project for these classes: an image and one brush
    label per class, in ``colours`` (RGB)."""
    labels = "".join(f'    <Label value={quoteattr(n)} background="#{r:02x}{g:02x}{b:02x}"/>\n'
                     for n, (r, g, b) in zip(class_names, colours))
    return (f'<View>\n  <Image name="{TO_NAME}" value="$image" zoom="true"/>\n'
            f'  <BrushLabels name="{FROM_NAME}" toName="{TO_NAME}">\n{labels}  </BrushLabels>\n</View>\n')


def image_url(relative: str) -> str:
    """Label Studio's URL of a file served from its local-files document root."""
    return "/data/local-files/?d=" + quote(relative, safe="/")


def task(image_id: str, label: np.ndarray, class_names: list[str], model_version: str, url: str) -> dict:
    """One Label Studio task: the image and ``label`` (class indices, 255 = ignore) as a prediction,
    one brush per class present."""
    h, w = (int(v) for v in label.shape)
    result = [{"id": f"wsseg-{c}", "from_name": FROM_NAME, "to_name": TO_NAME, "type": "brushlabels",
               "original_width": w, "original_height": h, "image_rotation": 0,
               "value": {"format": "rle", "rle": brush_rle_encode(label == c), "brushlabels": [class_names[c]]}}
              for c in np.unique(label).tolist() if c != IGNORE]
    return {"data": {"image": url, "wsseg_image_id": image_id, "wsseg_height": h, "wsseg_width": w},
            "predictions": [{"model_version": model_version, "result": result}]}


def write_tasks(labels: Iterable[tuple[str, np.ndarray]], dest: Path, class_names: list[str],
                colours: list[tuple[int, int, int]], model_version: str,
                write_image: Callable[[str, Path], None] | None) -> dict:
    """Write ``dest/tasks.json`` (a JSON list, one task a line, written as ``labels`` yields),
    ``dest/labeling_config.xml`` and, with ``write_image``, ``dest/images/<id>.jpg`` (``write_image(id,
    path)``); returns what was written."""
    (dest / "labeling_config.xml").write_text(labeling_config(class_names, colours))
    if write_image is not None:
        (dest / "images").mkdir(parents=True, exist_ok=True)
    k = n_results = 0
    with open(dest / "tasks.json", "w") as out:
        out.write("[")
        for k, (image_id, label) in enumerate(labels, start=1):
            t = task(image_id, label, class_names, model_version, image_url(f"images/{image_id}.jpg"))
            n_results += len(t["predictions"][0]["result"])
            out.write(("," if k > 1 else "") + "\n" + json.dumps(t, separators=(",", ":")))
            if write_image is not None:
                write_image(image_id, dest / "images" / f"{image_id}.jpg")
        out.write("\n]\n")
    return {"file": "tasks.json", "images": k, "annotations": n_results, "categories": len(class_names),
            "labeling_config": "labeling_config.xml", "model_version": model_version}


def _when(annotation: dict) -> tuple:
    stamp = annotation.get("updated_at") or annotation.get("created_at")
    try:
        t = datetime.datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp() if stamp else 0.0
    except ValueError:
        t = 0.0
    return t, annotation.get("id") or 0


def _label_map(task: dict, annotation: dict, class_names: list[str]) -> np.ndarray:
    """The annotation's label map; raises ``ValueError`` (one line) for what cannot be read."""
    index = {n: i for i, n in enumerate(class_names)}
    data = task.get("data") or {}
    size = (data.get("wsseg_height"), data.get("wsseg_width"))
    label = best = None
    for r in annotation.get("result") or []:
        kind = r.get("type")
        if kind != "brushlabels":
            raise ValueError(f"a {kind!r} result (from {r.get('from_name')!r}): only brushlabels are read")
        value = r.get("value") or {}
        names = value.get("brushlabels") or []
        if len(names) != 1:
            raise ValueError(f"a brush with {len(names)} labels ({names}), not one")
        if names[0] not in index:
            raise ValueError(f"unknown class {names[0]!r} (the run's classes: {', '.join(class_names)})")
        if value.get("format", "rle") != "rle" or "rle" not in value:
            raise ValueError(f"a {names[0]!r} brush in format {value.get('format')!r}, not rle")
        hw = (r.get("original_height"), r.get("original_width"))
        if not all(isinstance(v, int) and v > 0 for v in hw):
            raise ValueError(f"a {names[0]!r} brush without its image size")
        if size[0] is None:
            size = hw
        elif hw != size:
            raise ValueError(f"a {names[0]!r} brush of a {hw[0]}x{hw[1]} image, not {size[0]}x{size[1]}")
        try:
            mask = brush_rle_decode(value["rle"], *hw)
        except (ValueError, TypeError) as e:
            raise ValueError(f"the {names[0]!r} brush's RLE: {e}") from None
        if label is None:
            label = np.full(hw, IGNORE, np.uint8)
        label[mask] = index[names[0]]  # brushes that overlap: the later one's pixels
    if label is None:
        if not all(isinstance(v, int) and v > 0 for v in size):
            raise ValueError("the annotation has no brush and the task no image size (wsseg_height/width)")
        label = np.full(size, IGNORE, np.uint8)  # every brush removed: nothing is known here
    return label


def read_export(path: str | os.PathLike, class_names: Iterable[str]
                ) -> Iterator[tuple[str | None, np.ndarray | None, str | None]]:
    """The label maps of a Label Studio project's JSON export (``Export > JSON``, or
    ``/api/projects/<id>/export?exportType=JSON``): per task that has an annotation that was not
    cancelled, ``(wsseg_image_id, label map, None)`` from its latest one (by ``updated_at``, then
    ``id``); the label map is (H, W) uint8 of indices into ``class_names``, 255 where no brush
    lies (where brushes overlap, the later one's class). Tasks without such an annotation are
    passed over. A task that cannot be read gives ``(wsseg_image_id or None, None, problem)``,
    the problem in one line naming the file and the task. Raises ``ValueError`` (one line) for a
    file that is not such an export."""
    path = Path(path)
    class_names = list(class_names)
    try:
        with open(path) as f:
            tasks = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a Label Studio JSON export ({e})") from None
    if not isinstance(tasks, list):
        raise ValueError(f"{path}: not a Label Studio JSON export (a list of tasks); "
                         f"export the project as JSON, not JSON_MIN or another format")
    for n, t in enumerate(tasks):
        if not isinstance(t, dict):
            yield None, None, f"{path}: item {n} is not a task"
            continue
        where = f"{path}: task {t.get('id', f'#{n}')}"
        annotations = [a for a in t.get("annotations") or [] if isinstance(a, dict) and not a.get("was_cancelled")]
        if not annotations:
            continue
        image_id = (t.get("data") or {}).get("wsseg_image_id")
        if not isinstance(image_id, str) or not image_id:
            yield None, None, f"{where}: no data.wsseg_image_id (not a task of a wsseg export)"
            continue
        latest = max(annotations, key=_when)
        try:
            yield image_id, _label_map(t, latest, class_names), None
        except ValueError as e:
            yield image_id, None, f"{where} ({image_id}), annotation {latest.get('id')}: {e}"
