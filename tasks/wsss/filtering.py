"""Step 5 of METHOD.md A: proposal filtering (claims 8-10).

For each proposal and each class, the IoU of the proposal's mask with the
class's preliminary mask is computed exactly, at superpixel resolution (a
proposal is a union of whole superpixels, so only the per-superpixel pixel
counts of each class are needed). A proposal is a *positive* of a class when
it overlaps the class's mask well and the proposal classifier agrees, a
*negative* when both say no.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

__all__ = ["proposal_iou", "filter_proposals"]


def proposal_iou(membership, sp_areas, sp_class_counts):
    """Exact IoU between every proposal mask and every class mask.

    Parameters
    ----------
    membership : (P, S) scipy.sparse matrix of bool
        Row p marks the superpixels of proposal p.
    sp_areas : (S,) integer array
        Pixel count of each superpixel.
    sp_class_counts : (S, K) integer array
        ``sp_class_counts[s, k]`` = number of pixels of superpixel s inside
        the mask of class k (for example, where the preliminary argmax is k).
        Row sums must not exceed `sp_areas`.

    Returns
    -------
    iou : (P, K) float32
        ``inter / (area_p + total_k - inter)`` with ``inter = M @ counts``,
        ``area_p = M @ sp_areas`` and ``total_k = counts.sum(0)``; 0 where the
        union is empty.

    Raises
    ------
    ValueError
        If the shapes do not agree or counts exceed areas.

    Examples
    --------
    >>> import scipy.sparse as sp
    >>> m = sp.csr_matrix(np.array([[1, 1, 0], [0, 0, 1]], bool))
    >>> proposal_iou(m, np.array([2, 2, 2]), np.array([[2], [1], [0]]))
    array([[0.75],
           [0.  ]], dtype=float32)
    """
    # parse
    if not sp.issparse(membership):
        membership = sp.csr_matrix(np.asarray(membership, dtype=bool))
    sp_areas = np.asarray(sp_areas)
    counts = np.asarray(sp_class_counts)
    if counts.ndim != 2:
        raise ValueError(
            f"sp_class_counts must be (S, K), got shape {counts.shape}; "
            f"reshape a single class to (S, 1)."
        )
    n_sp = membership.shape[1]
    if sp_areas.shape != (n_sp,) or counts.shape[0] != n_sp:
        raise ValueError(
            f"membership has {n_sp} superpixel columns but sp_areas has shape "
            f"{sp_areas.shape} and sp_class_counts {counts.shape}; all three "
            f"must describe the same S superpixels."
        )
    if np.any(counts.sum(axis=1) > sp_areas) or np.any(counts < 0):
        raise ValueError(
            "sp_class_counts must be non-negative with row sums <= sp_areas; "
            "count the pixels of each superpixel, each pixel in at most one class."
        )
    # build (float64 sparse products: exact for any realistic pixel count)
    m = sp.csr_matrix(membership, dtype=np.float64)
    counts = counts.astype(np.float64)
    inter = np.asarray(m @ counts)  # (P, K)
    area_p = np.asarray(m @ sp_areas.astype(np.float64)).reshape(-1, 1)  # (P, 1)
    total_k = counts.sum(axis=0, keepdims=True)  # (1, K)
    union = area_p + total_k - inter
    # solve
    iou = np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)
    return iou.astype(np.float32)


def _check_unit(name, value):
    if not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{name} must lie in [0, 1], got {value}.")


def filter_proposals(iou, prob, tags, *, t1=0.5, p1=0.5, t2=0.1, p2=0.1):
    """Split proposals into positives and negatives of each tagged class.

    Parameters
    ----------
    iou : (P, K) float array
        Proposal-class IoU, from :func:`proposal_iou`.
    prob : (P, K) float array
        Class probabilities of each proposal from the proposal classifier.
    tags : (K,) bool array
        The image-level labels; columns of untagged classes stay all False.
    t1, p1 : float in [0, 1], optional
        Positive iff ``iou >= t1`` and ``prob >= p1``.
    t2, p2 : float in [0, 1], optional
        Negative iff ``iou <= t2`` and ``prob <= p2``.

    Returns
    -------
    positive, negative : (P, K) bool

    Raises
    ------
    ValueError
        On mismatched shapes or thresholds outside [0, 1].
    """
    iou = np.asarray(iou, dtype=np.float64)
    prob = np.asarray(prob, dtype=np.float64)
    tags = np.asarray(tags, dtype=bool)
    if iou.shape != prob.shape or iou.ndim != 2:
        raise ValueError(
            f"iou {iou.shape} and prob {prob.shape} must both be (P, K)."
        )
    if tags.shape != (iou.shape[1],):
        raise ValueError(
            f"tags must be a ({iou.shape[1]},) bool array (one flag per class), "
            f"got shape {tags.shape}."
        )
    for name, value in (("t1", t1), ("p1", p1), ("t2", t2), ("p2", p2)):
        _check_unit(name, value)
    positive = (iou >= t1) & (prob >= p1) & tags[None, :]
    negative = (iou <= t2) & (prob <= p2) & tags[None, :]
    return positive, negative
