"""Multi-scale candidate regions (proposals) by hierarchical merging of superpixels.

METHOD.md A step 2 (claim 3): cluster the superpixels of an image into many overlapping
regions of different sizes. :func:`hierarchical_proposals` follows selective search
(Uijlings et al., IJCV 2013) on a superpixel graph:

1. *start* -- every superpixel is a region, described by a colour histogram, a texture
   histogram, its size and bounding box; neighbouring regions share a boundary that carries
   edge evidence;
2. *merge* -- repeatedly merge the most similar pair of adjacent regions (a heap with lazy
   invalidation; region descriptors, neighbour lists and boundary statistics are updated
   incrementally, so a merge costs O(degree));
3. *collect* -- every region ever formed is a proposal: the superpixels, all intermediate
   merges and the whole image.

Similarity of regions a and b (each term in [0, 1], combined with non-negative weights):

- colour: histogram intersection ``sum(min(c_a, c_b))`` of L1-normalised colour histograms;
- texture: intersection of gradient orientation x magnitude histograms, or, when per-superpixel
  ``features`` are given, ``exp(-mean((z_a - z_b)^2) / 2)`` of their z-scored, area-weighted
  means;
- size: ``1 - (|a| + |b|) / |image|`` (small regions merge first);
- fill: ``1 - (|bbox(a U b)| - |a| - |b|) / |image|`` (regions that fill each other's box);
- edge: ``1 - mean edge value along the shared boundary`` (no edge between them favours
  merging).
"""

from __future__ import annotations

import heapq

import numpy as np
import scipy.sparse as sp

from wsseg.tasks.wsss.superpixels import areas as _sp_areas
from wsseg.tasks.wsss.superpixels import check_image_and_labels

__all__ = ["COLOUR_SPACES", "hierarchical_proposals", "proposal_areas"]

#: Valid values of ``hierarchical_proposals(colour_space=...)``.
COLOUR_SPACES = ("hsv", "lab", "rgb")

_COLOUR_BINS = 16
_ORIENTATIONS = 8
_MAGNITUDE_EDGES = (2.0, 8.0, 24.0)  # grey levels per pixel (Gaussian derivative, sigma 1)


# --------------------------------------------------------------------------- descriptors
def _colour_histograms(image, flat_labels, n, colour_space):
    import cv2

    if colour_space == "hsv":
        conv, scales = cv2.cvtColor(image, cv2.COLOR_RGB2HSV), (180, 256, 256)
    elif colour_space == "lab":
        conv, scales = cv2.cvtColor(image, cv2.COLOR_RGB2Lab), (256, 256, 256)
    else:
        conv, scales = image, (256, 256, 256)
    conv = conv.reshape(-1, 3)
    base = flat_labels * _COLOUR_BINS
    hists = []
    for c, scale in enumerate(scales):
        lut = np.minimum(np.arange(256) * _COLOUR_BINS // scale, _COLOUR_BINS - 1)
        code = base + lut[conv[:, c]]
        hists.append(np.bincount(code, minlength=n * _COLOUR_BINS).reshape(n, _COLOUR_BINS))
    hist = np.concatenate(hists, axis=1).astype(np.float64)
    return hist / np.maximum(hist.sum(1, keepdims=True), 1.0)


def _gray_gradients(image):
    import cv2

    gray = cv2.cvtColor(image, cv2.COLOR_RGB2GRAY).astype(np.float32)
    gray = cv2.GaussianBlur(gray, (0, 0), 1.0, borderType=cv2.BORDER_REFLECT)
    gx = cv2.Sobel(gray, cv2.CV_32F, 1, 0, ksize=3, scale=0.125, borderType=cv2.BORDER_REFLECT)
    gy = cv2.Sobel(gray, cv2.CV_32F, 0, 1, ksize=3, scale=0.125, borderType=cv2.BORDER_REFLECT)
    return gx, gy


def _texture_histograms(gx, gy, flat_labels, n):
    magnitude = np.hypot(gx, gy)
    angle = np.arctan2(gy, gx)  # -pi..pi
    ori = np.minimum(((angle + np.pi) * (_ORIENTATIONS / (2 * np.pi))).astype(np.int64),
                     _ORIENTATIONS - 1)
    n_mag = len(_MAGNITUDE_EDGES) + 1
    mag = sum((magnitude > t).astype(np.int64) for t in _MAGNITUDE_EDGES)  # 0..n_mag-1
    n_bins = _ORIENTATIONS * n_mag
    code = flat_labels * n_bins + (ori * n_mag + mag).ravel()
    hist = np.bincount(code, minlength=n * n_bins).reshape(n, n_bins).astype(np.float64)
    return hist / np.maximum(hist.sum(1, keepdims=True), 1.0)


def _default_edge_map(gx, gy):
    magnitude = np.hypot(gx, gy)
    top = float(np.percentile(magnitude, 99))
    if not top > 1e-3:
        return np.zeros(magnitude.shape, np.float64)
    return np.clip(magnitude / top, 0.0, 1.0).astype(np.float64)


def _boundaries(labels, edge_map, n):
    """Adjacent pairs (i < j), and the sum and count of edge values along each boundary.

    The edge value of a 4-neighbour pixel pair across the boundary is the larger of the two
    pixels' values, so a one-pixel-thin edge line on either side counts fully.
    """
    los, his, vals = [], [], []
    for a, b, ea, eb in ((labels[:, :-1], labels[:, 1:], edge_map[:, :-1], edge_map[:, 1:]),
                         (labels[:-1, :], labels[1:, :], edge_map[:-1, :], edge_map[1:, :])):
        differ = a != b
        a, b = a[differ].astype(np.int64), b[differ].astype(np.int64)
        los.append(np.minimum(a, b))
        his.append(np.maximum(a, b))
        vals.append(np.maximum(ea[differ], eb[differ]))
    lo, hi, vals = np.concatenate(los), np.concatenate(his), np.concatenate(vals)
    keys, inverse = np.unique(lo * n + hi, return_inverse=True)
    sums = np.bincount(inverse, weights=vals, minlength=keys.size)
    lengths = np.bincount(inverse, minlength=keys.size).astype(np.float64)
    return keys // n, keys % n, sums, lengths


def _boxes(labels, n):
    from scipy.ndimage import find_objects

    box = np.zeros((n, 4), np.float64)  # y0, x0, y1, x1 (exclusive)
    for i, sl in enumerate(find_objects(labels.astype(np.int64) + 1, max_label=n)):
        if sl is not None:
            box[i] = (sl[0].start, sl[1].start, sl[0].stop, sl[1].stop)
    return box


# --------------------------------------------------------------------------- merging
class _Similarity:
    """Vectorised similarity of region pairs; region descriptors live in growing arrays.

    ``hist`` holds the colour (and texture) histograms already multiplied by their weights,
    so one intersection ``sum(min(h_a, h_b))`` gives both histogram terms; ``dense`` holds
    z-scored descriptors (texture term from ``features``) or is None. Boxes are stored as
    ``(-y0, -x0, y1, x1)`` so the box of a union is an element-wise maximum.
    """

    def __init__(self, hist, dense, size, box, weights, total):
        n = size.size
        cap = 2 * n - 1
        self.hist = np.zeros((cap, hist.shape[1])); self.hist[:n] = hist
        self.dense = None
        if dense is not None:
            self.dense = np.zeros((cap, dense.shape[1])); self.dense[:n] = dense
        self.size = np.zeros(cap); self.size[:n] = size
        self.box = np.zeros((cap, 4)); self.box[:n] = box * np.array([-1, -1, 1, 1])
        self.w_dense, self.w_size, self.w_fill, self.w_edge = weights
        self.total = total
        # the same sizes and boxes as Python floats, for the scalar terms of :meth:`with_region`
        self.size_list = self.size.tolist()
        self.box_list = [tuple(b) for b in self.box.tolist()]

    def merge(self, a, b, c):
        sa, sb = self.size[a], self.size[b]
        self.size[c] = sa + sb
        self.hist[c] = (sa * self.hist[a] + sb * self.hist[b]) / (sa + sb)
        if self.dense is not None:
            self.dense[c] = (sa * self.dense[a] + sb * self.dense[b]) / (sa + sb)
        self.box[c] = np.maximum(self.box[a], self.box[b])
        self.size_list[c] = float(self.size[c])
        self.box_list[c] = tuple(self.box[c].tolist())

    def with_region(self, cand, c, esum, elen):
        """``self(np.array(cand), c, np.array(esum), np.array(elen)).tolist()``, bit for bit: the
        histogram (and dense) terms in numpy, the size, fill and edge terms of the few neighbours
        of one region in Python floats, the same IEEE operations in the same order (numpy's
        per-call cost dominates arrays this small)."""
        s = np.minimum(self.hist[cand], self.hist[c]).sum(1)
        if self.dense is not None and self.w_dense:
            s += self.w_dense * np.exp(-0.5 * ((self.dense[cand] - self.dense[c]) ** 2).mean(1))
        total, w_size, w_fill, w_edge = self.total, self.w_size, self.w_fill, self.w_edge
        sizes, boxes = self.size_list, self.box_list
        size_c = sizes[c]
        c0, c1, c2, c3 = boxes[c]
        out = []
        for v, k, es, el in zip(s.tolist(), cand, esum, elen):
            joint = (sizes[k] + size_c) / total
            k0, k1, k2, k3 = boxes[k]
            box = (max(k0, c0) + max(k2, c2)) * (max(k1, c1) + max(k3, c3)) / total
            v += w_size * (1.0 - joint)
            v += w_fill * (1.0 - (box - joint))
            v += w_edge * (1.0 - es / max(el, 1.0))
            out.append(v)
        return out

    def __call__(self, pa, pb, esum, elen):
        """Similarity of ``pa[i]`` and ``pb[i]`` (``pb`` may be a single region id)."""
        s = np.minimum(self.hist[pa], self.hist[pb]).sum(1)
        if self.dense is not None and self.w_dense:
            s += self.w_dense * np.exp(-0.5 * ((self.dense[pa] - self.dense[pb]) ** 2).mean(1))
        joint = (self.size[pa] + self.size[pb]) / self.total
        u = np.maximum(self.box[pa], self.box[pb])
        box = (u[:, 0] + u[:, 2]) * (u[:, 1] + u[:, 3]) / self.total
        s += self.w_size * (1.0 - joint)            # size: small regions first
        s += self.w_fill * (1.0 - (box - joint))    # fill: little empty space in the box
        s += self.w_edge * (1.0 - esum / np.maximum(elen, 1.0))  # edge: weak shared boundary
        return s


def _merge_hierarchy(similarity, n, pair_a, pair_b, edge_sum, edge_len):
    """Greedy merging; returns the (a, b) children of merges n, n+1, ... in order."""
    nbr = [dict() for _ in range(n)]  # region -> {neighbour: (edge sum, boundary length)}
    for i, j, s, l in zip(pair_a.tolist(), pair_b.tolist(), edge_sum.tolist(), edge_len.tolist()):
        nbr[i][j] = nbr[j][i] = (s, l)
    alive = np.zeros(2 * n - 1, bool)
    alive[:n] = True

    heap = []
    if pair_a.size:
        s0 = similarity(pair_a, pair_b, edge_sum, edge_len)
        heap = list(zip((-s0).tolist(), pair_a.tolist(), pair_b.tolist()))
        heapq.heapify(heap)

    children = []
    while heap:
        _, a, b = heapq.heappop(heap)
        if not (alive[a] and alive[b]):  # lazy invalidation
            continue
        c = n + len(children)
        children.append((a, b))
        similarity.merge(a, b, c)
        alive[a] = alive[b] = False
        alive[c] = True
        # neighbours of c, boundary statistics summed over both parts
        merged = {k: v for k, v in nbr[a].items() if k != b}
        for k, (s, l) in nbr[b].items():
            if k != a:
                if k in merged:
                    s0, l0 = merged[k]
                    merged[k] = (s0 + s, l0 + l)
                else:
                    merged[k] = (s, l)
        nbr[a] = nbr[b] = None
        nbr.append(merged)
        if not merged:
            continue
        cand, sums, lens = [], [], []
        for k, (s, l) in merged.items():
            d = nbr[k]
            d.pop(a, None)
            d.pop(b, None)
            d[c] = (s, l)
            cand.append(k)
            sums.append(s)
            lens.append(l)
        for k, v in zip(cand, similarity.with_region(cand, c, sums, lens)):
            heapq.heappush(heap, (-v, k, c))
    return children


def _regions(children, n):
    """Member superpixels (sorted int32 arrays) of every region: singletons then merges."""
    members = [np.array([i], np.int32) for i in range(n)]
    for a, b in children:
        members.append(np.sort(np.concatenate([members[a], members[b]])))
    return members


# --------------------------------------------------------------------------- public
def hierarchical_proposals(image, labels, *, edge_map=None, features=None, min_size=0.002,
                           max_size=1.0, colour_weight=1.0, texture_weight=1.0,
                           size_weight=1.0, fill_weight=1.0, edge_weight=1.0,
                           colour_space="hsv", diversify=False, seed=0):
    """Candidate regions by greedy hierarchical merging of adjacent superpixels.

    Parameters
    ----------
    image : (H, W, 3) uint8 RGB array
    labels : (H, W) int superpixel map with contiguous ids 0..S-1 (connected superpixels,
        as returned by :func:`tasks.wsss.superpixels.superpixels`)
    edge_map : (H, W) float array in [0, 1], optional
        Edge evidence, e.g. the feature-region map of :func:`tasks.edges.weighting.feature_region_map`
        or a normalised edge magnitude. Default: the Gaussian (sigma 1) gradient magnitude of
        the grey image divided by its 99th percentile, clipped to [0, 1].
    features : (S, D) float array, optional
        Per-superpixel descriptors (e.g. :func:`tasks.wsss.features.superpixel_features`). When
        given, they replace the texture histogram: each column is z-scored over the
        superpixels, a region's descriptor is the area-weighted mean and the texture term is
        ``exp(-mean((z_a - z_b)^2) / 2)``.
    min_size, max_size : float, optional
        Keep proposals whose area share of the image lies in ``[min_size, max_size]``; the
        singletons and the whole image are always kept.
    colour_weight, texture_weight, size_weight, fill_weight, edge_weight : float, optional
        Non-negative weights of the similarity terms (see the module docstring); at least
        one must be positive.
    colour_space : {"hsv", "lab", "rgb"}, optional
        Colour space of the colour histograms (16 bins per channel).
    diversify : bool, optional
        Union of several merging strategies (deduplicated), as in selective search "fast":
        the given weights in ``colour_space``, the given weights in Lab (HSV if
        ``colour_space`` is Lab), and the given weights without the colour term.
    seed : int, optional
        Accepted for a uniform interface; merging is deterministic (ties are broken by
        region id), so the result does not depend on it.

    Returns
    -------
    membership : scipy.sparse.csr_matrix, shape (P, S), dtype bool
        Row p lists the superpixels of proposal p (sorted column indices). Rows 0..S-1 are
        the singletons (row i = superpixel i), then merged regions in order of formation
        (first strategy first); no two rows are equal. The whole image is always a row.
        Every row is connected in the 4-adjacency graph of the superpixels.

    Raises
    ------
    ValueError
        On malformed inputs (shapes, dtypes, negative weights, unknown colour space).

    Examples
    --------
    >>> img = np.zeros((32, 64, 3), np.uint8); img[:, :32] = (200, 0, 0); img[:, 32:] = (0, 0, 200)
    >>> labels = np.kron(np.arange(8).reshape(2, 4), np.ones((16, 16), int)).astype(np.int32)
    >>> props = hierarchical_proposals(img, labels)
    >>> props.shape, [0, 1, 4, 5] in [sorted(r.indices.tolist()) for r in props]
    ((15, 8), True)
    """
    # parse
    image, labels, n = check_image_and_labels(image, labels)
    size = _sp_areas(labels, n).astype(np.float64)
    if (size == 0).any():
        raise ValueError("labels must be contiguous 0..S-1 (some ids have no pixels); relabel "
                         "with tasks.wsss.superpixels.superpixels or skimage.segmentation.relabel_sequential")
    if colour_space not in COLOUR_SPACES:
        raise ValueError(f"colour_space must be one of {COLOUR_SPACES}, got {colour_space!r}")
    weights = (colour_weight, texture_weight, size_weight, fill_weight, edge_weight)
    if any(w < 0 for w in weights) or not any(w > 0 for w in weights):
        raise ValueError(f"similarity weights must be >= 0 with at least one > 0, got {weights}")
    if not 0 <= min_size <= max_size:
        raise ValueError(f"need 0 <= min_size <= max_size, got {min_size}, {max_size}")

    # preprocess: descriptors shared by all strategies
    flat = labels.ravel().astype(np.int64)
    gx, gy = _gray_gradients(image)
    if edge_map is None:
        edge = _default_edge_map(gx, gy)
    else:
        edge = np.asarray(edge_map, dtype=np.float64)
        if edge.shape != labels.shape:
            raise ValueError(f"edge_map must be (H, W) = {labels.shape}, got {edge.shape}")
        if not np.isfinite(edge).all():
            raise ValueError("edge_map must be finite")
        edge = np.clip(edge, 0.0, 1.0)
    texture, dense = None, None
    if features is None:
        texture = _texture_histograms(gx, gy, flat, n)
    else:
        feats = np.asarray(features, dtype=np.float64)
        if feats.ndim != 2 or feats.shape[0] != n or not np.isfinite(feats).all():
            raise ValueError(f"features must be a finite (S, D) array with S = {n}, got shape "
                             f"{feats.shape}")
        std = feats.std(0)
        dense = (feats - feats.mean(0)) / np.where(std > 0, std, 1.0)
    box = _boxes(labels, n)
    pair_a, pair_b, edge_sum, edge_len = _boundaries(labels, edge, n)
    total = float(labels.size)

    strategies = [(colour_space, weights)]
    if diversify:
        strategies.append(("hsv" if colour_space == "lab" else "lab", weights))
        if any(weights[1:]):
            strategies.append((colour_space, (0.0,) + tuple(weights[1:])))
    colour_cache = {}

    # build: one hierarchy per strategy, collect its regions
    rows, seen = [], set()
    share_of = size / total
    for space, (wc, wt, ws, wf, we) in strategies:
        if space not in colour_cache:
            colour_cache[space] = _colour_histograms(image, flat, n, space)
        hist = [wc * colour_cache[space]]
        if texture is not None:
            hist.append(wt * texture)
        similarity = _Similarity(np.concatenate(hist, axis=1), dense, size, box,
                                 (wt, ws, wf, we), total)
        children = _merge_hierarchy(similarity, n, pair_a, pair_b, edge_sum, edge_len)
        for k, members in enumerate(_regions(children, n)):
            whole = members.size == n
            if k >= n and not whole and not min_size <= share_of[members].sum() <= max_size:
                continue
            key = members.tobytes()
            if key not in seen:
                seen.add(key)
                rows.append(members)
    if not any(r.size == n for r in rows):  # disconnected superpixel graph
        rows.append(np.arange(n, dtype=np.int32))

    # assemble
    indptr = np.zeros(len(rows) + 1, np.int64)
    indptr[1:] = np.cumsum([r.size for r in rows])
    indices = np.concatenate(rows).astype(np.int32)
    return sp.csr_matrix((np.ones(indices.size, bool), indices, indptr), shape=(len(rows), n))


def proposal_areas(membership, sp_areas):
    """Pixel area of each proposal.

    Parameters
    ----------
    membership : (P, S) scipy.sparse matrix (bool)
    sp_areas : (S,) int array of superpixel areas (:func:`tasks.wsss.superpixels.areas`)

    Returns
    -------
    areas : (P,) int64

    Examples
    --------
    >>> m = sp.csr_matrix(np.array([[1, 0, 1], [0, 1, 0]], bool))
    >>> proposal_areas(m, np.array([4, 5, 6]))
    array([10,  5])
    """
    sp_areas = np.asarray(sp_areas)
    if sp_areas.ndim != 1 or membership.shape[1] != sp_areas.size:
        raise ValueError(f"sp_areas must be (S,) with S = membership.shape[1] = "
                         f"{membership.shape[1]}, got shape {sp_areas.shape}")
    m = sp.csr_matrix(membership).astype(np.int64)
    return np.asarray(m @ sp_areas.astype(np.int64)).ravel().astype(np.int64)
