"""Segmentation quality measures: confusion matrix, IoU, label-map change.

All functions work on label maps of class indices where ``255`` marks ignore
(void ground truth, or a pseudo-label pixel left undecided).
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "confusion_matrix",
    "iou_from_confusion",
    "class_accuracy_from_confusion",
    "chance_iou_from_confusion",
    "changed_share",
    "reverted_share",
    "ignore_share",
    "tag_log_shares",
    "tag_coverage",
    "ConfusionAccumulator",
]


def _check_same_shape(a, b, name_a, name_b):
    a = np.asarray(a)
    b = np.asarray(b)
    if a.shape != b.shape:
        raise ValueError(
            f"{name_a} has shape {a.shape} but {name_b} has shape {b.shape}; "
            f"pass two label maps of the same shape."
        )
    return a, b


def confusion_matrix(pred, gt, n_classes, *, ignore_index=255):
    """Count (ground truth, prediction) pairs.

    Parameters
    ----------
    pred : (...) integer array
        Predicted class per pixel, in ``0..n_classes-1``; ``ignore_index``
        marks an undecided pixel. Any other value also counts as undecided.
    gt : (...) integer array, same shape as `pred`
        Ground-truth class per pixel; pixels equal to `ignore_index` (void)
        are skipped.
    n_classes : int
        Number of classes K.
    ignore_index : int, optional
        The ignore value in both maps.

    Returns
    -------
    conf : (K, K + 1) int64
        ``conf[g, p]`` = number of pixels of true class g predicted as p; the
        last column counts pixels of true class g the prediction left
        undecided. Those count as wrong in :func:`iou_from_confusion`.

    Raises
    ------
    ValueError
        If the shapes differ, `n_classes` < 1, or `gt` holds a value outside
        ``0..K-1`` that is not `ignore_index`.

    Examples
    --------
    >>> confusion_matrix(np.array([0, 1, 255]), np.array([0, 0, 1]), 2)
    array([[1, 1, 0],
           [0, 0, 1]])
    """
    pred, gt = _check_same_shape(pred, gt, "pred", "gt")
    n_classes = int(n_classes)
    if n_classes < 1:
        raise ValueError(f"n_classes must be >= 1, got {n_classes}.")
    gt = gt.ravel().astype(np.int64)
    pred = pred.ravel().astype(np.int64)
    keep = gt != ignore_index
    gt, pred = gt[keep], pred[keep]
    if gt.size and (gt.min() < 0 or gt.max() >= n_classes):
        bad = gt[(gt < 0) | (gt >= n_classes)][0]
        raise ValueError(
            f"gt holds class {bad}, outside 0..{n_classes - 1}; "
            f"pass the right n_classes or map void to ignore_index={ignore_index}."
        )
    # Any prediction outside the class range is "undecided": last column.
    pred = np.where((pred < 0) | (pred >= n_classes), n_classes, pred)
    flat = gt * (n_classes + 1) + pred
    counts = np.bincount(flat, minlength=n_classes * (n_classes + 1))
    return counts.reshape(n_classes, n_classes + 1).astype(np.int64)


def iou_from_confusion(conf):
    """Per-class intersection over union and its mean.

    Parameters
    ----------
    conf : (K, K + 1) or (K, K) integer array
        As returned by :func:`confusion_matrix` (rows = truth, columns =
        prediction, optional last column = undecided predictions).

    Returns
    -------
    per_class : (K,) float64
        ``IoU_c = TP_c / (GT_c + PRED_c - TP_c)``, where ``GT_c`` is the row
        sum (undecided predictions included: they are errors) and ``PRED_c``
        the column sum. NaN for classes absent from both truth and prediction;
        0 for a class predicted but absent from the truth.
    miou : float
        Mean over the classes present in the truth (NaN if none is). A class that is
        predicted but absent from the truth scores IoU 0 whatever else happens, so counting
        it would make one stray pixel cost a whole class's share of the mean, and two
        predictions would be averaged over different sets of classes; its wrong pixels still
        count, as errors of the true classes under them.

    Examples
    --------
    >>> per_class, miou = iou_from_confusion(np.array([[3, 1, 0], [0, 0, 0], [0, 0, 2]]))
    >>> per_class.tolist(), miou
    ([0.75, 0.0, 1.0], 0.875)
    """
    tp, gt_total, pred_total = _margins(conf)
    return _ratio_and_mean(tp, gt_total + pred_total - tp, gt_total > 0)


def _ratio_and_mean(num: np.ndarray, den: np.ndarray, counted: np.ndarray | None = None) -> tuple[np.ndarray, float]:
    """Per-class ``num / den`` (NaN where ``den`` is 0) and its mean over the non-NaN classes,
    or over those of them that ``counted`` marks (NaN if none)."""
    per_class = np.full(den.shape, np.nan)
    np.divide(num, den, out=per_class, where=den > 0)
    keep = ~np.isnan(per_class) if counted is None else ~np.isnan(per_class) & counted
    mean = float(per_class[keep].mean()) if keep.any() else float("nan")
    return per_class, mean


def _margins(conf) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-class true positives, truth totals (row sums, undecided predictions included) and
    prediction totals (column sums, undecided left out) of a checked ``conf``."""
    conf = _checked_confusion(conf)
    k = conf.shape[0]
    return np.diag(conf[:, :k]), conf.sum(axis=1), conf[:, :k].sum(axis=0)


def _checked_confusion(conf) -> np.ndarray:
    """``conf`` as float64, refused unless it is (K, K) or (K, K + 1)."""
    conf = np.asarray(conf, dtype=np.float64)
    if conf.ndim != 2 or conf.shape[1] not in (conf.shape[0], conf.shape[0] + 1):
        raise ValueError(f"conf must have shape (K, K) or (K, K + 1), got {conf.shape}; "
                         f"pass the output of confusion_matrix.")
    return conf


def class_accuracy_from_confusion(conf):
    """Per-class pixel accuracy (recall) and its mean, the figure of the older MSRC-21 papers.

    Parameters
    ----------
    conf : (K, K + 1) or (K, K) integer array
        As returned by :func:`confusion_matrix` (rows = truth).

    Returns
    -------
    per_class : (K,) float64
        ``acc_c = TP_c / GT_c``: the share of class c's true pixels predicted as c (undecided
        predictions count as wrong). NaN for classes absent from the truth.
    mean : float
        Mean over the classes present in the truth (NaN if none is).

    Examples
    --------
    >>> per_class, mean = class_accuracy_from_confusion(np.array([[3, 1], [0, 2]]))
    >>> per_class.tolist(), mean
    ([0.75, 1.0], 0.875)
    """
    tp, gt_total, _ = _margins(conf)
    return _ratio_and_mean(tp, gt_total)


def chance_iou_from_confusion(conf):
    """Per-class IoU, and its mean, that a label map with the same class shares as the
    prediction would score if it placed its labels independently of the truth: what a source
    scores without knowing where anything is.

    A figure near this one says the labels carry no localisation, whatever their mIoU: on a
    corpus whose background fills two thirds of the pixels, labelling 90 % of each image as
    background at random scores background IoU 0.62. The lift of a source over its chance level
    is what it knows.

    Parameters
    ----------
    conf : (K, K + 1) or (K, K) integer array
        As returned by :func:`confusion_matrix` (rows = truth, columns = prediction, optional
        last column = undecided predictions, which stay undecided at chance).

    Returns
    -------
    per_class : (K,) float64
        With ``N`` pixels, ``GT_c`` and ``PRED_c`` as in :func:`iou_from_confusion` and the
        expected overlap ``E_c = GT_c * PRED_c / N``: ``E_c / (GT_c + PRED_c - E_c)``. NaN where
        :func:`iou_from_confusion` is NaN.
    miou : float
        Mean over the classes present in the truth, as :func:`iou_from_confusion`'s.

    Examples
    --------
    >>> per_class, miou = chance_iou_from_confusion(np.array([[6, 0], [0, 4]]))
    >>> [round(v, 4) for v in per_class.tolist()], round(miou, 4)
    ([0.4286, 0.25], 0.3393)
    """
    _, gt_total, pred_total = _margins(conf)
    overlap = gt_total * pred_total / max(gt_total.sum(), 1.0)
    return _ratio_and_mean(overlap, gt_total + pred_total - overlap, gt_total > 0)


def changed_share(a, b):
    """Share of pixels whose label differs between two label maps.

    Parameters
    ----------
    a, b : (...) arrays of the same shape
        Label maps (ignore values compared like any other label).

    Returns
    -------
    share : float in [0, 1] (0.0 for empty maps).
    """
    a, b = _check_same_shape(a, b, "a", "b")
    if a.size == 0:
        return 0.0
    return float(np.count_nonzero(a != b) / a.size)


def reverted_share(label, previous, before):
    """Share of the pixels that changed from `previous` to `label` and went back to their label
    in `before` (the map one step further back): how much of a round's change undoes the round
    before it.

    Parameters
    ----------
    label, previous, before : (...) arrays of the same shape, or None
        Label maps of rounds r, r-1 and r-2 (ignore values compared like any other label).

    Returns
    -------
    share : float in [0, 1]: the reverted pixels over all pixels (0.0 when `previous` or
        `before` is None, or for empty maps).

    Examples
    --------
    >>> reverted_share(np.array([0, 1, 2, 0]), np.array([1, 1, 1, 0]), np.array([0, 0, 1, 0]))
    0.25
    """
    if previous is None or before is None:
        return 0.0
    label, previous = _check_same_shape(label, previous, "label", "previous")
    label, before = _check_same_shape(label, before, "label", "before")
    if label.size == 0:
        return 0.0
    return float(np.count_nonzero((label != previous) & (label == before)) / label.size)


#: the smallest label share :func:`tag_log_shares` takes the log of (0.1 % of the image): a tagged
#: class the labels leave out counts as log(0.001), not minus infinity
SHARE_FLOOR = 1e-3


def tag_log_shares(label, tags, n_classes, *, floor=SHARE_FLOOR):
    """Per tagged class, the log of its share of a label map's pixels.

    Parameters
    ----------
    label : (H, W) integer array of class indices (``255``: undecided, counted in the image's size)
    tags : sequence of int
        The classes the image is tagged with (the stopping rule adds the implicit background).
    n_classes : int
    floor : float
        Shares below it count as ``floor``.

    Returns
    -------
    log_share : (n_classes,) float array: ``log(max(share, floor))`` at the tagged classes, 0 elsewhere.
    tagged : (n_classes,) int array: 1 at the tagged classes.

    Examples
    --------
    >>> s, t = tag_log_shares(np.array([[0, 0], [0, 1]]), [0, 2], 3)
    >>> np.round(np.exp(s), 3).tolist(), t.tolist()
    ([0.75, 1.0, 0.001], [1, 0, 1])
    """
    label = np.asarray(label)
    tagged = np.zeros(n_classes, np.int64)
    tagged[list(tags)] = 1
    counts = np.bincount(label[label < n_classes].ravel(), minlength=n_classes)[:n_classes]
    shares = counts / max(label.size, 1)
    return np.where(tagged > 0, np.log(np.maximum(shares, floor)), 0.0), tagged


def tag_coverage(log_share_sums, tagged_counts):
    """Mean over the tagged classes of the mean log label share on the images tagged with them
    (sums of :func:`tag_log_shares` over images): 0 when every tagged class fills its images,
    ``log(floor)`` when the labels leave every tagged class out; NaN without any tag.

    >>> round(tag_coverage(np.array([np.log(0.5) * 2, 0.0, np.log(0.25)]), np.array([2, 0, 1])), 4)
    -1.0397
    """
    sums, counts = np.asarray(log_share_sums, float), np.asarray(tagged_counts, float)
    seen = counts > 0
    if not seen.any():
        return float("nan")
    return float(np.mean(sums[seen] / counts[seen]))


def tag_share(coverage):
    """The tag coverage (:func:`tag_coverage`) as a share a person reads: ``exp(coverage)``, the
    geometric mean of the share of its images' pixels the labels give a tagged class (1: every
    tagged class fills its images; where an image's tagged classes share it, the more even, the
    higher). None stays None. What the tables print; the summaries keep the coverage.

    >>> round(tag_share(np.log(0.25)), 4), tag_share(None)
    (0.25, None)
    """
    return None if coverage is None else float(np.exp(coverage))


def ignore_share(label, *, ignore_index=255):
    """Share of pixels of `label` equal to `ignore_index` (0.0 for empty maps)."""
    label = np.asarray(label)
    if label.size == 0:
        return 0.0
    return float(np.count_nonzero(label == ignore_index) / label.size)


class ConfusionAccumulator:
    """Sum confusion matrices over many images.

    Parameters
    ----------
    n_classes : int
    ignore_index : int, optional

    Examples
    --------
    >>> acc = ConfusionAccumulator(2)
    >>> acc.update(np.array([0, 1]), np.array([0, 1]))
    >>> acc.miou
    1.0
    """

    def __init__(self, n_classes, *, ignore_index=255):
        self.n_classes = int(n_classes)
        self.ignore_index = ignore_index
        self.conf = np.zeros((self.n_classes, self.n_classes + 1), dtype=np.int64)

    def update(self, pred, gt):
        """Add one (prediction, ground truth) pair."""
        self.conf += confusion_matrix(
            pred, gt, self.n_classes, ignore_index=self.ignore_index
        )

    @property
    def per_class(self):
        """(K,) per-class IoU, NaN for classes never seen."""
        return iou_from_confusion(self.conf)[0]

    @property
    def miou(self):
        """Mean IoU over the classes present in the truth (:func:`iou_from_confusion`)."""
        return iou_from_confusion(self.conf)[1]

    @property
    def chance_miou(self):
        """mIoU of the same class shares placed at random (:func:`chance_iou_from_confusion`)."""
        return chance_iou_from_confusion(self.conf)[1]

    @property
    def mean_class_accuracy(self):
        """Mean over the classes present in the truth of their pixel accuracy (recall)."""
        return class_accuracy_from_confusion(self.conf)[1]

    @property
    def pixel_accuracy(self):
        """Share of non-void pixels predicted correctly (undecided = wrong)."""
        total = self.conf.sum()
        return float(np.trace(self.conf[:, : self.n_classes]) / total) if total else float("nan")
