"""Steps 6-7 of METHOD.md A: proposal fusion, 3-way zones, seeded segmentation.

Per image and per tagged class, the positive proposals (step 5) are fused into
one soft map over superpixels; the map is clustered into *near-background*,
*ambiguous* and *near-object* zones; the near-object zones of all classes
(and, with an implicit background class, the superpixels that are
near-background for every class) become seeds, and a seeded segmentation
algorithm decides the ambiguous area. :func:`pseudo_label` chains all of it,
from the preliminary probability maps to the corrected pseudo-label.

Zone codes: ``0`` near-background, ``1`` ambiguous, ``2`` near-object.
"""

from __future__ import annotations

import warnings

import cv2
import numpy as np
import scipy.ndimage as ndi
import scipy.sparse as sp

from wsseg.tasks.wsss.filtering import filter_proposals, proposal_iou

__all__ = [
    "NEAR_BACKGROUND",
    "AMBIGUOUS",
    "NEAR_OBJECT",
    "fuse_class",
    "three_way",
    "seed_map",
    "seeded_segmentation",
    "pseudo_label",
]

NEAR_BACKGROUND, AMBIGUOUS, NEAR_OBJECT = 0, 1, 2

FUSION_MODES = ("topk", "threshold")
SEEDING_METHODS = ("random_walker", "grabcut", "nearest", "none")
_GRABCUT_MIN_SEEDS = 25


# --------------------------------------------------------------------------- #
# Step 6: fusion
# --------------------------------------------------------------------------- #
def _as_csr(membership):
    if sp.issparse(membership):
        return sp.csr_matrix(membership)
    membership = np.asarray(membership)
    if membership.ndim != 2:
        raise ValueError(
            f"membership must be a (P, S) sparse or dense bool matrix, got shape "
            f"{membership.shape}."
        )
    return sp.csr_matrix(membership.astype(bool))


def fuse_class(membership, prob_c, positive_c, *, mode="topk", k=5, threshold=0.5):
    """Fuse the positive proposals of one class into a soft superpixel map.

    Parameters
    ----------
    membership : (P, S) scipy.sparse matrix of bool
        Row p marks the superpixels of proposal p.
    prob_c : (P,) float array
        The proposal classifier's probability of this class.
    positive_c : (P,) bool array
        Positive proposals of this class (:func:`tasks.wsss.filtering.filter_proposals`).
    mode : {'topk', 'threshold'}, optional
        ``'topk'``: the `k` positives of highest probability (ties broken by
        proposal index); ``'threshold'``: all positives with
        ``prob_c >= threshold``.
    k : int, optional
    threshold : float, optional

    Returns
    -------
    fused : (S,) float32 in [0, 1]
        ``sum_p prob_p * mask_p / sum_p prob_p`` over the selected proposals:
        the probability-weighted average of their masks. All zeros when no
        proposal is selected (or all selected have probability 0).

    Examples
    --------
    >>> m = sp.csr_matrix(np.array([[1, 1, 0], [0, 1, 0]], bool))
    >>> fuse_class(m, np.array([0.75, 0.25]), np.array([True, True]))
    array([0.75, 1.  , 0.  ], dtype=float32)
    """
    m = _as_csr(membership)
    n_prop, n_sp = m.shape
    prob_c = np.asarray(prob_c, dtype=np.float64)
    positive_c = np.asarray(positive_c, dtype=bool)
    if prob_c.shape != (n_prop,) or positive_c.shape != (n_prop,):
        raise ValueError(
            f"prob_c {prob_c.shape} and positive_c {positive_c.shape} must both be "
            f"({n_prop},), one entry per proposal (row of membership)."
        )
    if mode not in FUSION_MODES:
        raise ValueError(f"mode must be one of {FUSION_MODES}, got {mode!r}.")
    if mode == "topk" and int(k) < 1:
        raise ValueError(f"k must be >= 1, got {k}.")

    candidates = np.flatnonzero(positive_c)
    if mode == "topk":
        order = np.argsort(-prob_c[candidates], kind="stable")
        selected = candidates[order[: int(k)]]
    else:
        selected = candidates[prob_c[candidates] >= threshold]
    weights = prob_c[selected]
    if selected.size == 0 or weights.sum() <= 0:
        return np.zeros(n_sp, dtype=np.float32)
    fused = np.asarray(m[selected].astype(np.float64).T @ weights).ravel() / weights.sum()
    return np.clip(fused, 0.0, 1.0).astype(np.float32)


def _segment_costs(s0, s1, s2, i, j):
    """Weighted within-cluster sum of squares of sorted values i..j-1."""
    mass = s0[j] - s0[i]
    tot = s1[j] - s1[i]
    with np.errstate(invalid="ignore", divide="ignore"):
        cost = s2[j] - s2[i] - np.where(mass > 0, tot * tot / np.where(mass > 0, mass, 1), 0.0)
    return np.maximum(cost, 0.0)


def _kmeans3_1d(x, w, max_distinct=1024):
    """Exact weighted 1-D k-means with k = 3 (global optimum, not Lloyd).

    Optimal 1-D clusters are contiguous runs of the sorted distinct values,
    so the best two cut points are found by evaluating every pair (prefix
    sums, O(D^2)). Beyond `max_distinct` distinct values the values are first
    binned to `max_distinct` levels (the cut points are then exact up to one
    bin width). Returns the thresholds (upper ends of clusters 0 and 1).
    """
    v, inverse = np.unique(x, return_inverse=True)
    if v.size > max_distinct:
        span = v[-1] - v[0]
        bins = np.minimum(((x - v[0]) / span * max_distinct).astype(np.int64), max_distinct - 1)
        v_bin, inverse = np.unique(bins, return_inverse=True)
        # Each bin is represented by the weighted mean of its members.
        mass = np.bincount(inverse, weights=w)
        v = np.bincount(inverse, weights=w * x) / np.where(mass > 0, mass, 1)
        upper = np.full(v_bin.size, -np.inf)
        np.maximum.at(upper, inverse, x)
    else:
        upper = v
    if v.size < 3:  # binning left two levels: no ambiguous cluster
        return upper[0], upper[0]
    mass = np.bincount(inverse, weights=w, minlength=v.size)
    s0 = np.concatenate([[0.0], np.cumsum(mass)])
    s1 = np.concatenate([[0.0], np.cumsum(mass * v)])
    s2 = np.concatenate([[0.0], np.cumsum(mass * v * v)])
    d = v.size
    a = np.arange(1, d - 1)[:, None]  # cluster 0 = [0, a)
    b = np.arange(2, d)[None, :]  # cluster 1 = [a, b), cluster 2 = [b, d)
    total = (
        _segment_costs(s0, s1, s2, 0, a)
        + _segment_costs(s0, s1, s2, a, b)
        + _segment_costs(s0, s1, s2, b, d)
    )
    total = np.where(b > a, total, np.inf)
    ia, ib = np.unravel_index(np.argmin(total), total.shape)
    return upper[a[ia, 0] - 1], upper[b[0, ib] - 1]


def three_way(values, *, weights=None):
    """Split a fused map into near-background, ambiguous and near-object zones: weighted 1-D
    k-means with k = 3, solved exactly (the global optimum over all splits of the sorted values
    into three runs, not Lloyd iterations that depend on a start); zones are the clusters ordered
    by centre. (Cuts at fixed values or quantiles were removed with the option
    ``proposals.clustering``, see docs/benchmarks.md#defaults-and-why.)

    Parameters
    ----------
    values : (S,) float array
        The fused values of one class (:func:`fuse_class`), normally in [0, 1].
    weights : (S,) float array, optional
        Non-negative weight of each value, e.g. the superpixel areas, so that
        k-means clusters pixels rather than superpixels. Default: all ones.

    Returns
    -------
    zones : (S,) int8
        0 near-background, 1 ambiguous, 2 near-object.

    Notes
    -----
    Degenerate inputs of k-means: with a single distinct value every entry
    is near-object if that value is >= 0.5 and near-background otherwise
    (fused maps live in [0, 1]); with two distinct values the lower one is
    near-background and the higher near-object (no ambiguous zone). With
    more than 1024 distinct values k-means runs on 1024 equal-width bins.

    Examples
    --------
    >>> three_way(np.array([0.0, 0.0, 0.5, 0.55, 1.0, 0.95]))
    array([0, 0, 1, 1, 2, 2], dtype=int8)
    """
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"values must be 1-D (S,), got shape {x.shape}.")
    if not np.all(np.isfinite(x)):
        raise ValueError("values must be finite; replace NaN/inf before clustering.")
    w = np.ones_like(x) if weights is None else np.asarray(weights, dtype=np.float64)
    if w.shape != x.shape or np.any(w < 0):
        raise ValueError(
            f"weights must be non-negative with the shape of values {x.shape}, got "
            f"{w.shape}."
        )
    zones = np.full(x.shape, AMBIGUOUS, dtype=np.int8)
    if x.size == 0:
        return zones

    distinct = np.unique(x)
    if distinct.size == 1:
        zones[:] = NEAR_OBJECT if distinct[0] >= 0.5 else NEAR_BACKGROUND
        return zones
    if distinct.size == 2:
        zones[x == distinct[0]] = NEAR_BACKGROUND
        zones[x == distinct[1]] = NEAR_OBJECT
        return zones
    if w.sum() <= 0:
        w = np.ones_like(x)
    cut0, cut1 = _kmeans3_1d(x, w)
    zones[x <= cut0] = NEAR_BACKGROUND
    zones[x > cut1] = NEAR_OBJECT
    return zones


def seed_map(fused, zones, *, background=None):
    """Combine the zones of the tagged classes into one superpixel seed map.

    Rule, per superpixel:

    1. near-object for exactly one class t -> seed ``t + 1``;
    2. near-object for several classes -> the one of highest fused value
       (first index on ties), ``+ 1``;
    3. otherwise, when `background` is given and the superpixel is
       near-background for *every* class -> seed `background`;
    4. otherwise 0: unseeded (ambiguous), left to the seeded segmentation.

    Parameters
    ----------
    fused : (S, T) float array
        Fused map of each of the T tagged classes.
    zones : (S, T) int8 array
        Their zones (:func:`three_way`).
    background : int, optional
        Seed value of the implicit background class, outside ``1..T``
        (``T + 1`` is the natural choice). None: no background seeds.

    Returns
    -------
    seeds : (S,) int32
        0 unseeded, ``1..T`` a tagged class, `background` the background.

    Examples
    --------
    >>> f = np.array([[1.0, 0.0], [0.8, 0.9], [0.0, 0.0], [0.5, 0.0]])
    >>> z = np.array([[2, 0], [2, 2], [0, 0], [1, 0]], np.int8)
    >>> seed_map(f, z, background=3)
    array([1, 2, 3, 0], dtype=int32)
    """
    fused = np.asarray(fused, dtype=np.float64)
    zones = np.asarray(zones)
    if fused.ndim != 2 or zones.shape != fused.shape:
        raise ValueError(
            f"fused {fused.shape} and zones {zones.shape} must both be (S, T)."
        )
    n_sp, n_cls = fused.shape
    if background is not None and 1 <= int(background) <= n_cls:
        raise ValueError(
            f"background seed value {background} collides with the class seeds "
            f"1..{n_cls}; use {n_cls + 1}."
        )
    seeds = np.zeros(n_sp, dtype=np.int32)
    if n_cls == 0:
        if background is not None:
            seeds[:] = int(background)
        return seeds
    near = zones == NEAR_OBJECT
    score = np.where(near, fused, -np.inf)
    best = np.argmax(score, axis=1)
    has_object = near.any(axis=1)
    seeds[has_object] = best[has_object] + 1
    if background is not None:
        all_bg = np.all(zones == NEAR_BACKGROUND, axis=1)
        seeds[all_bg & ~has_object] = int(background)
    return seeds


# --------------------------------------------------------------------------- #
# Step 7: seeded segmentation
# --------------------------------------------------------------------------- #
def _block_mean(image, f):
    """(h, w, C) float64 means of the f x f blocks of the edge-padded image.

    An integer image is summed in integers, then divided by f * f: the sums of float64 means are
    exact integers either way, so the result is the float64 mean's, bit for bit."""
    h, w = image.shape[:2]
    ph, pw = -h % f, -w % f
    padded = np.pad(image, ((0, ph), (0, pw), (0, 0)), mode="edge")
    hh, ww = padded.shape[0] // f, padded.shape[1] // f
    if padded.dtype == np.uint8:
        blocks = padded.reshape(hh, f, ww, f, -1)
        total = np.zeros((hh, ww, padded.shape[2]), np.int32)
        for i in range(f):
            for j in range(f):
                total += blocks[:, i, :, j]
        return total / float(f * f)
    return padded.reshape(hh, f, ww, f, -1).mean(axis=(1, 3))


def _block_seeds(seeds, f, n):
    """A block takes seed c when more than half of its pixels are seeds of c."""
    h, w = seeds.shape
    padded = np.pad(seeds, ((0, -h % f), (0, -w % f)), mode="edge")
    hh, ww = padded.shape[0] // f, padded.shape[1] // f
    # pixels of each label in each block; at most one label holds more than half of a block
    block = (np.arange(hh)[:, None, None, None] * ww + np.arange(ww)[None, None, :, None]).astype(np.int64)
    code = (np.broadcast_to(block, (hh, f, ww, f)) * (n + 1) + padded.reshape(hh, f, ww, f)).ravel()
    counts = np.bincount(code, minlength=hh * ww * (n + 1)).reshape(hh, ww, n + 1)
    counts[..., 0] = 0
    best = counts.argmax(axis=-1)
    out = np.where(np.take_along_axis(counts, best[..., None], axis=-1)[..., 0] * 2 > f * f, best, 0)
    return out.astype(np.int32)


def _upsample(prob, shape, f):
    """(m, h, w) -> (m, H, W) by bilinear resize of the padded grid, then crop."""
    h, w = prob.shape[1:]
    up = np.stack(
        [cv2.resize(p, (w * f, h * f), interpolation=cv2.INTER_LINEAR) for p in prob]
    )
    return up[:, : shape[0], : shape[1]]


def _random_walker(image_f, seeds, beta, tol):
    from skimage.segmentation import random_walker

    try:
        import pyamg  # noqa: F401

        mode = "cg_mg"
    except ImportError:  # pragma: no cover - pyamg is a dependency
        warnings.warn("pyamg is not installed; random walker falls back to mode='cg_j'.")
        mode = "cg_j"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "labels not connected to any seed" etc.
        prob = random_walker(
            image_f, seeds, beta=beta, mode=mode, tol=tol,
            return_full_prob=True, channel_axis=-1,
        )
    return np.nan_to_num(np.asarray(prob, dtype=np.float32), nan=0.0)


def _gmm_logpdf(model, pixels):
    """Log density of OpenCV's 5-component GrabCut colour GMM at (N, 3) pixels.

    ``pixels`` may also be a tuple of its three (N,) contiguous columns (faster). The quadratic
    form is summed term by term, ``d_i * inv_ij * d_j`` for i, then j, from 0: the order of
    ``np.einsum("ni,ij,nj->n")``, whose results it reproduces bit for bit at a third of the cost.
    """
    model = np.asarray(model, dtype=np.float64).ravel()
    n_comp = model.size // 13
    coefs = model[:n_comp]
    means = model[n_comp : 4 * n_comp].reshape(n_comp, 3)
    covs = model[4 * n_comp :].reshape(n_comp, 3, 3) + 1e-2 * np.eye(3)
    cols = pixels if isinstance(pixels, tuple) else tuple(
        np.ascontiguousarray(pixels[:, i]) for i in range(3))
    logs = []
    for c in range(n_comp):
        if coefs[c] <= 0:
            continue
        d = [cols[i] - means[c, i] for i in range(3)]
        inv = np.linalg.inv(covs[c])
        _, logdet = np.linalg.slogdet(covs[c])
        maha = np.zeros(d[0].shape)
        for i in range(3):
            for j in range(3):
                maha += d[i] * inv[i, j] * d[j]
        logs.append(np.log(coefs[c]) - 0.5 * (maha + logdet + 3 * np.log(2 * np.pi)))
    return np.logaddexp.reduce(np.stack(logs), axis=0)


def _grabcut(image_u8, seeds, n, iters, seed):
    """One-vs-rest GrabCut per label; (n, h, w) scores in [0, 1].

    The colour posterior depends on a pixel's colour only, so it is evaluated once per distinct
    colour of the image and spread back to the pixels."""
    h, w = seeds.shape
    flat = image_u8.reshape(-1, 3)
    codes = (flat[:, 0].astype(np.int32) << 16) | (flat[:, 1].astype(np.int32) << 8) | flat[:, 2]
    colours, inverse = np.unique(codes, return_inverse=True)
    cols = tuple(((colours >> s) & 255).astype(np.float64) for s in (16, 8, 0))
    unseeded = seeds == 0
    seeded = ~unseeded
    nearest = None
    scores = np.zeros((n, h, w), dtype=np.float32)
    for c in range(1, n + 1):
        this = seeds == c
        if not this.any():
            continue
        mask = np.where(this, np.uint8(cv2.GC_FGD),
                        np.where(seeded, np.uint8(cv2.GC_BGD), np.uint8(cv2.GC_PR_BGD)))
        bgd, fgd = np.zeros((1, 65), np.float64), np.zeros((1, 65), np.float64)
        cv2.setRNGSeed(int(seed))
        try:
            cv2.grabCut(image_u8, mask, None, bgd, fgd, int(iters), cv2.GC_INIT_WITH_MASK)
        except cv2.error:
            # Too few seed pixels to fit the colour models: the label scores
            # 0.5 where its seeds are the nearest ones.
            if nearest is None:
                _, (ri, ci) = ndi.distance_transform_edt(unseeded, return_indices=True)
                nearest = seeds[ri, ci]
            scores[c - 1] = 0.5 * (nearest == c)
            continue
        fg = (mask & 1).astype(bool)  # GC_FGD = 1, GC_PR_FGD = 3
        post = 1.0 / (1.0 + np.exp(np.clip(_gmm_logpdf(bgd, cols) - _gmm_logpdf(fgd, cols), -50, 50)))
        # GrabCut's graph-cut decision dominates, the colour posterior ranks.
        scores[c - 1] = 0.5 * fg + 0.5 * post[inverse].reshape(h, w)
    return scores


def seeded_segmentation(
    image,
    seeds,
    *,
    method="random_walker",
    beta=130.0,
    downscale=1,
    tol=1e-3,
    grabcut_iters=3,
    seed=0,
    prior=None,
    prior_weight=0.0,
):
    """Grow seed labels over the unseeded area of an image.

    Parameters
    ----------
    image : (H, W, 3) uint8
        RGB image.
    seeds : (H, W) int array
        0 = unseeded, ``1..n`` = seed labels (labels may be missing).
    method : {'random_walker', 'grabcut', 'nearest', 'none'}, optional
        ``'random_walker'``: :func:`skimage.segmentation.random_walker`
        (``mode='cg_mg'``, full probabilities) on the image scaled to [0, 1].
        ``'grabcut'``: one :func:`cv2.grabCut` per label, initialised with
        the mask (this label's seeds = sure foreground, other seeds = sure
        background, unseeded = probable background); the score of a label is
        ``0.5 * [GrabCut says foreground] + 0.5 * P(fg | colour)`` from the
        two fitted colour GMMs; scores are normalised over labels.
        ``'nearest'``: the label of the nearest seed (Euclidean), confidence
        ``1 / (1 + distance)``. ``'none'``: unseeded pixels stay 0.
    beta : float, optional
        Random-walker edge penalty.
    downscale : int, optional
        Solve on a grid ``downscale`` times smaller (block means of the image;
        a block is a seed when more than half of it is seeds of one label),
        then upsample the probabilities bilinearly. Full-resolution seeds are
        always kept. Ignored by 'nearest' and 'none'.
    tol : float, optional
        Random-walker solver tolerance.
    grabcut_iters : int, optional
    seed : int, optional
        Seeds OpenCV's RNG (GrabCut's GMM initialisation).
    prior : (n, H, W) float array, optional
        Class evidence of each seed label ``1..n`` (row ``l - 1`` for label ``l``), e.g. the
        preliminary result. With ``prior_weight`` w > 0 the probabilities of the unseeded
        pixels become the normalised ``P_seg ** (1 - w) * prior ** w`` [ours]: the seeded
        segmentation knows colour and boundaries but nothing of the classes, the prior knows
        the classes but not the boundaries.
    prior_weight : float in [0, 1], optional

    Returns
    -------
    labels : (H, W) int32
        In ``1..n``; 0 only where undecided (method 'none', or no seed at all).
    confidence : (H, W) float32 in [0, 1]
        Probability of the chosen label (1 on seeds, 0 where undecided).

    Notes
    -----
    A single seeded label takes the whole image (confidence 1); no seeds
    leave everything 0 (confidence 0).
    """
    # parse
    image = np.asarray(image)
    seeds = np.asarray(seeds)
    if image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"image must be (H, W, 3) RGB, got shape {image.shape}.")
    if seeds.shape != image.shape[:2]:
        raise ValueError(
            f"seeds has shape {seeds.shape} but the image is {image.shape[:2]}; "
            f"paint the superpixel seeds onto the image grid first."
        )
    if method not in SEEDING_METHODS:
        raise ValueError(f"method must be one of {SEEDING_METHODS}, got {method!r}.")
    if int(downscale) < 1:
        raise ValueError(f"downscale must be an integer >= 1, got {downscale}.")
    if seeds.size and seeds.min() < 0:
        raise ValueError("seeds must be >= 0 (0 = unseeded).")
    if not 0.0 <= float(prior_weight) <= 1.0:
        raise ValueError(f"prior_weight must be in [0, 1], got {prior_weight}.")
    if prior_weight > 0:
        prior = np.asarray(prior, dtype=np.float32) if prior is not None else None
        if prior is None or prior.ndim != 3 or prior.shape[1:] != seeds.shape or prior.shape[0] < seeds.max():
            raise ValueError(f"prior must be (n >= {int(seeds.max())}, {seeds.shape[0]}, {seeds.shape[1]}) "
                             f"when prior_weight > 0, got {None if prior is None else prior.shape}.")
    seeds = seeds.astype(np.int32)
    f = int(downscale)
    shape = seeds.shape
    top = int(seeds.max()) if seeds.size else 0
    if top <= 4 * seeds.size + 1024:  # seed values 1..n, n small: count them
        present = np.flatnonzero(np.bincount(seeds.ravel(), minlength=1)[1:]).astype(np.int32) + np.int32(1)
    else:
        present = np.unique(seeds[seeds > 0])

    # trivial cases
    if present.size == 0:
        return np.zeros(shape, np.int32), np.zeros(shape, np.float32)
    if present.size == 1:
        return np.full(shape, present[0], np.int32), np.ones(shape, np.float32)
    unseeded = seeds == 0
    if method == "none" or not unseeded.any():
        return seeds.copy(), (~unseeded).astype(np.float32)
    if method == "nearest":
        dist, (ri, ci) = ndi.distance_transform_edt(unseeded, return_indices=True)
        return seeds[ri, ci].astype(np.int32), (1.0 / (1.0 + dist)).astype(np.float32)

    # preprocess: compact labels 1..m, optional downscaling
    m = present.size
    if present[-1] <= 4 * seeds.size + 1024:
        lut = np.zeros(int(present[-1]) + 1, np.int64)
        lut[present] = np.arange(1, m + 1)
        compact = lut[seeds]
    else:
        compact = np.searchsorted(present, seeds) + 1
        compact[unseeded] = 0
    if f > 1:
        small_img = _block_mean(image if image.dtype == np.uint8 else image.astype(np.float64), f)
        small_seeds = _block_seeds(compact, f, m)
        per_label = np.bincount(small_seeds.ravel(), minlength=m + 1)[1:]
        # Keep full resolution when a label lost its seeds, or (GrabCut) kept
        # too few pixels to fit its colour model.
        if per_label.min() < (_GRABCUT_MIN_SEEDS if method == "grabcut" else 1):
            small_img, small_seeds, f = image.astype(np.float64), compact, 1
    else:
        small_img, small_seeds = image.astype(np.float64), compact

    # solve
    if method == "random_walker":
        prob = _random_walker(small_img / 255.0, small_seeds, beta, tol)
    else:
        img_u8 = np.clip(np.rint(small_img), 0, 255).astype(np.uint8)
        prob = _grabcut(np.ascontiguousarray(img_u8), small_seeds, m, grabcut_iters, seed)
    if f > 1:
        prob = _upsample(prob, shape, f)

    # assemble: normalise, mix in the prior, force the full-resolution seeds
    total = prob.sum(axis=0, keepdims=True)
    prob = np.where(total > 0, prob / np.where(total > 0, total, 1), 1.0 / m)
    if prior_weight > 0:
        w = float(prior_weight)
        prob = (prob + 1e-4) ** (1.0 - w) * (np.maximum(prior[present - 1], 0.0) + 1e-4) ** w
        prob /= prob.sum(axis=0, keepdims=True)
    seeded = ~unseeded
    prob = np.where(seeded[None], (compact[None] - 1 == np.arange(m)[:, None, None]).astype(prob.dtype), prob)
    best = np.argmax(prob, axis=0)
    labels = present[best].astype(np.int32)
    confidence = np.take_along_axis(prob, best[None], axis=0)[0].astype(np.float32)
    return labels, confidence


# --------------------------------------------------------------------------- #
# Steps 5-7 for one image
# --------------------------------------------------------------------------- #
def _argmax_channels(maps, channels):
    """``np.argmax(maps[channels], axis=0)`` without copying the channels (first maximum wins;
    with a NaN anywhere, numpy's own answer)."""
    best = np.zeros(maps.shape[1:], np.intp)
    value = maps[channels[0]]
    nan = np.isnan(value)
    for j in range(1, len(channels)):
        v = maps[channels[j]]
        better = v > value
        best[better] = j
        value = np.where(better, v, value)
        nan |= np.isnan(v)
    if nan.any():
        return np.argmax(maps[channels], axis=0)
    return best


def _class_counts(sp_labels, class_map, n_sp, n_classes):
    flat = sp_labels.ravel().astype(np.int64) * n_classes + class_map.ravel()
    return np.bincount(flat, minlength=n_sp * n_classes).reshape(n_sp, n_classes)


def pseudo_label(
    image,
    sp_labels,
    membership,
    prob,
    prelim,
    tags,
    *,
    background=None,
    t1=0.0,
    p1=0.0,
    t2=0.1,
    p2=0.2,
    fusion="threshold",
    k=5,
    threshold=0.5,
    seeding="grabcut",
    beta=130.0,
    downscale=3,
    seed=0,
    prior_weight=0.5,
    grabcut_iters=3,
):
    """The corrected result (pseudo-label) of one image: METHOD.md A steps 5-7.

    Phases:

    1. the preliminary class of each pixel = argmax of `prelim` over the
       tagged classes (and `background`, when given); its per-superpixel pixel
       counts give the exact proposal-class IoU (step 5);
    2. positives / negatives by the thresholds t1, p1, t2, p2;
    3. per tagged object class, fuse its positives (:func:`fuse_class`) and
       cluster into zones (:func:`three_way`, weighted by superpixel area).
       **Fallback**: a class with no positive proposal uses, as its fused
       map, the share of each superpixel's pixels whose preliminary class is
       that class;
    4. seeds by :func:`seed_map` (background seeds only with `background`);
    5. :func:`seeded_segmentation` decides the unseeded pixels;
    6. seed labels become dataset class indices; undecided pixels become 255.

    Parameters
    ----------
    image : (H, W, 3) uint8
    sp_labels : (H, W) int array
        Superpixel ids 0..S-1.
    membership : (P, S) scipy.sparse matrix of bool
        Proposals.
    prob : (P, K) float array
        Proposal class probabilities.
    prelim : (K, H, W) float array
        Preliminary per-pixel class probabilities (step 1).
    tags : (K,) bool array
        Image-level labels.
    background : int, optional
        Dataset index of an implicit background class (never tagged, always
        possible). None when every pixel belongs to a tagged class (msrc21):
        then no pixel becomes background.
    t1, p1, t2, p2 : float
        Filtering thresholds (:func:`tasks.wsss.filtering.filter_proposals`).
    fusion, k, threshold
        :func:`fuse_class` options.
    seeding : str
        :func:`seeded_segmentation` method.
    beta, downscale, grabcut_iters
        :func:`seeded_segmentation` options.
    seed : int, optional
    prior_weight : float, optional
        Weight of `prelim` as the prior of :func:`seeded_segmentation` [ours]; 0 = the
        seeded segmentation alone decides the ambiguous area, as METHOD.md step 7.

    Returns
    -------
    label : (H, W) uint8
        Dataset class indices, 255 = ignore.
    info : dict
        ``positives`` {class index: number of positive proposals},
        ``negatives`` likewise, ``fallback`` list of classes that used the
        preliminary map, ``seed_share`` and ``ambiguous_share`` (pixel shares
        seeded / unseeded before step 7), ``ignore_share`` of the result.

    Notes
    -----
    With no implicit background, a single tag makes the whole image that
    class, and no tag makes it all 255; with a background and no object tag,
    the image is all background.
    """
    # parse
    image = np.asarray(image)
    sp_labels = np.asarray(sp_labels)
    prelim = np.asarray(prelim)
    prob = np.asarray(prob, dtype=np.float32)
    tags = np.asarray(tags, dtype=bool)
    m = _as_csr(membership)
    if image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"image must be (H, W, 3) RGB, got shape {image.shape}.")
    h, w = image.shape[:2]
    if sp_labels.shape != (h, w):
        raise ValueError(f"sp_labels has shape {sp_labels.shape}, the image is {(h, w)}.")
    if prelim.ndim != 3 or prelim.shape[1:] != (h, w):
        raise ValueError(f"prelim must be (K, {h}, {w}), got {prelim.shape}.")
    n_classes = prelim.shape[0]
    n_sp = int(sp_labels.max()) + 1 if sp_labels.size else 0
    if tags.shape != (n_classes,):
        raise ValueError(f"tags must be ({n_classes},) bool, got shape {tags.shape}.")
    if m.shape[1] != n_sp or prob.shape != (m.shape[0], n_classes):
        raise ValueError(
            f"membership {m.shape} must be (P, S={n_sp}) and prob {prob.shape} must be "
            f"(P, K={n_classes}) for these superpixels and classes."
        )
    if background is not None and not 0 <= int(background) < n_classes:
        raise ValueError(f"background must be a class index in 0..{n_classes - 1}, got {background}.")

    object_tags = tags.copy()
    if background is not None:
        object_tags[int(background)] = False
    classes = np.flatnonzero(object_tags)
    n_obj = classes.size
    info = {"positives": {}, "negatives": {}, "fallback": [],
            "seed_share": 1.0, "ambiguous_share": 0.0}

    # trivial images
    if n_obj == 0 or (n_obj == 1 and background is None):
        fill = 255 if n_obj == 0 and background is None else (
            int(background) if n_obj == 0 else int(classes[0]))
        label = np.full((h, w), fill, dtype=np.uint8)
        info["ignore_share"] = float(fill == 255)
        return label, info

    # 1. preliminary classes restricted to the allowed ones, IoU (step 5)
    allowed = classes if background is None else np.append(classes, int(background))
    prelim_cls = allowed[_argmax_channels(prelim, allowed)]
    areas = np.bincount(sp_labels.ravel(), minlength=n_sp)
    counts = _class_counts(sp_labels, prelim_cls, n_sp, n_classes)
    iou = proposal_iou(m, areas, counts)

    # 2. filtering
    positive, negative = filter_proposals(iou, prob, object_tags, t1=t1, p1=p1, t2=t2, p2=p2)

    # 3. fusion and 3-way zones per tagged object class (step 6)
    fused = np.zeros((n_sp, n_obj), dtype=np.float32)
    zones = np.zeros((n_sp, n_obj), dtype=np.int8)
    safe_areas = np.maximum(areas, 1)
    for j, c in enumerate(classes):
        info["positives"][int(c)] = int(positive[:, c].sum())
        info["negatives"][int(c)] = int(negative[:, c].sum())
        if positive[:, c].any():
            fused[:, j] = fuse_class(m, prob[:, c], positive[:, c], mode=fusion, k=k, threshold=threshold)
        else:
            info["fallback"].append(int(c))
            fused[:, j] = counts[:, c] / safe_areas
        zones[:, j] = three_way(fused[:, j], weights=areas)

    # 4. seeds
    bg_seed = n_obj + 1 if background is not None else None
    seeds = seed_map(fused, zones, background=bg_seed)[sp_labels]
    info["seed_share"] = float(np.count_nonzero(seeds) / seeds.size)
    info["ambiguous_share"] = 1.0 - info["seed_share"]

    # 5. seeded segmentation of the ambiguous area (step 7)
    prior = None
    if prior_weight > 0:
        rows = list(classes) + ([int(background)] if background is not None else [])
        prior = prelim[rows]
    seg, _ = seeded_segmentation(
        image, seeds, method=seeding, beta=beta, downscale=downscale, seed=seed,
        prior=prior, prior_weight=prior_weight, grabcut_iters=grabcut_iters,
    )

    # 6. dataset class indices, ignore
    lut = np.full(n_obj + 2, 255, dtype=np.uint8)
    lut[1 : n_obj + 1] = classes
    if background is not None:
        lut[n_obj + 1] = int(background)
    label = lut[seg]
    info["ignore_share"] = float(np.count_nonzero(label == 255) / label.size)
    return label, info
