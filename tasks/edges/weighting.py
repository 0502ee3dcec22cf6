"""Edge-operator weighting: the *feature region* map of METHOD.md section B.

Steps (METHOD.md B.1-B.7), one public function each:

1. :func:`edge_maps` -- grayscale, Gaussian filter, then the four operators
   Canny, Sobel, Prewitt and Laplacian of Gaussian (LoG), each normalised to [0, 1].
2. :func:`edge_fires` -- where each operator "fires" (a boolean map per operator).
3. :func:`cv_weights` -- mean image, deviation of each map from it, coefficient of
   variation ``CV_k = sigma_k / mu_k`` and weights ``w_k = CV_k / sum(CV)``.
4. :func:`feature_region_map` -- ``X_k = 2`` where operator k fires, else 1;
   ``F = sum_k w_k X_k - (1 + tau)``; the map is 1 where ``F >= 0``.

Because the weights sum to one, ``F >= 0`` is the same as "the weights of the operators
that fire add up to at least ``tau``": ``tau = 0.5`` is a weighted majority vote and any
``tau > 1`` gives an empty map.
"""

from __future__ import annotations

import cv2
import numpy as np

__all__ = ["OPERATORS", "edge_maps", "edge_fires", "cv_weights", "feature_region_map"]

#: Names of the four operators, in the order every function of this module uses.
OPERATORS = ("canny", "sobel", "prewitt", "log")

_FIRE_METHODS = ("otsu", "percentile")

_PREWITT_X = np.array([[-1, 0, 1], [-1, 0, 1], [-1, 0, 1]], dtype=np.float32)
_PREWITT_Y = _PREWITT_X.T.copy()


# --------------------------------------------------------------------------- helpers
def _check_image(image):
    image = np.asarray(image)
    if image.ndim == 3 and image.shape[2] == 3 or image.ndim == 2:
        if image.dtype != np.uint8:
            raise ValueError(
                f"image must be uint8 (0..255), got dtype {image.dtype}; convert with "
                "skimage.util.img_as_ubyte(image) or np.clip(image, 0, 255).astype(np.uint8)"
            )
        if image.shape[0] < 3 or image.shape[1] < 3:
            raise ValueError(f"image must be at least 3x3 pixels, got shape {image.shape}")
        return image
    raise ValueError(
        f"image must be an (H, W, 3) RGB or (H, W) grayscale uint8 array, got shape {image.shape}"
    )


def _normalise(magnitude, floor=1e-3):
    """Divide a non-negative map by its maximum.

    A map whose maximum is below ``floor`` (in grey levels per pixel) is floating-point
    noise of a flat image, not an edge: it becomes all zeros instead of being blown up.
    """
    peak = float(magnitude.max())
    if not peak > floor or not np.isfinite(peak):
        return np.zeros(magnitude.shape, np.float32)
    return (magnitude / peak).astype(np.float32)


def _check_maps(maps):
    if not isinstance(maps, dict) or not maps:
        raise ValueError("maps must be a non-empty dict {operator name: (H, W) array}, "
                         "as returned by edge_maps(image)")
    shapes = {np.shape(m) for m in maps.values()}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise ValueError(f"every map must be (H, W) with the same shape, got shapes {shapes}")


# --------------------------------------------------------------------------- step 1-2
def edge_maps(image, *, sigma=1.0, canny_low=50, canny_high=150, log_sigma=2.0):
    """Four edge maps of an image, each normalised to [0, 1].

    Parameters
    ----------
    image : (H, W, 3) uint8 RGB or (H, W) uint8 grayscale array
    sigma : float, optional
        Standard deviation (pixels) of the Gaussian filter applied to the grayscale image
        before every operator; ``0`` disables it.
    canny_low, canny_high : float, optional
        Hysteresis thresholds of :func:`cv2.Canny` (on the 0..255 grayscale scale).
    log_sigma : float, optional
        Scale (pixels) of the Laplacian of Gaussian, applied to the filtered image.

    Returns
    -------
    maps : dict of str -> (H, W) float32
        Keys ``"canny"``, ``"sobel"``, ``"prewitt"``, ``"log"`` (see :data:`OPERATORS`):

        - ``canny``: the binary Canny output (L2 gradient), 0 or 1;
        - ``sobel``: 3x3 Sobel gradient magnitude ``sqrt(gx^2 + gy^2)``;
        - ``prewitt``: 3x3 Prewitt gradient magnitude (``cv2.filter2D``);
        - ``log``: absolute Laplacian-of-Gaussian response (Gaussian of ``log_sigma``, then
          the 3x3 ``cv2.Laplacian``, whose kernel sums to zero exactly).

        Normalisation: every magnitude is divided by its own maximum over the image, so each
        map spans [0, 1] and the coefficients of variation of :func:`cv_weights` compare
        maps on the same scale. A map that is zero everywhere (flat image) stays zero.

    Raises
    ------
    ValueError
        If the image is not a uint8 (H, W, 3) / (H, W) array or a parameter is out of range.

    Examples
    --------
    >>> img = np.zeros((32, 32, 3), np.uint8); img[:, 16:] = 255
    >>> maps = edge_maps(img)
    >>> sorted(maps), float(maps["sobel"].max())
    (['canny', 'log', 'prewitt', 'sobel'], 1.0)
    """
    image = _check_image(image)
    if sigma < 0 or log_sigma <= 0:
        raise ValueError(f"need sigma >= 0 and log_sigma > 0, got sigma={sigma}, log_sigma={log_sigma}")
    if not 0 <= canny_low <= canny_high:
        raise ValueError(f"need 0 <= canny_low <= canny_high, got {canny_low}, {canny_high}")

    # preprocess: grayscale, Gaussian filter
    gray = cv2.cvtColor(image, cv2.COLOR_RGB2GRAY) if image.ndim == 3 else image
    gray = gray.astype(np.float32)
    if sigma > 0:
        gray = cv2.GaussianBlur(gray, (0, 0), sigmaX=float(sigma), borderType=cv2.BORDER_REFLECT)

    # operators
    gray_u8 = np.clip(np.rint(gray), 0, 255).astype(np.uint8)
    canny = cv2.Canny(gray_u8, float(canny_low), float(canny_high), L2gradient=True)
    gx = cv2.Sobel(gray, cv2.CV_32F, 1, 0, ksize=3, borderType=cv2.BORDER_REFLECT)
    gy = cv2.Sobel(gray, cv2.CV_32F, 0, 1, ksize=3, borderType=cv2.BORDER_REFLECT)
    px = cv2.filter2D(gray, cv2.CV_32F, _PREWITT_X, borderType=cv2.BORDER_REFLECT)
    py = cv2.filter2D(gray, cv2.CV_32F, _PREWITT_Y, borderType=cv2.BORDER_REFLECT)
    smooth = cv2.GaussianBlur(gray, (0, 0), sigmaX=float(log_sigma), borderType=cv2.BORDER_REFLECT)
    log = cv2.Laplacian(smooth, cv2.CV_32F, ksize=3, borderType=cv2.BORDER_REFLECT)

    return {
        "canny": (canny > 0).astype(np.float32),
        # np.sqrt, not cv2.magnitude, whose last bits vary with memory alignment (see tasks/wsss/features.py)
        "sobel": _normalise(np.sqrt(gx * gx + gy * gy)),
        "prewitt": _normalise(np.sqrt(px * px + py * py)),
        "log": _normalise(np.abs(log)),
    }


def edge_fires(maps, *, method="otsu", percentile=90.0):
    """Where each operator fires.

    Parameters
    ----------
    maps : dict of str -> (H, W) float
        Output of :func:`edge_maps`.
    method : {"otsu", "percentile"}, optional
        Threshold of the continuous maps (every map except ``"canny"``, which is already
        binary and fires where it is non-zero). ``"otsu"``: Otsu's threshold
        of the map quantised to 256 levels between its min and max (``cv2.threshold``); ``"percentile"``:
        the given percentile of the map. In both cases a pixel fires only where the map is
        strictly above the threshold, so a constant map (e.g. a flat image) never fires.
    percentile : float, optional
        Percentile in [0, 100) used by ``method="percentile"``.

    Returns
    -------
    fires : dict of str -> (H, W) bool
        Same keys as ``maps``.

    Raises
    ------
    ValueError
        If ``method`` is unknown, ``percentile`` out of range or the maps malformed.

    Examples
    --------
    >>> img = np.zeros((32, 32, 3), np.uint8); img[:, 16:] = 255
    >>> fires = edge_fires(edge_maps(img))
    >>> bool(fires["sobel"][:, 15].all()), bool(fires["sobel"][:, 2].any())
    (True, False)
    """
    _check_maps(maps)
    if method not in _FIRE_METHODS:
        raise ValueError(f"method must be one of {_FIRE_METHODS}, got {method!r}")
    if not 0 <= percentile < 100:
        raise ValueError(f"percentile must be in [0, 100), got {percentile}")
    fires = {}
    for name, emap in maps.items():
        emap = np.asarray(emap, dtype=np.float32)
        if name == "canny":
            fires[name] = emap > 0
            continue
        lo, hi = float(emap.min()), float(emap.max())
        if not hi > lo:
            fires[name] = np.zeros(emap.shape, bool)
            continue
        if method == "otsu":
            # Otsu on the map quantised to 256 levels between its min and max
            levels = np.rint((emap - lo) * (255.0 / (hi - lo))).astype(np.uint8)
            thresh, _ = cv2.threshold(levels, 0, 255, cv2.THRESH_BINARY + cv2.THRESH_OTSU)
            fires[name] = levels > thresh
        else:
            fires[name] = emap > float(np.percentile(emap, percentile))
    return fires


# --------------------------------------------------------------------------- step 3-5
def cv_weights(maps):
    """Coefficient-of-variation weights of the edge maps (METHOD.md B.3-B.5).

    ``E_bar = mean_k E_k``; ``sigma_k = sqrt(mean((E_k - E_bar)^2))``;
    ``CV_k = sigma_k / mu_k`` with ``mu_k = mean(E_k)``; ``w_k = CV_k / sum_j CV_j``.

    Parameters
    ----------
    maps : dict of str -> (H, W) float
        Edge maps on a common scale (output of :func:`edge_maps`).

    Returns
    -------
    weights : dict of str -> float
        Non-negative, summing to 1, same keys and order as ``maps``.

    Notes
    -----
    Guards: a map with ``mu_k = 0`` (the operator responds nowhere) gets ``CV_k = 0``, i.e.
    no weight. If every ``CV_k`` is zero (all maps identical, or all zero as on a flat
    image) the weights fall back to equal weights ``1 / K``.

    Examples
    --------
    >>> a = np.array([[0., 1.], [1., 0.]]); b = np.array([[0., 1.], [1., 1.]])
    >>> w = cv_weights({"a": a, "b": b})
    >>> round(w["a"] + w["b"], 6)
    1.0
    """
    _check_maps(maps)
    names = list(maps)
    stack = [np.asarray(maps[n], dtype=np.float64) for n in names]
    mean_image = sum(stack) / len(stack)
    sigma = np.array([np.sqrt(np.mean((e - mean_image) ** 2)) for e in stack])
    mu = np.array([e.mean() for e in stack])
    cv = np.divide(sigma, mu, out=np.zeros_like(sigma), where=mu > 0)
    total = cv.sum()
    if not total > 0 or not np.isfinite(total):
        weights = np.full(len(names), 1.0 / len(names))
    else:
        weights = cv / total
    return {n: float(w) for n, w in zip(names, weights)}


# --------------------------------------------------------------------------- step 6-7
def feature_region_map(image, *, sigma=1.0, tau=0.5, canny_low=50, canny_high=150,
                       log_sigma=2.0, method="otsu", percentile=90.0, return_weights=False):
    """Binary feature-region map of an image (METHOD.md B.1-B.7).

    ``X_k = 2`` where operator k fires, else 1; ``F = sum_k w_k X_k - (1 + tau)``;
    the map is 1 where ``F >= 0``, else 0. With weights summing to one this keeps the
    pixels where the operators that fire carry at least ``tau`` of the total weight.

    Parameters
    ----------
    image : (H, W, 3) uint8 RGB or (H, W) uint8 array
    sigma : float, optional
        Gaussian filter before the operators (see :func:`edge_maps`).
    tau : float, optional
        Offset of the decision. ``0.5``: weighted majority; ``> 1``: empty map;
        ``<= 0``: full map.
    canny_low, canny_high, log_sigma : float, optional
        Passed to :func:`edge_maps`.
    method, percentile : optional
        Passed to :func:`edge_fires`.
    return_weights : bool, optional
        Also return the operator weights.

    Returns
    -------
    region : (H, W) uint8
        Values in {0, 1}.
    weights : dict of str -> float
        Only if ``return_weights``: the weights of :func:`cv_weights`.

    Raises
    ------
    ValueError
        On malformed inputs (see :func:`edge_maps`, :func:`edge_fires`) or non-finite tau.

    Examples
    --------
    >>> img = np.zeros((32, 32, 3), np.uint8); img[:, 16:] = 255
    >>> region = feature_region_map(img)
    >>> int(region[:, 15].min()), int(region[:, :8].max())
    (1, 0)
    """
    if not np.isfinite(tau):
        raise ValueError(f"tau must be a finite number, got {tau}")
    maps = edge_maps(image, sigma=sigma, canny_low=canny_low, canny_high=canny_high,
                     log_sigma=log_sigma)
    fires = edge_fires(maps, method=method, percentile=percentile)
    weights = cv_weights(maps)

    score = np.zeros(next(iter(maps.values())).shape, np.float64)
    for name in maps:
        score += weights[name] * np.where(fires[name], 2.0, 1.0)
    score -= 1.0 + tau
    # ``sum w_k`` is 1 up to rounding: absorb the rounding so that exact ties (e.g. every
    # operator fires and tau = 1) are decided as in exact arithmetic.
    region = (score >= -1e-12).astype(np.uint8)
    if return_weights:
        return region, weights
    return region
