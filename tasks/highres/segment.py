"""Inference of new images with a trained model: ``wsseg segment``'s work.

* :func:`segment`: a global-local checkpoint (or a run's final model,
  :func:`tasks.store.files.resolve_checkpoint`) applied to images of any size, patch by patch
  with bounded memory: palette PNG per image written band by band, plus a Zarr array when the
  output exceeds 50 megapixels; pixels outside a fundus camera's field of view get class 0
  (:mod:`tasks.highres.fov`);
* :func:`segment_whole`: a ``small`` or ``fusion`` model of a ``wsseg train`` run labels each
  image whole, gated by the run's image classifier, with an overlay picture per image;
* :class:`Labeller`: either kind of model, loaded once, labelling images held in memory (the
  Python API's ``wsseg.segment``: arrays in, label arrays out, no file written);
* :func:`report`: the per-image figures and the process's memory, what ``segment.json`` holds.
"""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from wsseg.tasks.runtime.memory import rss_mb
from wsseg.tasks.store import files

__all__ = ["segment", "segment_whole", "Labeller", "WholeImage", "upsampled_class_shares", "report", "rss_mb", "LARGE_OUTPUT_PIXELS",
           "SPILL_PIXELS"]

LARGE_OUTPUT_PIXELS = 50_000_000
SPILL_PIXELS = 1_000_000        # segment(): working images above this wait on disk (Zarr) during inference


def report(stats: list[dict], rss_before_mb: float) -> dict:
    """``segment.json``: one dict per image, the RSS before the work and the process's peak RSS."""
    return {"images": stats, "rss_before_mb": rss_before_mb, "peak_rss_mb": rss_mb("VmHWM")}


def _upsample_bands(labels: np.ndarray, height: int, width: int, band: int = 256):
    """(n, width) uint8 bands of ``labels`` resized (nearest, as :func:`upsample_labels`) to height x width."""
    h, w = labels.shape
    cols = np.minimum((np.arange(width) * w) // width, w - 1)
    for r0 in range(0, height, band):
        rows = np.minimum((np.arange(r0, min(r0 + band, height)) * h) // height, h - 1)
        src = np.asarray(labels[int(rows[0]):int(rows[-1]) + 1])
        yield src[rows - rows[0]][:, cols]


def upsampled_class_shares(labels: np.ndarray, height: int, width: int, num_classes: int, band: int = 64) -> np.ndarray:
    """Share of each class in ``labels`` resized (nearest) to height x width, computed on ``labels``.

    Each source pixel counts as many times as the resize repeats it (rows times columns),
    so the result equals ``np.bincount(upsample_labels(labels, height, width).ravel()) /
    (height * width)`` without building the large array.
    """
    h, w = labels.shape
    row_n = np.bincount(np.minimum((np.arange(height) * h) // height, h - 1), minlength=h).astype(np.float64)
    col_n = np.bincount(np.minimum((np.arange(width) * w) // width, w - 1), minlength=w).astype(np.float64)
    counts = np.zeros(num_classes, np.float64)
    for r0 in range(0, h, band):
        part = np.asarray(labels[r0:r0 + band])
        for k in range(num_classes):
            counts[k] += row_n[r0:r0 + band] @ ((part == k) @ col_n)
    return counts / (float(height) * width)


def segment(inputs: Sequence[str | os.PathLike], model: str | os.PathLike, out_dir: str | os.PathLike, *,
            patch_size: int | None = None, overlap: int | None = None, batch: int = 4, device: str = "cpu",
            fov: str = "auto", stats: list | None = None, log: Callable[[str], None] = print,
            gate: bool | None = None) -> list[Path]:
    """Segment image files with a global-local checkpoint, with memory bounded by patch and batch.

    Any other checkpoint (the ``small`` or ``fusion`` network of a ``wsseg train`` run) labels
    each image whole: :func:`segment_whole`.

    For each image:

    1. read it at the checkpoint's working ``scale`` (``meta["scale"]``, 1 if absent): a
       JPEG is decoded directly at that size (:func:`tasks.store.files.read_image`), so the full-size pixels
       are never in memory when the scale is 1/2, 1/4 or 1/8; for a model with an edge
       channel (4 inputs, a ``wsseg train`` model), the feature-region map of the whole
       working image is added (its filters' memory grows with the image);
    2. ``fov="auto"``: estimate the camera's field of view (:func:`tasks.highres.fov.fov_or_all`,
       kept as one bit per pixel); when the image has a dark surround (fundus
       photographs), pixels outside it get class 0, else all pixels are kept; skipped for a
       model whose class 0 is not a background (``meta["classes"][0]``, e.g. msrc21's
       "building": a dark corner of a photo is no field-of-view border); ``fov="none"``:
       keep all pixels;
    3. segment patch by patch with the coarse image (:func:`models.global_local.segment_large`);
       a working image above ``SPILL_PIXELS`` is first moved to a temporary Zarr array in
       ``out_dir`` (and the labels go to one), so that during inference only patches,
       bands of rows and the model are in memory;
    4. resize the labels back to the image's size (nearest) band by band, writing
       ``<out_dir>/<stem>.png`` (palette PNG of class indices) row band by row band
       (:func:`tasks.store.files.write_palette_png`) and, for outputs above 50 megapixels, also
       ``<out_dir>/<stem>.zarr`` (uint8 (H, W)).

    Parameters
    ----------
    inputs : sequence of paths
        Image files.
    model : path
        Checkpoint, run directory or bench output (:func:`tasks.store.files.resolve_checkpoint`).
    out_dir : path
        Output folder (created).
    patch_size, overlap : int, optional
        Default: the model's patch size and the checkpoint's overlap (0 if absent).
    batch : int
        Patches per forward pass.
    device : str
        Torch device.
    fov : {"auto", "none"}
        Field-of-view masking.
    stats : list, optional
        Receives one dict per image (``image``, ``size``, ``working_size``, ``seconds``,
        ``inference_seconds``, ``fov_found``, ``fov_share``, ``class_shares``, ``png``).
    log : callable(str)
        Progress, one line per image.
    gate : bool, optional
        Whole-image models only (:func:`segment_whole`).

    Returns
    -------
    pngs : list of Path
        The written PNGs.

    Raises
    ------
    ValueError
        On missing inputs, an unusable ``model``, or bad options.
    """
    from wsseg.models.global_local import GlobalLocalNet, IMAGENET_MEAN, IMAGENET_STD, segment_large
    from wsseg.tasks.highres.fov import fov_or_all

    paths = [Path(p) for p in inputs]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise ValueError(f"input images not found: {', '.join(missing)}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if fov not in ("auto", "none"):
        raise ValueError(f"fov must be 'auto' or 'none', got {fov!r}")
    from wsseg.tasks.store import load_model

    checkpoint = files.resolve_checkpoint(model)
    net, state = load_model(checkpoint, device)
    if not isinstance(net, GlobalLocalNet):
        if patch_size is not None or overlap is not None:
            raise ValueError(f"{checkpoint}: a {state.get('builder')!r} model labels whole images; --patch-size and "
                             "--overlap apply to global_local models only")
        return segment_whole(paths, checkpoint, net, state, out_dir, gate=gate, stats=stats, log=log)
    meta = state.get("meta", {})
    scale = float(meta.get("scale", 1.0))
    overlap = int(meta.get("overlap", 0) if overlap is None else overlap)
    in_ch = int(state["in_channels"])
    if in_ch not in (3, 4):
        raise ValueError(f"{checkpoint}: model takes {in_ch} input channels; segment supports RGB (3) or RGB + "
                         "edge map (4)")
    edges = files.edge_params(checkpoint, meta) if in_ch == 4 else None
    mean, std = IMAGENET_MEAN + ((0.5,) if edges else ()), IMAGENET_STD + ((1.0,) if edges else ())
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    palette = files.palette(net.num_classes)
    names = list(meta.get("classes") or [])
    if names and names[0] != "background":
        fov = "none"
    written = []
    for n, path in enumerate(paths, 1):
        t0 = time.perf_counter()
        height, width = files.image_size(path)
        with tempfile.TemporaryDirectory(prefix=f".{path.stem}.", dir=out_dir) as tmp:
            work = files.read_image(path, scale)
            h, w = work.shape[:2]
            # 2. field of view, at working scale, kept as one bit per pixel
            packed, found, fov_share = None, False, 1.0
            if fov == "auto":
                mask, found = fov_or_all(work)
                if found:
                    fov_share = float(mask.mean())
                    packed = np.packbits(mask, axis=1)
                del mask
            if edges is not None:
                from wsseg.tasks.edges.weighting import feature_region_map
                region = feature_region_map(work, sigma=edges["sigma"], tau=edges["tau"])
                work = np.concatenate([work, (region * 255).astype(np.uint8)[..., None]], axis=2)
                del region
            # a large working image waits on disk: inference reads it patch by patch and band by band
            labels = np.empty((h, w), np.uint8)
            if h * w > SPILL_PIXELS:
                src = files.scratch_array(tmp, "image", work.shape, (128, min(w, 512), work.shape[2]))
                src[:] = work
                del work
                work = src
                labels = files.scratch_array(tmp, "labels", (h, w), (256, w))
            # 3. patches + coarse image
            t1 = time.perf_counter()
            segment_large(net, work, patch_size=patch_size, overlap=overlap, batch=batch, device=device,
                          mean=mean, std=std, out=labels)
            t_inf = time.perf_counter() - t1
            del work
            if packed is not None:                          # outside the field of view: class 0
                for r0 in range(0, h, 256):
                    part = np.asarray(labels[r0:r0 + 256])
                    part *= np.unpackbits(packed[r0:r0 + 256], axis=1, count=w).astype(bool)
                    labels[r0:r0 + 256] = part
                del packed
            # 4. back to the image's size, band by band
            png = out_dir / f"{path.stem}.png"
            large = height * width > LARGE_OUTPUT_PIXELS
            z = None
            if large:
                z = files.label_array(out_dir / f"{path.stem}.zarr", height, width)

            def bands():
                r0 = 0
                for part in _upsample_bands(labels, height, width, band=256 if z is None else 1024):
                    if z is not None:
                        z[r0:r0 + part.shape[0]] = part
                    r0 += part.shape[0]
                    yield part

            files.write_palette_png(png, height, width, bands(), palette)
            shares = upsampled_class_shares(labels, height, width, net.num_classes)
            del labels
        written.append(png)
        work_size = [h, w]
        seconds = time.perf_counter() - t0
        if stats is not None:
            stats.append({"image": str(path), "size": [height, width], "working_size": work_size,
                          "seconds": seconds, "inference_seconds": t_inf, "fov_found": found,
                          "fov_share": fov_share, "class_shares": shares.tolist(), "png": str(png)})
        at = f" (at {work_size[1]}x{work_size[0]})" if scale != 1.0 else ""
        fov_note = f", field of view {fov_share:.3f}" if found else (", no dark surround" if fov == "auto" else "")
        log(f"[{n}/{len(paths)}] {path.name}: {width}x{height}{at}{fov_note}, {seconds:.1f} s, "
            f"{png}{' + .zarr' if large else ''}, class shares " + " ".join(f"{v:.3f}" for v in shares))
    return written


def segment_whole(paths: Sequence[Path], checkpoint: Path, net, state: dict, out_dir: str | os.PathLike, *,
                  gate: bool | None = None, stats: list | None = None,
                  log: Callable[[str], None] = print) -> list[Path]:
    """Label whole images with a ``wsseg train`` segmenter (``small``, ``fusion``), as ``bench
    quality`` measures it: flip-averaged class probabilities, weighted by the run's image
    classifier (its ``classifier`` checkpoint) when ``gate`` (default: the run's ``inference.gate``).

    Writes ``<out_dir>/<stem>.png`` (palette PNG of class indices) and ``<stem>_overlay.png``
    (the labels coloured over the image). ``stats`` receives one dict per image (``image``,
    ``size``, ``seconds``, ``gated``, ``class_shares``, ``png``, ``overlay``).
    """
    from wsseg.tasks.report.overlay import overlay, with_legend

    whole = WholeImage(checkpoint, net, state, gate)
    clf = whole.clf
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    n_classes = int(state["num_classes"])
    names = list(state.get("meta", {}).get("classes", []))
    palette = files.palette(n_classes)
    written = []
    for n, path in enumerate(paths, 1):
        t0 = time.perf_counter()
        image = files.read_image(path)  # a ValueError naming the file when it is not a readable image
        labels = whole(image)
        h, w = labels.shape
        png, picture = out_dir / f"{path.stem}.png", out_dir / f"{path.stem}_overlay.png"
        files.write_palette_png(png, h, w, iter([labels]), palette)
        files.write_rgb_png(picture, with_legend(overlay(image, labels), names, labels))
        shares = np.bincount(labels.ravel(), minlength=n_classes) / labels.size
        written.append(png)
        seconds = time.perf_counter() - t0
        if stats is not None:
            stats.append({"image": str(path), "size": [h, w], "seconds": seconds, "gated": clf is not None,
                          "class_shares": shares.tolist(), "png": str(png), "overlay": str(picture)})
        top = [c for c in np.argsort(-shares)[:3] if shares[c] > 0]
        log(f"[{n}/{len(paths)}] {path.name}: {w}x{h}, {seconds:.1f} s{', gated' if clf is not None else ''}, "
            f"{png}, largest classes " + ", ".join(f"{names[c] if c < len(names) else c} {shares[c]:.2f}" for c in top))
    return written




class WholeImage:
    """A ``wsseg train`` segmenter (``small``, ``lite``, ``fusion``) labelling one whole image in
    memory, as ``bench quality`` measures it: flip-averaged class probabilities, weighted by the
    run's image classifier (its ``classifier`` checkpoint) when ``gate`` (default: the run's
    ``inference.gate``). ``WholeImage(...)(image) -> (H, W) uint8`` class indices."""

    def __init__(self, checkpoint: Path, net, state: dict, gate: bool | None = None):
        from wsseg.models.lite_nets import LiteClassifier
        from wsseg.models.small import ImageClassifier
        from wsseg.tasks.store import load_model
        from wsseg.tasks.wsss.pipeline import ClassifierGate

        if isinstance(net, (ImageClassifier, LiteClassifier)):
            raise ValueError(f"{checkpoint}: a {state.get('builder')!r} model is not a segmentation network; pass "
                             "a segmenter checkpoint (a run's rounds/rNNN/model.pt), the run directory, or a "
                             "global_local checkpoint")
        run = files.run_config(checkpoint)
        run_gate = bool(run[1].get("inference", {}).get("gate", True)) if run else False
        gate = run_gate if gate is None else gate
        self.net, self.state, self.clf = net, state, None
        if gate:
            classifier = files.run_classifier_path(run[0]) if run is not None else None
            if classifier is None:
                raise ValueError(f"{checkpoint}: gating needs the run's image classifier (in the run directory, "
                                 "beside its configuration), which was not found; pass --no-gate")
            clf_model, clf_state = load_model(classifier)
            self.clf = ClassifierGate(clf_model, clf_state, run[1].get("classifier", {}).get("cam_scales", (1.0,)))
        self.edges = files.edge_params(checkpoint, state.get("meta", {})) if int(state["in_channels"]) == 4 else None

    def __call__(self, image: np.ndarray) -> np.ndarray:
        from wsseg.tasks.common import training as tr
        from wsseg.tasks.wsss.pipeline import trained_classes_only

        edge = None
        if self.edges is not None:
            from wsseg.tasks.edges.weighting import feature_region_map
            edge = feature_region_map(image, sigma=self.edges["sigma"], tau=self.edges["tau"])
        prob = trained_classes_only(tr.predict_probs(self.net, image, edge), self.state)
        if self.clf is not None:
            prob = self.clf(prob, image)
        return prob.argmax(0).astype(np.uint8)


class Labeller:
    """A trained model, loaded once, labelling images held in memory: ``Labeller(model)(image)``
    takes an (H, W, 3) uint8 RGB array and returns its (H, W) uint8 class indices; nothing is
    written. ``model`` is what ``wsseg segment --model`` takes (a checkpoint, a run directory: its
    final model, or a ``bench highres`` output). A whole-image model labels as
    :func:`segment_whole` does (``gate`` as there), bit for bit the PNG it writes for the same
    image; a global-local model as :func:`segment` does (``fov``, ``patch_size``, ``overlap``,
    ``batch`` as there), at its working scale (the array resized by area, where :func:`segment`
    decodes a JPEG at that scale: the labels can differ at the few pixels where the two differ) and
    its labels resized back (nearest).
    """

    def __init__(self, model: str | os.PathLike, *, device: str = "cpu", gate: bool | None = None,
                 fov: str = "auto", patch_size: int | None = None, overlap: int | None = None, batch: int = 4):
        from wsseg.models.global_local import GlobalLocalNet, IMAGENET_MEAN, IMAGENET_STD
        from wsseg.tasks.store import load_model

        if fov not in ("auto", "none"):
            raise ValueError(f"fov must be 'auto' or 'none', got {fov!r}")
        self.checkpoint = files.resolve_checkpoint(model)
        self.net, self.state = load_model(self.checkpoint, device)
        meta = self.state.get("meta", {})
        #: the class names, indexed by the labels' values
        self.classes: list[str] = list(meta.get("classes") or [])
        self.whole = None
        if not isinstance(self.net, GlobalLocalNet):
            if patch_size is not None or overlap is not None:
                raise ValueError(f"{self.checkpoint}: a {self.state.get('builder')!r} model labels whole images; "
                                 "patch_size and overlap apply to global_local models only")
            self.whole = WholeImage(self.checkpoint, self.net, self.state, gate)
            return
        self.scale = float(meta.get("scale", 1.0))
        self.overlap = int(meta.get("overlap", 0) if overlap is None else overlap)
        self.patch_size, self.batch, self.device = patch_size, batch, device
        self.edges = files.edge_params(self.checkpoint, meta) if int(self.state["in_channels"]) == 4 else None
        self.mean = IMAGENET_MEAN + ((0.5,) if self.edges else ())
        self.std = IMAGENET_STD + ((1.0,) if self.edges else ())
        self.fov = "none" if self.classes and self.classes[0] != "background" else fov

    def __call__(self, image: np.ndarray) -> np.ndarray:
        image = np.asarray(image)
        if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
            raise ValueError(f"an image is an (H, W, 3) uint8 RGB array; got {image.dtype} {image.shape}")
        if self.whole is not None:
            return self.whole(image)
        import cv2

        from wsseg.models.global_local import segment_large
        from wsseg.tasks.highres.fov import fov_or_all

        height, width = image.shape[:2]
        work = image
        if self.scale != 1.0:
            size = (max(1, round(width * self.scale)), max(1, round(height * self.scale)))
            work = cv2.resize(image, size, interpolation=cv2.INTER_AREA)
        mask = None
        if self.fov == "auto":
            mask, found = fov_or_all(work)
            mask = mask if found else None
        if self.edges is not None:
            from wsseg.tasks.edges.weighting import feature_region_map
            region = feature_region_map(work, sigma=self.edges["sigma"], tau=self.edges["tau"])
            work = np.concatenate([work, (region * 255).astype(np.uint8)[..., None]], axis=2)
        labels = np.empty(work.shape[:2], np.uint8)
        segment_large(self.net, work, patch_size=self.patch_size, overlap=self.overlap, batch=self.batch,
                      device=self.device, mean=self.mean, std=self.std, out=labels)
        if mask is not None:  # outside the field of view: class 0
            labels *= mask.astype(bool)
        return np.concatenate(list(_upsample_bands(labels, height, width)), axis=0)
