import numpy as np
import pytest
import scipy.sparse as sp

from wsseg.tasks.wsss.filtering import filter_proposals, proposal_iou


def _grid_labels(h, w, cell):
    rows = np.arange(h)[:, None] // cell
    cols = np.arange(w)[None, :] // cell
    return (rows * (w // cell) + cols).astype(np.int32)


def _counts(labels, class_map, n_classes):
    n_sp = labels.max() + 1
    flat = labels.ravel().astype(np.int64) * n_classes + class_map.ravel()
    return np.bincount(flat, minlength=n_sp * n_classes).reshape(n_sp, n_classes)


def _pixel_iou(a, b):
    return np.count_nonzero(a & b) / np.count_nonzero(a | b)


def test_two_squares_known_overlap_matches_pixel_count():
    # 6x6 image, 3x3 grid of 2x2 superpixels.
    labels = _grid_labels(6, 6, 2)
    # Class 1 = the 4x4 square rows 1..4, cols 1..4 (not aligned with superpixels).
    class_map = np.zeros((6, 6), np.int64)
    class_map[1:5, 1:5] = 1
    # Proposal 0 = superpixels {0, 1, 3, 4} = the 4x4 square rows 0..3, cols 0..3.
    # Proposal 1 = superpixel {8} = rows 4..5, cols 4..5.
    membership = sp.csr_matrix(
        np.array([[1, 1, 0, 1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 0, 1]], bool)
    )
    areas = np.bincount(labels.ravel())
    iou = proposal_iou(membership, areas, _counts(labels, class_map, 2))
    assert iou.shape == (2, 2) and iou.dtype == np.float32
    # Overlap 3x3 = 9 pixels, union 16 + 16 - 9 = 23.
    assert iou[0, 1] == pytest.approx(9 / 23)
    # Proposal 1 touches class 1 in one pixel (4, 4): 1 / (4 + 16 - 1).
    assert iou[1, 1] == pytest.approx(1 / 19)
    # Same numbers by pixel counting, both classes.
    for p in range(2):
        mask_p = np.isin(labels, membership[p].indices)
        for k in range(2):
            assert iou[p, k] == pytest.approx(_pixel_iou(mask_p, class_map == k), rel=1e-6)


def test_random_proposals_match_pixel_count():
    rng = np.random.default_rng(0)
    labels = _grid_labels(12, 12, 3)  # 16 superpixels
    class_map = rng.integers(0, 3, size=(12, 12))
    dense = rng.random((20, 16)) < 0.3
    dense[0] = False  # an empty proposal: IoU with a class = 0
    membership = sp.csr_matrix(dense)
    iou = proposal_iou(membership, np.bincount(labels.ravel()), _counts(labels, class_map, 3))
    assert np.all(iou[0] == 0)
    for p in range(1, 20):
        mask_p = np.isin(labels, np.flatnonzero(dense[p]))
        for k in range(3):
            assert iou[p, k] == pytest.approx(_pixel_iou(mask_p, class_map == k), rel=1e-6)


def test_proposal_iou_rejects_mismatched_shapes():
    m = sp.csr_matrix(np.ones((2, 3), bool))
    with pytest.raises(ValueError, match="superpixel"):
        proposal_iou(m, np.ones(4), np.ones((3, 1)))
    with pytest.raises(ValueError, match="row sums"):
        proposal_iou(m, np.ones(3), np.full((3, 2), 1))


def test_filter_known_table():
    iou = np.array(
        [
            [0.9, 0.05, 0.7],
            [0.5, 0.10, 0.6],
            [0.3, 0.00, 0.05],
            [0.05, 0.8, 0.0],
        ]
    )
    prob = np.array(
        [
            [0.8, 0.05, 0.9],
            [0.49, 0.1, 0.5],
            [0.9, 0.11, 0.05],
            [0.05, 0.9, 0.0],
        ]
    )
    tags = np.array([True, True, False])
    pos, neg = filter_proposals(iou, prob, tags, t1=0.5, p1=0.5, t2=0.1, p2=0.1)
    expected_pos = np.array(
        [[1, 0, 0], [0, 0, 0], [0, 0, 0], [0, 1, 0]], bool
    )
    expected_neg = np.array(
        [[0, 1, 0], [0, 1, 0], [0, 0, 0], [1, 0, 0]], bool
    )
    np.testing.assert_array_equal(pos, expected_pos)
    np.testing.assert_array_equal(neg, expected_neg)
    # Untagged class 2 would be positive for row 0 and negative for rows 2, 3.
    pos_all, neg_all = filter_proposals(iou, prob, np.ones(3, bool))
    assert pos_all[0, 2] and pos_all[1, 2] and neg_all[2, 2] and neg_all[3, 2]


def test_filter_validates_thresholds_and_shapes():
    iou = np.zeros((2, 2))
    with pytest.raises(ValueError, match="t1"):
        filter_proposals(iou, iou, np.ones(2, bool), t1=1.5)
    with pytest.raises(ValueError, match="p2"):
        filter_proposals(iou, iou, np.ones(2, bool), p2=-0.1)
    with pytest.raises(ValueError, match="tags"):
        filter_proposals(iou, iou, np.ones(3, bool))
