"""A user's files: images and masks read at a scale, label PNGs and Zarr arrays written, and the
lookup of a run's (or a benchmark's) final model.

* images: :func:`read_image` (JPEGs decoded directly at 1/2, 1/4, 1/8 size), :func:`image_size`
  (from the header), :func:`write_jpeg`, :func:`write_rgb_png`;
* masks: :func:`read_mask` (palette or grey PNG of class indices);
* a dataset folder of the HRF layout (``images/<id>.jpg``, ``masks/<id>.png``, ``<split>.txt``):
  :func:`dataset_ids`, :func:`dataset_image_path`, :func:`dataset_mask_path`;
* label maps: :func:`write_palette_png` (row band by row band, with ``pypng``), :func:`palette`,
  :func:`label_array` (the Zarr copy of a large output), :func:`scratch_array` (a working array
  that waits on disk during inference);
* models: :func:`resolve_checkpoint` (what ``wsseg segment --model`` means), :func:`run_config`,
  :func:`edge_params`, :func:`run_classifier_path`, :func:`bench_outputs`;
* :func:`write_json`.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from wsseg.tasks.store.remote import as_path
from wsseg.tasks.store.run import Store, _atomic_write_text

__all__ = ["read_image", "image_size", "read_mask", "write_jpeg", "write_rgb_png", "dataset_ids",
           "dataset_image_path", "dataset_mask_path", "palette", "write_palette_png", "label_array",
           "scratch_array", "resolve_checkpoint", "run_config", "edge_params", "run_classifier_path",
           "bench_outputs", "write_json", "read_json"]


# ---------------------------------------------------------------------------- images and masks
def read_image(path: str | os.PathLike, scale: float = 1.0) -> np.ndarray:
    """Read an RGB image as (H, W, 3) uint8, optionally reduced by ``scale`` (<= 1).

    JPEGs are decoded directly at 1/2, 1/4 or 1/8 size when ``scale`` is one of those
    (size ``ceil(side * scale)``); for other scales below 1 they are decoded at the
    smallest of those reductions that is still at least ``scale``, then resized (area) to
    ``round(side * scale)``.  The full-size pixels of a JPEG are thus never held in memory
    when ``scale <= 0.5``.  Other formats are decoded whole, then resized.
    """
    import cv2
    flags = {0.5: cv2.IMREAD_REDUCED_COLOR_2, 0.25: cv2.IMREAD_REDUCED_COLOR_4,
             0.125: cv2.IMREAD_REDUCED_COLOR_8}
    if not 0 < scale <= 1:
        raise ValueError(f"scale must lie in (0, 1], got {scale}")
    path = str(path)
    jpeg = path.lower().endswith((".jpg", ".jpeg"))
    fast = jpeg and scale in flags
    flag = cv2.IMREAD_COLOR
    if fast:
        flag = flags[scale]
    elif jpeg and scale < 1:
        reductions = [f for f in sorted(flags) if f >= scale]     # 0.125 < 0.25 < 0.5
        flag = flags[reductions[0]] if reductions else cv2.IMREAD_COLOR
    size = None
    if scale != 1.0 and not fast:
        h, w = image_size(Path(path))
        size = (max(1, round(w * scale)), max(1, round(h * scale)))
    bgr = cv2.imread(path, flag)
    if bgr is None:
        raise ValueError(f"cannot read image {path!r}; pass a JPEG/PNG/TIFF file path")
    image = cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB, dst=bgr)       # in place: one copy of the pixels
    if size is not None and image.shape[1::-1] != size:
        image = cv2.resize(image, size, interpolation=cv2.INTER_AREA)
    return image


def image_size(path: str | os.PathLike) -> tuple[int, int]:
    """(height, width) from the file header, without decoding the pixels."""
    from PIL import Image
    limit, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
    try:
        with Image.open(path) as im:
            return im.size[1], im.size[0]
    except OSError:
        return read_image(path).shape[:2]
    finally:
        Image.MAX_IMAGE_PIXELS = limit


def read_mask(path: str | os.PathLike) -> np.ndarray:
    """Read a label mask PNG (palette or grey) as (H, W) uint8 class indices."""
    from PIL import Image
    with Image.open(path) as im:
        if im.mode not in ("P", "L"):
            raise ValueError(f"{path}: mask must be a palette or greyscale PNG of class indices, got {im.mode}")
        return np.array(im)


def write_jpeg(path: str | os.PathLike, image: np.ndarray, quality: int = 95) -> Path:
    """An (H, W, 3) uint8 RGB image as a JPEG."""
    import cv2
    path = Path(path)
    if not cv2.imwrite(str(path), np.ascontiguousarray(image[..., ::-1]), [cv2.IMWRITE_JPEG_QUALITY, quality]):
        raise ValueError(f"cannot write {path}")
    return path


def write_rgb_png(path: str | os.PathLike, image: np.ndarray) -> Path:
    """An (H, W, 3) uint8 RGB picture as a PNG."""
    import cv2
    path = as_path(path)
    if not isinstance(path, Path):  # on object storage: encoded here, one put
        ok, data = cv2.imencode(".png", np.ascontiguousarray(image[..., ::-1]))
        if not ok:
            raise ValueError(f"cannot write {path}")
        path.write_bytes(data.tobytes())
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    if not cv2.imwrite(str(path), np.ascontiguousarray(image[..., ::-1])):
        raise ValueError(f"cannot write {path}")
    return path


# ---------------------------------------------------------------------------- dataset folders
def dataset_ids(data_dir: str | os.PathLike, split: str) -> list[str]:
    """The ids listed in ``<data_dir>/<split>.txt`` (images/<id>.jpg, masks/<id>.png beside it)."""
    listing = Path(data_dir) / f"{split}.txt"
    if not listing.exists():
        raise ValueError(f"{listing} not found; data_dir must hold images/, masks/ and {split}.txt")
    return [s.strip() for s in listing.read_text().splitlines() if s.strip()]


def dataset_image_path(data_dir: str | os.PathLike, image_id: str) -> Path:
    return Path(data_dir) / "images" / f"{image_id}.jpg"


def dataset_mask_path(data_dir: str | os.PathLike, image_id: str) -> Path:
    return Path(data_dir) / "masks" / f"{image_id}.png"


# ---------------------------------------------------------------------------- label maps
def palette(num_classes: int) -> list[int]:
    """Flat 768-entry palette: 2 classes black/white, more classes the PASCAL VOC colours."""
    if num_classes <= 2:
        colors = [(0, 0, 0), (255, 255, 255)]
    else:
        colors = []
        for i in range(256):
            r = g = b = 0
            c = i
            for j in range(8):
                r |= ((c >> 0) & 1) << (7 - j)
                g |= ((c >> 1) & 1) << (7 - j)
                b |= ((c >> 2) & 1) << (7 - j)
                c >>= 3
            colors.append((r, g, b))
    flat = [v for c in colors for v in c]
    return (flat + [0] * 768)[:768]


def write_palette_png(path: str | os.PathLike, height: int, width: int, bands: Iterable[np.ndarray],
                      palette: Sequence[int], *, level: int = 6) -> None:
    """Write an 8-bit palette PNG from row bands (``pypng``), without holding the whole image.

    Parameters
    ----------
    path : path
        Output file (written to a temporary name, then renamed).
    height, width : int
        Image size.
    bands : iterable of (n, width) uint8 arrays
        Consecutive row bands, top to bottom, ``height`` rows in total.
    palette : sequence of int
        Flat RGB palette, at most 768 values (256 colours).
    level : int
        zlib compression level.

    Raises
    ------
    ValueError
        If a band has the wrong width or dtype, or the bands do not add up to ``height``.
    """
    import png

    path = Path(path)
    if height < 1 or width < 1:
        raise ValueError(f"height and width must be positive, got {height}x{width}")
    pal = [int(v) for v in list(palette)[:768]]
    if len(pal) % 3 or not pal:
        raise ValueError(f"palette must be a flat RGB list (3 values per colour), got {len(pal)} values")
    writer = png.Writer(width, height, palette=[tuple(pal[i:i + 3]) for i in range(0, len(pal), 3)],
                        bitdepth=8, compression=level)
    rows = 0

    def packed_rows():
        nonlocal rows
        for band in bands:
            band = np.asarray(band)
            if band.ndim != 2 or band.shape[1] != width or band.dtype != np.uint8:
                raise ValueError(f"{path}: bands must be (n, {width}) uint8, got {band.dtype} {band.shape}")
            if rows + band.shape[0] > height:
                raise ValueError(f"{path}: bands hold more than height={height} rows")
            band = np.ascontiguousarray(band)
            for row in band:
                yield row.data
            rows += band.shape[0]
        if rows != height:
            raise ValueError(f"{path}: bands hold {rows} rows, expected {height}")

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            writer.write_packed(f, packed_rows())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def label_array(path: str | os.PathLike, height: int, width: int, chunk: int = 1024):
    """A new (height, width) uint8 Zarr array at ``path`` (replacing one there): the copy of a large output."""
    import zarr
    return zarr.create_array(store=str(path), shape=(height, width), chunks=(chunk, chunk), dtype="uint8",
                             overwrite=True)


def scratch_array(folder: str | os.PathLike, name: str, shape: tuple[int, ...], chunks: tuple[int, ...]):
    """A uint8 Zarr array ``<folder>/<name>.zarr`` for data that waits on disk (a temporary folder)."""
    import zarr
    return zarr.create_array(store=str(Path(folder) / f"{name}.zarr"), shape=shape, dtype="uint8", chunks=chunks)


# ---------------------------------------------------------------------------- models of runs and benchmarks
def bench_outputs(out_json: str | os.PathLike) -> tuple[Path, Path]:
    """The global-local checkpoint and the overlay PNG written beside a ``bench highres`` JSON."""
    out_json = Path(out_json)
    return out_json.with_name(out_json.stem + "_global_local.pt"), out_json.with_name(out_json.stem + "_overlay.png")


def resolve_checkpoint(model: str | os.PathLike) -> Path:
    """The checkpoint file meant by ``wsseg segment --model``.

    Parameters
    ----------
    model : path
        One of

        * a checkpoint file (``*.pt``);
        * the JSON of a ``wsseg bench highres`` run (``<stem>_global_local.pt`` beside it),
          or the folder holding it (exactly one ``*_global_local.pt`` there);
        * a ``wsseg train`` run directory (``summary.json``'s ``final_model``; if that file
          moved with the run directory, ``rounds/<round>/model.pt`` under it), or its
          ``summary.json``;
        * a round directory holding ``model.pt``.

    Returns
    -------
    path : Path
        An existing checkpoint file.

    Raises
    ------
    ValueError
        Naming the path and what was looked for, when nothing usable is found.
    """
    path = as_path(model)  # a URL (a run directory on object storage) too
    if not path.exists():
        raise ValueError(f"--model {path}: no such file or directory; pass a checkpoint (.pt), a `wsseg train` "
                         "run directory or a `wsseg bench highres` output")
    if path.is_file() and path.suffix.lower() != ".json":
        return path
    folder = path.parent if path.is_file() else path
    summary = path if path.is_file() else Store(folder).summary_path
    segmenter = Store.CHECKPOINTS["segmenter"]
    tried = []
    if summary.name == Store(folder).summary_path.name and summary.is_file():
        try:
            final = json.loads(summary.read_text()).get("final_model")
        except (json.JSONDecodeError, AttributeError) as e:
            raise ValueError(f"{summary}: not a readable `wsseg train` summary ({e})") from e
        if final:  # relative to the run directory (an older wsseg's: absolute, maybe of where the run was)
            final = as_path(final) if "://" in final or os.path.isabs(final) else folder / final
            moved = folder / "rounds" / final.parent.name / final.name
            for candidate in (final, moved):
                if candidate.is_file():
                    return candidate
            raise ValueError(f"{summary}: final_model {final} not found (nor {moved})")
        tried.append(f"{summary} has no final_model")
    if path.is_file():                          # a bench JSON: its checkpoint lies beside it
        candidate = bench_outputs(path)[0]
        if candidate.is_file():
            return candidate
        raise ValueError(f"{path}: no checkpoint {candidate.name} beside it; pass the checkpoint file itself")
    benches = sorted(folder.glob("*_global_local.pt"))
    if len(benches) == 1:
        return benches[0]
    if len(benches) > 1:
        raise ValueError(f"{folder}: several `wsseg bench highres` checkpoints ({', '.join(b.name for b in benches)}); "
                         "pass one of them as --model")
    if (folder / segmenter).is_file():
        return folder / segmenter
    raise ValueError(f"{folder}: no checkpoint found: looked for {summary.name} with final_model (a `wsseg train` "
                     f"run directory), *_global_local.pt (a `wsseg bench highres` output) and {segmenter}"
                     + (f"; {tried[0]}" if tried else ""))


def run_config(checkpoint: str | os.PathLike) -> tuple[Path, dict] | None:
    """The run directory of a ``wsseg train`` checkpoint and its configuration, or None."""
    for folder in _parents(checkpoint)[:3]:
        store = Store(folder)
        if store.config_path.is_file():
            return store.root, store.read_config()
    return None


def _parents(path: str | os.PathLike) -> list:
    """The folders above ``path``, nearest first (resolved when local)."""
    path = as_path(path)
    return list(path.resolve().parents) if isinstance(path, Path) else list(path.parents)


def run_classifier_path(run_dir: str | os.PathLike) -> Path | None:
    """The image classifier of a run directory, None when it has none."""
    path = Store(run_dir).checkpoint_path("classifier")
    return path if path.is_file() else None


def edge_params(checkpoint: str | os.PathLike, meta: dict) -> dict:
    """Edge-map parameters of a 4-channel checkpoint: its meta, else its run's configuration."""
    if "edges" in meta:
        return dict(meta["edges"])
    for folder in _parents(checkpoint)[:3]:
        store = Store(folder)
        if store.config_path.is_file():
            features = (store.read_config() or {}).get("features", {})
            if "edge_sigma" in features:
                return {"sigma": features["edge_sigma"], "tau": features["edge_tau"]}
    raise ValueError(f"{checkpoint}: the model takes an edge-map channel (4 inputs) but neither the checkpoint's "
                     f"meta nor a {Store.CONFIG_FILE} of its run directory gives the "
                     "edge parameters")


# ---------------------------------------------------------------------------- JSON
def write_json(path: str | os.PathLike, data: dict, indent: int = 2) -> Path:
    """A JSON report, written atomically."""
    path = Path(path)
    _atomic_write_text(path, json.dumps(data, indent=indent, default=float))
    return path


def read_json(path: str | os.PathLike) -> dict:
    return json.loads(Path(path).read_text())
