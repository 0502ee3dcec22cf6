"""Appearance features of superpixels and proposals for the proposal classifier.

:func:`superpixel_features` describes every superpixel by colour (CIELab mean, standard
deviation and histograms, a joint a*b* histogram, saturation-weighted hue and HSV
histograms), texture (a Gaussian-derivative / LoG filter bank on L* at three scales and a
uniform LBP histogram), position, size and edge density. :data:`FEATURE_NAMES` names the
columns. :func:`proposal_features` averages them over the superpixels of each proposal,
weighted by area, and appends the proposal's own shape (:data:`PROPOSAL_EXTRA_NAMES`).

Every per-superpixel statistic is a :func:`numpy.bincount` over the label map, so a 320x240
image with 300 superpixels takes a few tens of milliseconds.
"""

from __future__ import annotations

import cv2
import numpy as np
import scipy.sparse as sp

from wsseg.tasks.wsss.superpixels import check_image_and_labels

__all__ = ["FEATURE_NAMES", "PROPOSAL_EXTRA_NAMES", "feature_names", "superpixel_features",
           "proposal_features"]

_LAB_BINS = 8
_AB_JOINT = 4
_AB_RANGE = (64, 192)  # a*, b* of cv2's uint8 Lab (128 = neutral); outside -> end bins
_HUE_BINS = 12
_SV_BINS = 4
_SCALES = (1.0, 2.0, 4.0)
_LBP_P, _LBP_R = 8, 1


def feature_names():
    """Names of the columns of :func:`superpixel_features`, in order.

    Returns
    -------
    names : tuple of str
        ``lab_mean_*`` (3), ``lab_std_*`` (3), ``hist_L/a/b_*`` (24), ``hist_ab_*`` (16),
        ``hist_hue_*`` (12), ``hist_sat_*`` (4), ``hist_val_*`` (4), ``grad_s*`` (3),
        ``log_s*`` (3), ``absdx_s*`` / ``absdy_s*`` (4), ``lbp_*`` (10), position
        ``cy, cx, ymin, ymax, xmin, xmax`` (6), ``area_share``, ``edge_density``: 94 in all.
    """
    names = [f"lab_mean_{c}" for c in "Lab"] + [f"lab_std_{c}" for c in "Lab"]
    names += [f"hist_{c}_{i}" for c in "Lab" for i in range(_LAB_BINS)]
    names += [f"hist_ab_{i}_{j}" for i in range(_AB_JOINT) for j in range(_AB_JOINT)]
    names += [f"hist_hue_{i}" for i in range(_HUE_BINS)]
    names += [f"hist_sat_{i}" for i in range(_SV_BINS)] + [f"hist_val_{i}" for i in range(_SV_BINS)]
    names += [f"grad_s{s:g}" for s in _SCALES] + [f"log_s{s:g}" for s in _SCALES]
    names += [f"absd{d}_s{s:g}" for s in _SCALES[:2] for d in "xy"]
    names += [f"lbp_{i}" for i in range(_LBP_P + 2)]
    names += ["cy", "cx", "ymin", "ymax", "xmin", "xmax", "area_share", "edge_density"]
    return tuple(names)


#: Column names of :func:`superpixel_features` (D = 94).
FEATURE_NAMES = feature_names()

#: Columns that :func:`proposal_features` appends after the D pooled ones.
PROPOSAL_EXTRA_NAMES = ("prop_area_share", "prop_box_h", "prop_box_w", "prop_fill")


# --------------------------------------------------------------------------- helpers
class _Pooler:
    """Per-superpixel means and histograms over one label map."""

    def __init__(self, labels, n):
        self.idx = labels.ravel().astype(np.int64)
        self.n = n
        self.size = np.bincount(self.idx, minlength=n).astype(np.float64)

    def mean(self, values):
        sums = np.bincount(self.idx, weights=values.ravel().astype(np.float64), minlength=self.n)
        return sums / self.size

    def hist(self, codes, n_bins, weights=None):
        """(S, n_bins) histogram of integer codes, divided by the superpixel's pixel count."""
        flat = self.idx * n_bins + codes.ravel().astype(np.int64)
        w = None if weights is None else weights.ravel().astype(np.float64)
        counts = np.bincount(flat, weights=w, minlength=self.n * n_bins).reshape(self.n, n_bins)
        return counts / self.size[:, None]


def _quantise(channel, lo, hi, n_bins):
    scaled = (channel.astype(np.float32) - lo) * (n_bins / float(hi - lo))
    return np.clip(scaled, 0, n_bins - 1).astype(np.int64)


def _colour(image, pool):
    lab_f = cv2.cvtColor(image.astype(np.float32) / 255.0, cv2.COLOR_RGB2Lab)  # L 0..100
    lab_f = lab_f / np.array([100.0, 128.0, 128.0], np.float32)
    means = [pool.mean(lab_f[..., c]) for c in range(3)]
    stds = [np.sqrt(np.maximum(pool.mean(lab_f[..., c] ** 2) - m**2, 0.0))
            for c, m in enumerate(means)]

    lab = cv2.cvtColor(image, cv2.COLOR_RGB2Lab)  # uint8, a/b offset 128
    hists = [pool.hist(_quantise(lab[..., 0], 0, 256, _LAB_BINS), _LAB_BINS)]
    hists += [pool.hist(_quantise(lab[..., c], *_AB_RANGE, _LAB_BINS), _LAB_BINS) for c in (1, 2)]
    qa = _quantise(lab[..., 1], *_AB_RANGE, _AB_JOINT)
    qb = _quantise(lab[..., 2], *_AB_RANGE, _AB_JOINT)
    hists.append(pool.hist(qa * _AB_JOINT + qb, _AB_JOINT**2))

    hsv = cv2.cvtColor(image, cv2.COLOR_RGB2HSV)  # H 0..179, S, V 0..255
    saturation = hsv[..., 1].astype(np.float32) / 255.0
    hists.append(pool.hist(_quantise(hsv[..., 0], 0, 180, _HUE_BINS), _HUE_BINS, weights=saturation))
    hists.append(pool.hist(_quantise(hsv[..., 1], 0, 256, _SV_BINS), _SV_BINS))
    hists.append(pool.hist(_quantise(hsv[..., 2], 0, 256, _SV_BINS), _SV_BINS))
    return np.column_stack(means + stds), np.concatenate(hists, axis=1), lab_f[..., 0]


def _lbp_uniform(gray, n_points, radius):
    """``skimage.feature.local_binary_pattern(gray, n_points, radius, method="uniform")`` of a
    uint8 image, bit for bit, with whole-image array operations instead of a per-pixel loop.

    As scikit-image: the neighbours lie on a circle (offsets rounded to 5 decimals), bilinearly
    interpolated from the float64 image with zeros outside; a neighbour is set when it is >= the
    centre; a pattern with at most two changes along the (open) chain of neighbours is its
    number of set neighbours, any other is ``n_points + 1``. Every interpolation is evaluated
    with scikit-image's expression (the fractional offsets of each row and column, computed as
    it does), so that even its rounding is reproduced."""
    img = gray.astype(np.float64)
    h, w = img.shape
    k = np.arange(n_points, dtype=np.float64)
    rp = np.round(-radius * np.sin(2 * np.pi * k / n_points), 5)
    cp = np.round(radius * np.cos(2 * np.pi * k / n_points), 5)
    pad = int(np.ceil(radius)) + 1
    padded = np.zeros((h + 2 * pad, w + 2 * pad))
    padded[pad:pad + h, pad:pad + w] = img
    rows, cols = np.arange(h, dtype=np.float64), np.arange(w, dtype=np.float64)
    ones = np.zeros((h, w), np.uint8)
    changes = np.zeros((h, w), np.uint8)
    previous = None
    for i in range(n_points):
        r, c = rows + rp[i], cols + cp[i]
        minr, maxr, minc, maxc = np.floor(r), np.ceil(r), np.floor(c), np.ceil(c)
        offsets = [(v - base).astype(np.int64) for v, base in ((minr, rows), (maxr, rows), (minc, cols), (maxc, cols))]
        if any(o.min() != o.max() for o in offsets):  # not for radii of realistic size
            from skimage.feature import local_binary_pattern
            return local_binary_pattern(gray, n_points, radius, method="uniform")
        r0, r1, c0, c1 = (int(o[0]) + pad for o in offsets)
        dr, dc = (r - minr)[:, None], (c - minc)[None, :]
        top_left = padded[r0:r0 + h, c0:c0 + w]
        if r0 == r1 and c0 == c1 and not dr.any() and not dc.any():
            texture = top_left  # a grid point: the interpolation gives the pixel itself (finite, >= 0)
        else:
            top = (1 - dc) * top_left + dc * padded[r0:r0 + h, c1:c1 + w]
            bottom = (1 - dc) * padded[r1:r1 + h, c0:c0 + w] + dc * padded[r1:r1 + h, c1:c1 + w]
            texture = (1 - dr) * top + dr * bottom
        bit = texture - img >= 0
        ones += bit
        if previous is not None:
            changes += bit != previous
        previous = bit
    return np.where(changes <= 2, ones, n_points + 1).astype(np.float64)


def _texture(lightness, image, pool):
    """Scale-normalised filter-bank responses on L* (in [0, 1]) and a uniform LBP histogram."""
    cols = {"grad": [], "log": [], "absd": []}
    for s in _SCALES:
        smooth = cv2.GaussianBlur(lightness, (0, 0), s, borderType=cv2.BORDER_REFLECT)
        dx = cv2.Sobel(smooth, cv2.CV_32F, 1, 0, ksize=3, scale=s / 8.0, borderType=cv2.BORDER_REFLECT)
        dy = cv2.Sobel(smooth, cv2.CV_32F, 0, 1, ksize=3, scale=s / 8.0, borderType=cv2.BORDER_REFLECT)
        lap = cv2.Laplacian(smooth, cv2.CV_32F, ksize=1, scale=s * s, borderType=cv2.BORDER_REFLECT)
        # not cv2.magnitude: its result varies in the last bits with the arrays' memory alignment
        # (two runs of one image differed), which made the proposal classifier, and so the
        # pseudo-labels, differ between two runs of one configuration
        cols["grad"].append(pool.mean(np.sqrt(dx * dx + dy * dy)))
        cols["log"].append(pool.mean(np.abs(lap)))
        if s in _SCALES[:2]:
            cols["absd"] += [pool.mean(np.abs(dx)), pool.mean(np.abs(dy))]
    gray = cv2.cvtColor(image, cv2.COLOR_RGB2GRAY)
    lbp = _lbp_uniform(gray, _LBP_P, _LBP_R)  # 0..P+1
    lbp_hist = pool.hist(lbp.astype(np.int64), _LBP_P + 2)
    return np.column_stack(cols["grad"] + cols["log"] + cols["absd"]), lbp_hist


def _position(labels, n, pool):
    from scipy.ndimage import find_objects

    h, w = labels.shape
    ys, xs = np.mgrid[0:h, 0:w]
    cy = pool.mean((ys + 0.5) / h)
    cx = pool.mean((xs + 0.5) / w)
    box = np.zeros((n, 4))
    for i, sl in enumerate(find_objects(labels.astype(np.int64) + 1, max_label=n)):
        if sl is not None:
            box[i] = (sl[0].start / h, sl[0].stop / h, sl[1].start / w, sl[1].stop / w)
    return np.column_stack([cy, cx, box])


def _default_edge_map(image):
    gray = cv2.cvtColor(image, cv2.COLOR_RGB2GRAY).astype(np.float32)
    gray = cv2.GaussianBlur(gray, (0, 0), 1.0, borderType=cv2.BORDER_REFLECT)
    dx, dy = cv2.Sobel(gray, cv2.CV_32F, 1, 0, ksize=3), cv2.Sobel(gray, cv2.CV_32F, 0, 1, ksize=3)
    magnitude = np.sqrt(dx * dx + dy * dy)  # not cv2.magnitude: see _texture
    top = float(np.percentile(magnitude, 99))
    if not top > 1e-3:
        return np.zeros(magnitude.shape, np.float32)
    return np.clip(magnitude / top, 0.0, 1.0)


# --------------------------------------------------------------------------- public
def superpixel_features(image, labels, *, edge_map=None):
    """Appearance, position and size features of every superpixel.

    Parameters
    ----------
    image : (H, W, 3) uint8 RGB array
    labels : (H, W) int superpixel map with contiguous ids 0..S-1
    edge_map : (H, W) float array in [0, 1], optional
        Edge evidence whose superpixel mean is the ``edge_density`` column, e.g. the
        feature-region map of :func:`tasks.edges.weighting.feature_region_map` (then the column is the
        share of feature-region pixels). Default: Gaussian (sigma 1) gradient magnitude of
        the grey image divided by its 99th percentile, clipped to [0, 1].

    Returns
    -------
    features : (S, D) float32
        ``D = len(FEATURE_NAMES) = 94`` columns, all finite, in this order:

        - CIELab mean and standard deviation (L*/100, a*/128, b*/128);
        - L*, a*, b* histograms, 8 bins each (a*, b* over [-64, 64), clipped);
        - joint a*b* histogram, 4x4 bins;
        - hue histogram (12 bins, each pixel weighted by its saturation), saturation and
          value histograms (4 bins each);
        - texture on L* in [0, 1]: mean gradient magnitude and mean |LoG| at scales 1, 2, 4
          (scale-normalised: ``s * |grad|``, ``s^2 * |LoG|``), mean |d/dx| and |d/dy| at
          scales 1, 2;
        - uniform LBP histogram (P=8, R=1, 10 bins) of the grey image;
        - centroid ``cy, cx`` and bounding box ``ymin, ymax, xmin, xmax``, as fractions of
          the image height / width (``ymax``, ``xmax`` exclusive);
        - ``area_share`` (pixels / H W) and ``edge_density`` (mean of ``edge_map``).

        Every histogram is divided by the superpixel's pixel count (sums to 1, except the
        saturation-weighted hue histogram, which sums to the mean saturation).

    Raises
    ------
    ValueError
        On malformed inputs (shape, dtype, non-contiguous labels, edge map shape).

    Examples
    --------
    >>> img = np.zeros((8, 8, 3), np.uint8); img[:, :4] = (255, 0, 0); img[:, 4:] = (0, 255, 0)
    >>> labels = np.repeat([[0] * 4 + [1] * 4], 8, axis=0)
    >>> f = superpixel_features(img, labels)
    >>> f.shape, bool(f[0, FEATURE_NAMES.index("lab_mean_a")] > 0 > f[1, FEATURE_NAMES.index("lab_mean_a")])
    ((2, 94), True)
    """
    # parse
    image, labels, n = check_image_and_labels(image, labels)
    pool = _Pooler(labels, n)
    if (pool.size == 0).any():
        raise ValueError("labels must be contiguous 0..S-1 (some ids have no pixels); relabel "
                         "with skimage.segmentation.relabel_sequential")
    if edge_map is None:
        edge = _default_edge_map(image)
    else:
        edge = np.asarray(edge_map, dtype=np.float32)
        if edge.shape != labels.shape or not np.isfinite(edge).all():
            raise ValueError(f"edge_map must be a finite (H, W) = {labels.shape} array, got "
                             f"shape {edge.shape}")

    # build
    lab_stats, colour_hists, lightness = _colour(image, pool)
    bank, lbp_hist = _texture(lightness, image, pool)
    position = _position(labels, n, pool)
    area_share = pool.size / labels.size
    edge_density = pool.mean(edge)

    # assemble
    features = np.column_stack([lab_stats, colour_hists, bank, lbp_hist, position,
                                area_share, edge_density]).astype(np.float32)
    assert features.shape[1] == len(FEATURE_NAMES)
    return features


def proposal_features(sp_features, membership, sp_areas, *, boxes=None):
    """Features of proposals: area-weighted mean of their superpixels' features plus shape.

    Parameters
    ----------
    sp_features : (S, D) float array
        Per-superpixel features (:func:`superpixel_features`).
    membership : (P, S) scipy.sparse matrix, bool
        Proposal membership (:func:`tasks.wsss.proposals.hierarchical_proposals`).
    sp_areas : (S,) int array
        Superpixel pixel counts (:func:`tasks.wsss.superpixels.areas`).
    boxes : (S, 4) float array, optional
        Superpixel boxes ``ymin, ymax, xmin, xmax`` as fractions of the image size. Default:
        the columns of those names, which requires ``D == len(FEATURE_NAMES)``.

    Returns
    -------
    features : (P, D + 4) float32
        Columns ``0..D-1``: ``sum_i area_i f_i / sum_i area_i`` over the proposal's
        superpixels (a one-superpixel proposal gets that superpixel's features exactly).
        Then :data:`PROPOSAL_EXTRA_NAMES`: area share of the image, height and width of
        the proposal's bounding box (fractions of the image), and fill = area share /
        box area.

    Raises
    ------
    ValueError
        On shape mismatches, or ``boxes=None`` with features of another layout.

    Examples
    --------
    >>> f = np.zeros((2, len(FEATURE_NAMES)), np.float32); f[:, 0] = [1.0, 4.0]
    >>> m = sp.csr_matrix(np.array([[1, 0], [1, 1]], bool))
    >>> proposal_features(f, m, np.array([3, 1]))[:, 0]
    array([1.  , 1.75], dtype=float32)
    """
    feats = np.asarray(sp_features, dtype=np.float64)
    sp_areas = np.asarray(sp_areas, dtype=np.float64)
    if feats.ndim != 2:
        raise ValueError(f"sp_features must be (S, D), got shape {feats.shape}")
    n, d = feats.shape
    if membership.ndim != 2 or membership.shape[1] != n:
        raise ValueError(f"membership must be (P, S) with S = {n}, got shape {membership.shape}")
    if sp_areas.shape != (n,) or (sp_areas <= 0).any():
        raise ValueError(f"sp_areas must be (S,) = ({n},) positive counts, got shape {sp_areas.shape}")
    if boxes is None:
        if d != len(FEATURE_NAMES):
            raise ValueError(f"sp_features has {d} columns, not the {len(FEATURE_NAMES)} of "
                             "superpixel_features; pass boxes=(S, 4) ymin, ymax, xmin, xmax")
        boxes = feats[:, [FEATURE_NAMES.index(c) for c in ("ymin", "ymax", "xmin", "xmax")]]
    boxes = np.asarray(boxes, dtype=np.float64)
    if boxes.shape != (n, 4):
        raise ValueError(f"boxes must be (S, 4) = ({n}, 4), got shape {boxes.shape}")

    m = sp.csr_matrix(membership, dtype=np.float64)
    m.sum_duplicates()
    area = np.asarray(m @ sp_areas).ravel()
    if (area <= 0).any():
        raise ValueError("every proposal (row of membership) needs at least one superpixel")
    pooled = np.asarray(m.multiply(sp_areas[None, :]).tocsr() @ feats) / area[:, None]

    # union box per row: min / max of the members' boxes over CSR segments
    starts = m.indptr[:-1]
    members = m.indices
    ymin = np.minimum.reduceat(boxes[members, 0], starts)
    ymax = np.maximum.reduceat(boxes[members, 1], starts)
    xmin = np.minimum.reduceat(boxes[members, 2], starts)
    xmax = np.maximum.reduceat(boxes[members, 3], starts)
    share = area / sp_areas.sum()
    box_h, box_w = ymax - ymin, xmax - xmin
    fill = share / np.maximum(box_h * box_w, 1e-12)
    return np.column_stack([pooled, share, box_h, box_w, fill]).astype(np.float32)
