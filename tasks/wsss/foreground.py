"""The class-agnostic foreground evidence that serves corpora with an implicit background whose
tags carry no contrast (:mod:`tasks.corpus.tags` finds them: a class tagged on every image, or one
tag set for all) or whose photos hold one tagged object each (:func:`foreground_active`).
"""
from __future__ import annotations

from typing import Iterable, NamedTuple, Sequence

import cv2
import numpy as np
import scipy.sparse as sp
from scipy.sparse.linalg import spsolve

__all__ = ["box_grabcut", "evidence_grabcut", "boundary_saliency", "border_superpixels", "CorpusClusters",
           "fit_clusters", "cluster_foreground", "start_foreground", "foreground_active", "foreground_probs",
           "foreground_label"]


# ---------------------------------------------------------------------------- foreground evidence
def box_grabcut(image: np.ndarray, inset: float = 0.1, iterations: int = 3, seed: int = 0) -> np.ndarray:
    """The per-image baseline of an implicit-background corpus: GrabCut initialised with a box
    inset ``inset`` of each side from the image border, nothing learnt.

    Parameters
    ----------
    image : (H, W, 3) uint8 RGB

    Returns
    -------
    (H, W) bool, True = foreground (GrabCut's sure or probable foreground).
    """
    h, w = image.shape[:2]
    x0, y0 = int(round(inset * w)), int(round(inset * h))
    rect = (x0, y0, max(1, w - 2 * x0), max(1, h - 2 * y0))
    return _grabcut(image, np.zeros((h, w), np.uint8), rect, iterations, seed)


def _grabcut(image: np.ndarray, mask: np.ndarray, rect, iterations: int, seed: int) -> np.ndarray:
    """OpenCV's GrabCut of an RGB image from a box (``rect``) or, with ``rect=None``, from ``mask``'s
    GC_* start (changed in place); returns its sure or probable foreground."""
    bgd, fgd = np.zeros((1, 65), np.float64), np.zeros((1, 65), np.float64)
    cv2.setRNGSeed(seed)
    cv2.grabCut(np.ascontiguousarray(image[..., ::-1]), mask, rect, bgd, fgd, iterations,
                cv2.GC_INIT_WITH_RECT if rect is not None else cv2.GC_INIT_WITH_MASK)
    return np.isin(mask, (cv2.GC_FGD, cv2.GC_PR_FGD))


def evidence_grabcut(image: np.ndarray, fg_prob: np.ndarray, *, iterations: int = 3, sure: float = 0.85,
                     border: float = 0.02, seed: int = 0) -> np.ndarray:
    """GrabCut of the whole image initialised from a foreground probability instead of a box.

    Pixels above 0.5 start as probable foreground, above ``sure`` as sure foreground, the rest
    as probable background; a strip of ``border`` of the shorter side along the image border is
    sure background (the border is mostly background). GrabCut then fits the image's own colour
    models to that start and cuts along its edges, so the evidence's superpixel blocks become
    the object's outline.

    Parameters
    ----------
    image : (H, W, 3) uint8 RGB
    fg_prob : (H, W) float in [0, 1]

    Returns
    -------
    (H, W) bool, True = foreground; ``fg_prob > 0.5`` where GrabCut has nothing to fit (no
    pixel of one side).
    """
    h, w = fg_prob.shape
    if image.shape[:2] != (h, w):
        raise ValueError(f"fg_prob is {fg_prob.shape}, the image {image.shape[:2]}: they must agree")
    mask = np.where(fg_prob > 0.5, cv2.GC_PR_FGD, cv2.GC_PR_BGD).astype(np.uint8)
    mask[fg_prob > sure] = cv2.GC_FGD
    b = int(border * min(h, w))
    if b > 0:
        mask[:b], mask[-b:], mask[:, :b], mask[:, -b:] = cv2.GC_BGD, cv2.GC_BGD, cv2.GC_BGD, cv2.GC_BGD
    fg = np.isin(mask, (cv2.GC_FGD, cv2.GC_PR_FGD))
    if fg.all() or not fg.any():
        return fg_prob > 0.5
    return _grabcut(image, mask, None, iterations, seed)


def _sp_means(values: np.ndarray, labels: np.ndarray, n: int) -> np.ndarray:
    flat = labels.ravel()
    area = np.maximum(np.bincount(flat, minlength=n), 1)
    return np.stack([np.bincount(flat, weights=values[..., k].ravel(), minlength=n) / area
                     for k in range(values.shape[-1])], 1)


def boundary_saliency(image: np.ndarray, sp_labels: np.ndarray, *, sigma_colour: float = 10.0,
                      sigma_boundary: float = 1.0, sigma_space: float = 0.25, smooth: float = 0.1) -> np.ndarray:
    """Class-agnostic foreground probability of each superpixel from the image alone: the
    boundary-connectivity saliency of Zhu et al. (CVPR 2014, "Saliency optimization from robust
    background detection").

    A region is background when it is well connected to the image border: its boundary
    connectivity is the length of border it reaches through similar colours, over the square
    root of the area it reaches. Colour contrast weighted by the background probability of what
    it contrasts with gives foreground evidence; a least-squares smoothing over neighbouring
    superpixels (weighted by colour similarity) combines both.

    Parameters
    ----------
    image : (H, W, 3) uint8 RGB
    sp_labels : (H, W) int superpixel ids 0..S-1
    sigma_colour : CIELAB distance scale of similar colours
    sigma_boundary : boundary connectivity at which a region is background with weight 0.39
    sigma_space : spatial scale of the contrast, as a share of the image diagonal
    smooth : the constant part of the neighbours' smoothing weight

    Returns
    -------
    (S,) float32 in [0, 1], 1 = foreground.
    """
    from scipy.sparse.csgraph import dijkstra

    from wsseg.tasks.wsss import superpixels as spx

    h, w = sp_labels.shape
    n = int(sp_labels.max()) + 1
    lab = cv2.cvtColor(image, cv2.COLOR_RGB2LAB).astype(np.float64)
    lab[..., 0] *= 100.0 / 255.0
    lab[..., 1:] -= 128.0
    colour = _sp_means(lab, sp_labels, n)
    yy, xx = np.mgrid[0:h, 0:w]
    diag = float(np.hypot(h, w))
    pos = _sp_means(np.stack([yy, xx], -1).astype(np.float64), sp_labels, n) / diag
    pairs, _ = spx.adjacency(sp_labels, return_lengths=True)
    d_edge = np.linalg.norm(colour[pairs[:, 0]] - colour[pairs[:, 1]], axis=1)
    graph = sp.coo_matrix((d_edge + 1e-6, (pairs[:, 0], pairs[:, 1])), shape=(n, n)).tocsr()
    geo = dijkstra(graph, directed=False)
    geo[~np.isfinite(geo)] = geo[np.isfinite(geo)].max() if np.isfinite(geo).any() else 0.0
    similar = np.exp(-geo ** 2 / (2 * sigma_colour ** 2))
    border = border_superpixels(sp_labels)
    area = similar.sum(1)
    length = similar[:, border].sum(1)
    connectivity = length / np.sqrt(np.maximum(area, 1e-9))
    w_bg = 1.0 - np.exp(-connectivity ** 2 / (2 * sigma_boundary ** 2))
    d_app = np.linalg.norm(colour[:, None] - colour[None], axis=2)
    d_spa = np.linalg.norm(pos[:, None] - pos[None], axis=2)
    w_spa = np.exp(-d_spa ** 2 / (2 * sigma_space ** 2))
    w_fg = (d_app * w_spa * w_bg[None]).sum(1)
    w_fg = w_fg / max(float(w_fg.max()), 1e-9)
    # argmin_s sum w_bg s^2 + sum w_fg (1 - s)^2 + sum_(i,j) w_ij (s_i - s_j)^2
    w_ij = np.exp(-d_edge ** 2 / (2 * sigma_colour ** 2)) + smooth
    lap = sp.coo_matrix((np.concatenate([-w_ij, -w_ij]), (np.concatenate([pairs[:, 0], pairs[:, 1]]),
                                                         np.concatenate([pairs[:, 1], pairs[:, 0]]))), shape=(n, n))
    lap = lap.tocsr()
    lap = lap - sp.diags(np.asarray(lap.sum(1)).ravel())
    a = sp.diags(w_bg + w_fg) + lap
    s = spsolve(a.tocsc(), w_fg)
    return np.clip(s, 0.0, 1.0).astype(np.float32)


# ---------------------------------------------------------------------------- the corpus-wide view
def border_superpixels(sp_labels: np.ndarray) -> np.ndarray:
    """(S,) bool: the superpixels of ``sp_labels`` (ids 0..S-1) that touch the image border."""
    n = int(sp_labels.max()) + 1
    out = np.zeros(n, bool)
    out[np.unique(np.concatenate([sp_labels[0], sp_labels[-1], sp_labels[:, 0], sp_labels[:, -1]]))] = True
    return out


class CorpusClusters(NamedTuple):
    """Two clusters of the corpus's superpixel features (:func:`fit_clusters`): ``mean`` and
    ``scale`` standardise a feature row, ``centres`` (2, D) are the clusters' centres in those units,
    ``object`` the cluster that touches the image borders least, and ``spread`` the median over the
    fitted rows of the difference of squared distances to the two centres (the unit of
    :func:`cluster_foreground`'s logistic)."""
    mean: np.ndarray
    scale: np.ndarray
    centres: np.ndarray
    object: int
    spread: float

    def to_dict(self) -> dict:
        """Plain numbers for a JSON file (reading it back runs no code)."""
        return {"mean": self.mean.tolist(), "scale": self.scale.tolist(), "centres": self.centres.tolist(),
                "object": int(self.object), "spread": float(self.spread)}

    @classmethod
    def from_dict(cls, d: dict) -> "CorpusClusters":
        return cls(np.asarray(d["mean"], np.float64), np.asarray(d["scale"], np.float64),
                   np.asarray(d["centres"], np.float64), int(d["object"]), float(d["spread"]))


def fit_clusters(rows: Iterable[tuple[np.ndarray, np.ndarray]], *, seed: int = 0, iterations: int = 50,
                 max_rows: int = 200_000) -> CorpusClusters:
    """k-means (k = 2) over the superpixel features of a corpus's images (those inside the
    image), and which cluster is the object: the one whose superpixels touch the image borders
    least.

    One object kind photographed in many scenes: its superpixels resemble each other across the
    corpus more than the scenes around them do, and the scenes reach the borders. One image's
    saliency (:func:`boundary_saliency`) calls whatever stands out of its scene foreground; the
    corpus-wide clusters call foreground what looks like the corpus's objects.

    Parameters
    ----------
    rows : per image, its (S, D) superpixel features and its (S,) bool border superpixels
        (:func:`border_superpixels`)
    seed : picks the rows kept when there are more than ``max_rows`` (each image's superpixels kept
        with the same chance) and the starting centres
    iterations : Lloyd iterations at most (it stops earlier once no row changes cluster)
    """
    feats, border = [], []
    for f, b in rows:
        if len(f) != len(b):
            raise ValueError(f"superpixel features of {len(f)} rows against {len(b)} border flags")
        feats.append(np.asarray(f, np.float64))
        border.append(np.asarray(b, bool))
    if not feats:
        raise ValueError("fit_clusters needs the superpixel features of at least one image")
    x, b = np.concatenate(feats), np.concatenate(border)
    rng = np.random.default_rng(seed)
    if len(x) > max_rows:
        keep = np.sort(rng.choice(len(x), max_rows, replace=False))
        x, b = x[keep], b[keep]
    mean, scale = x.mean(0), x.std(0) + 1e-6
    z = (x - mean) / scale
    # the centres are fitted on the superpixels inside the image: at the border the encoder's maps
    # carry its padding, and on a corpus whose objects share no one look (msrc21's 13 object
    # classes) two clusters of every superpixel split the border from the rest (0.92 of one
    # cluster's superpixels on the border); the border's superpixels then only name the clusters
    fit = z[~b] if np.count_nonzero(~b) >= 2 else z
    # starting centres: a seeded row, then the row farthest from it (k-means++ at k = 2, greedy)
    first = fit[rng.integers(len(fit))]
    centres = np.stack([first, fit[((fit - first) ** 2).sum(1).argmax()]])
    assign = None
    for _ in range(iterations):
        new = _sq_dist(fit, centres).argmin(1)
        if assign is not None and np.array_equal(new, assign):
            break
        assign = new
        centres = np.stack([fit[assign == k].mean(0) if (assign == k).any() else centres[k] for k in range(2)])
    d = _sq_dist(z, centres)
    assign = d.argmin(1)
    share = [b[assign == k].mean() if (assign == k).any() else 1.0 for k in range(2)]
    obj = int(np.argmin(share))
    spread = float(np.median(np.abs(d[:, 0] - d[:, 1]))) or 1.0
    return CorpusClusters(mean, scale, centres, obj, spread)


def _sq_dist(z: np.ndarray, centres: np.ndarray) -> np.ndarray:
    return (z ** 2).sum(1)[:, None] - 2 * z @ centres.T + (centres ** 2).sum(1)[None]


def cluster_foreground(feats: np.ndarray, clusters: CorpusClusters) -> np.ndarray:
    """(S,) float32 foreground probability of each superpixel of one image from the corpus's
    clusters: a logistic of how much nearer its features are to the object's centre than to the
    other's, in units of the corpus's ``spread`` (0.5 where it is as near to both)."""
    d = _sq_dist((np.asarray(feats, np.float64) - clusters.mean) / clusters.scale, clusters.centres)
    margin = (d[:, 1 - clusters.object] - d[:, clusters.object]) / clusters.spread
    return (1.0 / (1.0 + np.exp(-np.clip(margin, -50, 50)))).astype(np.float32)


def start_foreground(image: np.ndarray, sp_labels: np.ndarray, feats: np.ndarray | None,
                     clusters: CorpusClusters | None, cluster_weight: float) -> np.ndarray:
    """(S,) round 0's foreground probability of each superpixel on the foreground path: the
    image's saliency (:func:`boundary_saliency`) and the corpus clusters'
    (:func:`cluster_foreground`), mixed ``1 - cluster_weight`` to ``cluster_weight``; the saliency
    alone without clusters (a run without superpixel features) or at weight 0."""
    sal = boundary_saliency(image, sp_labels)
    if clusters is None or feats is None or cluster_weight == 0:
        return sal
    return ((1.0 - cluster_weight) * sal + cluster_weight * cluster_foreground(feats, clusters)).astype(np.float32)


# ---------------------------------------------------------------------------- the switch and the evidence
#: The share of a corpus's tagged images with one tag from which ``foreground.mode=auto`` takes the
#: path on a corpus of many classes with an implicit background (2026-12-07): msrc21's 13 object
#: classes and person (0.96 of the images one tag) 0.691 -> 0.766 mIoU of the final labels, every
#: error there between an object and the background; coco128 (0.22, scenes of 2.8 tags an image)
#: fell on it from 0.202 to 0.094 at round 0, its background IoU 0.704 -> 0.362.
OBJECT_CENTRIC = 0.5

def foreground_active(stats: dict, mode: str) -> bool:
    """Whether the class-agnostic foreground path is on: ``mode`` ``on`` / ``off``, or ``auto``:
    on when the corpus has an implicit background and either some object class is tagged on every
    image or at least :data:`OBJECT_CENTRIC` of its images carry one tag
    (:func:`tasks.corpus.tags.tag_statistics`): photos of one object on a background, which the
    path's corpus clusters and whole-image GrabCut separate. Never without an implicit background:
    the evidence separates objects from background, and such a corpus has none."""
    if stats["implicit_background"] is None or mode == "off":
        return False
    return mode == "on" or bool(stats["on_every_image"]) or stats["one_tag_share"] >= OBJECT_CENTRIC


def foreground_probs(saliency: np.ndarray, cam_prob: np.ndarray, allowed: np.ndarray, background: int) -> np.ndarray:
    """Round 0's preliminary result of an image on the foreground path.

    Parameters
    ----------
    saliency : (H, W) float in [0, 1], the image's foreground probability (:func:`boundary_saliency`)
    cam_prob : (K, H, W) the CAM probabilities over the allowed classes
        (:func:`tasks.wsss.pipeline.cam_probs`); they only share the foreground among the object tags
    allowed : (K,) bool, the image's tags and the background
    background : index of the implicit background class

    Returns
    -------
    (K, H, W) float32: background ``1 - saliency``, each allowed object class ``saliency`` times
    its share of the CAM probabilities of the object classes; zero for the other classes.
    """
    obj = allowed.copy()
    obj[background] = False
    prob = np.zeros(cam_prob.shape, np.float32)
    s = np.clip(saliency, 0.0, 1.0).astype(np.float32)
    prob[background] = 1.0 - s
    if obj.any():
        q = np.maximum(cam_prob[obj], 0.0) + 1e-6
        prob[obj] = s[None] * q / q.sum(0, keepdims=True)
    else:
        prob[background] = 1.0
    return prob


def foreground_label(image: np.ndarray, evidence: Sequence[np.ndarray], allowed: np.ndarray, background: int, *,
                     iterations: int = 3, sure: float = 0.85, border: float = 0.02, seed: int = 0) -> np.ndarray:
    """The pseudo-label of an image on the foreground path: :func:`evidence_grabcut` from the mean
    foreground probability of several evidence maps, its foreground shared among the image's
    object tags by their summed evidence.

    Parameters
    ----------
    image : (H, W, 3) uint8 RGB
    evidence : (K, H, W) probability maps over the classes (each normalised here over ``allowed``):
        e.g. the preliminary result, the MIL evidence and the proposal scores. An image's
        foreground probability is the mean over the maps of one minus the background's share.
    allowed : (K,) bool, the image's tags and the background
    background : index of the implicit background class

    Returns
    -------
    (H, W) uint8 class per pixel (no ignore label: GrabCut decides every pixel).
    """
    if not len(evidence):
        raise ValueError("foreground_label needs at least one evidence map")
    maps = []
    for e in evidence:
        q = np.where(allowed[:, None, None], np.maximum(e, 0.0), 0.0).astype(np.float32)
        maps.append(q / np.maximum(q.sum(0, keepdims=True), 1e-9))
    fg_prob = np.mean([1.0 - q[background] for q in maps], axis=0)
    objects = allowed.copy()
    objects[background] = False
    if not objects.any():
        return np.full(fg_prob.shape, background, np.uint8)
    mask = evidence_grabcut(image, fg_prob, iterations=iterations, sure=sure, border=border, seed=seed)
    ids = np.flatnonzero(objects)
    which = ids[np.sum(maps, axis=0)[ids].argmax(0)]
    return np.where(mask, which, background).astype(np.uint8)
