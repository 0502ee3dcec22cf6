"""Fully connected CRF refinement (Krähenbühl & Koltun, NIPS 2011): a baseline.

Mean-field inference for the energy

    E(x) = sum_i U_i(x_i) + sum_{i<j} [x_i != x_j] (w_g k_g(i, j) + w_b k_b(i, j))

with unaries ``U = -log P`` from the input probabilities, a Gaussian
(smoothness) kernel ``k_g = exp(-|p_i - p_j|^2 / 2 gauss_sxy^2)`` and a
bilateral (appearance) kernel ``k_b = exp(-|p_i - p_j|^2 / 2 bilateral_sxy^2
- |I_i - I_j|^2 / 2 bilateral_srgb^2)``, Potts compatibility. Each
iteration is ``Q <- softmax(-U + w_g K_g Q + w_b K_b Q)``.

Two backends:

- ``'pydensecrf'``: the authors' permutohedral-lattice code through the
  optional ``pydensecrf2`` package (``import pydensecrf``), symmetric kernel
  normalisation (its default);
- ``'approx'``: pure OpenCV. The Gaussian message is ``cv2.GaussianBlur``;
  the bilateral message is ``cv2.ximgproc.jointBilateralFilter`` with the
  image as guide, run on a grid downsampled by ``f = max(1,
  round(bilateral_sxy / 8))`` (so the spatial window stays ~17 cells wide),
  then brought back to full resolution by joint bilateral upsampling (Kopf
  et al. 2007: 4x4 grid cells weighted by their colour similarity to the
  full-resolution pixel), which keeps colour edges sharp. Both filters are
  normalised (weighted means, like the lattice's normalised kernels) and
  include the pixel itself. If
  ``cv2.ximgproc`` is missing the bilateral message is a plain Gaussian of
  ``bilateral_sxy`` (spatial only).

On top of it, the ``cam_crf`` baseline of ``wsseg bench quality``: :func:`crf_labels` (the CRF
over an image's tagged classes only) and :func:`cam_crf_shard` (that, for one shard of a run's
images, from round 0's preliminary probabilities into the store).
"""

from __future__ import annotations

import time
import warnings

import cv2
import numpy as np
import torch

from wsseg.tasks.config import ClassifierConfig
from wsseg.tasks.store import ImageRecord, Store, shard_records

__all__ = ["dense_crf", "pydensecrf_available", "crf_labels", "cam_crf_shard", "CRF_DEFAULTS"]

BACKENDS = ("auto", "pydensecrf", "approx")

#: dense CRF parameters of the ``cam_crf`` baseline (DeepLab's usual values, :func:`dense_crf`'s defaults)
CRF_DEFAULTS = {"n_iter": 10, "gauss_sxy": 3, "gauss_compat": 3, "bilateral_sxy": 80, "bilateral_srgb": 13,
                "bilateral_compat": 10}


def pydensecrf_available():
    """True when the optional ``pydensecrf2`` package can be imported."""
    try:
        import pydensecrf.densecrf  # noqa: F401
    except ImportError:
        return False
    return True


def _softmax(logits):
    logits = logits - logits.max(axis=0, keepdims=True)
    e = np.exp(logits)
    return e / e.sum(axis=0, keepdims=True)


def _crf_pydensecrf(image, unary, n_iter, gauss_sxy, gauss_compat, bilateral_sxy,
                    bilateral_srgb, bilateral_compat):
    import pydensecrf.densecrf as dcrf

    k, h, w = unary.shape
    crf = dcrf.DenseCRF2D(w, h, k)
    crf.setUnaryEnergy(np.ascontiguousarray(unary.reshape(k, -1), dtype=np.float32))
    crf.addPairwiseGaussian(sxy=gauss_sxy, compat=gauss_compat)
    crf.addPairwiseBilateral(
        sxy=bilateral_sxy, srgb=bilateral_srgb, rgbim=np.ascontiguousarray(image),
        compat=bilateral_compat,
    )
    q = np.asarray(crf.inference(int(n_iter)), dtype=np.float32)
    return q.reshape(k, h, w)


def _bilateral_filter(image, sxy, srgb):
    """A function Q (K, H, W) -> bilateral-filtered Q, on a downsampled grid."""
    h, w = image.shape[:2]
    f = max(1, int(round(sxy / 8.0)))
    hh, ww = max(1, round(h / f)), max(1, round(w / f))
    guide = cv2.resize(image, (ww, hh), interpolation=cv2.INTER_AREA).astype(np.float32)
    sigma_small = sxy / f
    diameter = 2 * int(np.ceil(2 * sigma_small)) + 1
    has_ximgproc = hasattr(cv2, "ximgproc")
    if not has_ximgproc:
        warnings.warn("cv2.ximgproc is missing; the bilateral kernel is spatial only.")

    upsample = _joint_bilateral_upsampler(image.astype(np.float32), guide, srgb)

    def apply(q):
        small = np.empty((q.shape[0], hh, ww), np.float32)
        for c in range(q.shape[0]):
            qc = cv2.resize(q[c].astype(np.float32), (ww, hh), interpolation=cv2.INTER_AREA)
            if has_ximgproc:
                qc = cv2.ximgproc.jointBilateralFilter(
                    guide, qc, diameter, float(srgb), float(sigma_small)
                )
            else:
                qc = cv2.GaussianBlur(qc, (0, 0), sigma_small)
            small[c] = qc
        return upsample(small) if f > 1 else small

    return apply


def _joint_bilateral_upsampler(image, guide, srgb):
    """Joint bilateral upsampling (Kopf et al. 2007) from the guide grid to the image.

    Each full-resolution pixel averages the 4x4 nearest grid cells, weighted by
    a unit-std Gaussian on grid distance and a `srgb` Gaussian on the colour
    difference between the pixel and the cell, so colour edges stay sharp.
    """
    h, w = image.shape[:2]
    hh, ww = guide.shape[:2]
    ys = (np.arange(h) + 0.5) * hh / h - 0.5
    xs = (np.arange(w) + 0.5) * ww / w - 0.5
    taps = []
    for dy in range(-1, 3):
        iy = np.clip(np.floor(ys).astype(int) + dy, 0, hh - 1)
        for dx in range(-1, 3):
            ix = np.clip(np.floor(xs).astype(int) + dx, 0, ww - 1)
            spatial = np.exp(-0.5 * ((iy - ys)[:, None] ** 2 + (ix - xs)[None, :] ** 2))
            colour = guide[iy[:, None], ix[None, :]] - image
            weight = spatial * np.exp(-0.5 * np.sum(colour**2, axis=-1) / srgb**2)
            taps.append((iy, ix, weight.astype(np.float32)))
    norm = np.maximum(sum(t[2] for t in taps), 1e-12)

    def upsample(small):
        out = np.zeros((small.shape[0], h, w), np.float32)
        for iy, ix, weight in taps:
            out += small[:, iy[:, None], ix[None, :]] * weight
        return out / norm

    return upsample


def _crf_approx(image, unary, n_iter, gauss_sxy, gauss_compat, bilateral_sxy,
                bilateral_srgb, bilateral_compat):
    bilateral = _bilateral_filter(image, bilateral_sxy, bilateral_srgb)
    q = _softmax(-unary)
    for _ in range(int(n_iter)):
        gauss = np.stack([cv2.GaussianBlur(c, (0, 0), float(gauss_sxy)) for c in q])
        q = _softmax(-unary + gauss_compat * gauss + bilateral_compat * bilateral(q))
    return q.astype(np.float32)


def dense_crf(
    image,
    prob,
    *,
    n_iter=10,
    gauss_sxy=3,
    gauss_compat=3,
    bilateral_sxy=80,
    bilateral_srgb=13,
    bilateral_compat=10,
    backend="auto",
):
    """Refine class probabilities with a fully connected CRF.

    Parameters
    ----------
    image : (H, W, 3) uint8
        RGB image (the bilateral kernel's guide).
    prob : (K, H, W) float array
        Class probabilities per pixel (normalised inside; zeros are clipped
        to 1e-8 before the log).
    n_iter : int, optional
        Mean-field iterations.
    gauss_sxy, gauss_compat : float, optional
        Spatial std (pixels) and Potts weight of the smoothness kernel.
    bilateral_sxy, bilateral_srgb, bilateral_compat : float, optional
        Spatial std (pixels), colour std (0-255 units) and Potts weight of the
        appearance kernel.
    backend : {'auto', 'pydensecrf', 'approx'}, optional
        'auto' uses pydensecrf when importable, else 'approx' (see the
        module docstring for the approximation).

    Returns
    -------
    q : (K, H, W) float32
        Refined probabilities; they sum to 1 at every pixel.

    Raises
    ------
    ValueError
        On mismatched shapes, negative parameters or an unknown backend.
    ImportError
        With ``backend='pydensecrf'`` when ``pydensecrf2`` is not installed.

    Examples
    --------
    >>> img = np.zeros((8, 8, 3), np.uint8)
    >>> q = dense_crf(img, np.full((2, 8, 8), 0.5, np.float32), backend="approx")
    >>> q.shape, bool(np.allclose(q.sum(0), 1))
    ((2, 8, 8), True)
    """
    # parse
    image = np.asarray(image)
    prob = np.asarray(prob, dtype=np.float64)
    if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
        raise ValueError(
            f"image must be (H, W, 3) uint8 RGB, got {image.shape} {image.dtype}."
        )
    if prob.ndim != 3 or prob.shape[1:] != image.shape[:2]:
        raise ValueError(
            f"prob must be (K, H, W) = (K, {image.shape[0]}, {image.shape[1]}), "
            f"got {prob.shape}."
        )
    for name, value in (("n_iter", n_iter), ("gauss_sxy", gauss_sxy),
                        ("bilateral_sxy", bilateral_sxy), ("bilateral_srgb", bilateral_srgb)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}.")
    if gauss_compat < 0 or bilateral_compat < 0:
        raise ValueError("gauss_compat and bilateral_compat must be >= 0.")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}.")
    if backend == "auto":
        backend = "pydensecrf" if pydensecrf_available() else "approx"
    elif backend == "pydensecrf" and not pydensecrf_available():
        raise ImportError(
            "backend='pydensecrf' needs the pydensecrf2 package "
            "(pip install pydensecrf2); or use backend='approx'."
        )

    # preprocess: unaries from normalised probabilities
    prob = np.clip(prob, 1e-8, None)
    prob = prob / prob.sum(axis=0, keepdims=True)
    unary = (-np.log(prob)).astype(np.float32)
    if prob.shape[0] == 1:
        return np.ones(prob.shape, dtype=np.float32)

    # solve
    solver = _crf_pydensecrf if backend == "pydensecrf" else _crf_approx
    q = solver(np.ascontiguousarray(image), unary, n_iter, gauss_sxy, gauss_compat,
               bilateral_sxy, bilateral_srgb, bilateral_compat)
    q = np.clip(q, 0, None)
    return (q / q.sum(axis=0, keepdims=True)).astype(np.float32)


# ---------------------------------------------------------------------------- the cam_crf baseline
def crf_labels(image: np.ndarray, prob: np.ndarray, allowed: np.ndarray, *, backend: str = "auto",
               **crf_params: float) -> np.ndarray:
    """Dense-CRF label map restricted to an image's allowed (tagged) classes.

    Only the allowed channels of ``prob`` enter :func:`dense_crf` (renormalised there), which
    keeps the CRF cheap with many classes and guarantees the result uses allowed classes only.

    Parameters
    ----------
    image : (H, W, 3) uint8
        RGB image, the bilateral kernel's guide.
    prob : (K, H, W) float array
        Class probabilities (e.g. the round-0 preliminary result); channels of classes that are
        not allowed are ignored.
    allowed : (K,) bool array
        The image's tags (plus the implicit background class, if any); at least one True.
    backend : {'auto', 'pydensecrf', 'approx'}, optional
        Passed to :func:`dense_crf`.
    **crf_params
        Keyword options of :func:`dense_crf` (default :data:`CRF_DEFAULTS`).

    Returns
    -------
    label : (H, W) uint8
        Dataset class index per pixel, always one of the allowed classes.

    Raises
    ------
    ValueError
        On mismatched shapes or when no class is allowed.

    Examples
    --------
    >>> img = np.zeros((4, 4, 3), np.uint8)
    >>> p = np.zeros((3, 4, 4), np.float32); p[2] = 1.0
    >>> crf_labels(img, p, np.array([False, True, True]), backend="approx")[0, 0]
    np.uint8(2)
    """
    image = np.asarray(image)
    prob = np.asarray(prob, dtype=np.float32)
    allowed = np.asarray(allowed, dtype=bool)
    if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
        raise ValueError(f"image must be (H, W, 3) uint8 RGB, got {image.shape} {image.dtype}.")
    if prob.ndim != 3 or prob.shape[1:] != image.shape[:2]:
        raise ValueError(f"prob must be (K, {image.shape[0]}, {image.shape[1]}), got {prob.shape}.")
    if allowed.shape != (prob.shape[0],):
        raise ValueError(f"allowed must be ({prob.shape[0]},) bool (one flag per class of prob), "
                         f"got shape {allowed.shape}.")
    idx = np.flatnonzero(allowed)
    if idx.size == 0:
        raise ValueError("allowed has no True entry: an image needs at least one tag (or a background class).")
    if idx.max() > 254:
        raise ValueError(f"class index {idx.max()} does not fit a uint8 label map (255 = ignore).")
    if idx.size == 1:
        return np.full(image.shape[:2], idx[0], np.uint8)
    params = {**CRF_DEFAULTS, **crf_params}
    q = dense_crf(image, prob[idx], backend=backend, **params)
    return idx[q.argmax(0)].astype(np.uint8)


def cam_crf_shard(run_dir: str, ids: list[str], crf: dict | None = None, round_index: int = 0,
                  name: str = "cam_crf", records: list[ImageRecord] | None = None, cam: ClassifierConfig | None = None) -> dict:
    """The CAM + CRF baseline for one shard: round ``round_index``'s preliminary probabilities
    of each image, refined by :func:`crf_labels`, stored as ``store.pseudo(round, id, name)``.
    With ``cam`` (the run's ``classifier`` settings), the image classifier's CAM probabilities
    computed again (:func:`tasks.wsss.pipeline.cam_probs`) instead: on the
    class-agnostic foreground path round 0's preliminary result is the method's own start, not
    the CAM, and a baseline refined from it would credit the CRF with the method's work.
    Images already stored are skipped, so an interrupted run resumes."""
    torch.set_num_threads(1)
    store = Store(run_dir)
    classes = store.classes()
    t0 = time.perf_counter()
    done = 0
    cam_of = _cam_source(store, cam) if cam is not None else None
    with store.packing(store.shard_name(ids)):  # the shard's labels as one pack
        for rec in shard_records(store, ids, records):
            if store.has_pseudo(round_index, rec.image_id, name=name):
                continue
            image, allowed = store.image(rec.image_id), classes.tag_vector(rec.tags)
            prob = cam_of(image, allowed) if cam_of else store.prelim(round_index, rec.image_id, classes.n)
            label = crf_labels(image, prob, allowed, **(crf or {}))
            store.write_pseudo(round_index, rec.image_id, label, name=name)
            done += 1
    return {"images": len(ids), "computed": done, "seconds": time.perf_counter() - t0}


def _cam_source(store: Store, cfg: ClassifierConfig):
    """``(image, allowed) -> (K, H, W)`` CAM probabilities of the run's image classifier, as round
    0 computes them before the foreground path replaces them."""
    from wsseg.tasks.wsss.pipeline import cam_probs

    classes = store.classes()
    model, state = store.read_model("classifier")
    return lambda image, allowed: cam_probs(model, state, image, allowed, classes, cfg)
