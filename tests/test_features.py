"""Tests of tasks.wsss.features on hand-made images with known answers and one real photo."""

from pathlib import Path

import cv2
import numpy as np
import pytest
import scipy.sparse as sp

from wsseg.tasks.wsss.features import (FEATURE_NAMES, PROPOSAL_EXTRA_NAMES, proposal_features,
                                 superpixel_features)
from wsseg.tasks.wsss.proposals import hierarchical_proposals
from wsseg.tasks.wsss.superpixels import areas, superpixels

SAMPLE = Path(__file__).resolve().parents[1] / "flows" / "sample" / "msrc21" / "images"
COL = {name: i for i, name in enumerate(FEATURE_NAMES)}


def _red_green():
    """16x32 image, red left half, green right half; 4 superpixels of 16x8 (0, 1 red)."""
    image = np.zeros((16, 32, 3), np.uint8)
    image[:, :16] = (220, 20, 20)
    image[:, 16:] = (20, 200, 20)
    labels = np.repeat(np.repeat(np.arange(4)[None, :], 16, axis=0), 8, axis=1).astype(np.int32)
    return image, labels


def test_names_and_shape():
    assert len(FEATURE_NAMES) == len(set(FEATURE_NAMES)) == 94
    image, labels = _red_green()
    feats = superpixel_features(image, labels)
    assert feats.shape == (4, 94) and feats.dtype == np.float32
    assert np.isfinite(feats).all()


def test_lab_a_separates_red_from_green():
    image, labels = _red_green()
    feats = superpixel_features(image, labels)
    a = feats[:, COL["lab_mean_a"]]
    assert a[0] > 0.3 and a[1] > 0.3 and a[2] < -0.3 and a[3] < -0.3
    # flat colour inside each superpixel: zero colour spread
    assert np.allclose(feats[0, COL["lab_std_L"]:COL["lab_std_b"] + 1], 0, atol=1e-3)
    # histograms of a flat superpixel: one full bin
    hist_a = feats[:, COL["hist_a_0"]:COL["hist_a_7"] + 1]
    assert np.allclose(hist_a.sum(1), 1) and np.allclose(hist_a.max(1), 1)
    assert hist_a[0].argmax() > hist_a[3].argmax()
    # saturation-weighted hue: red and green fall in different hue bins
    hue = feats[:, COL["hist_hue_0"]:COL["hist_hue_11"] + 1]
    assert hue[0].argmax() != hue[3].argmax()


def test_position_size_and_edges():
    image, labels = _red_green()
    feats = superpixel_features(image, labels)
    assert np.allclose(feats[:, COL["cx"]], [0.125, 0.375, 0.625, 0.875])
    assert np.allclose(feats[:, COL["cy"]], 0.5)
    assert np.allclose(feats[:, COL["xmin"]], [0, 0.25, 0.5, 0.75])
    assert np.allclose(feats[:, COL["xmax"]], [0.25, 0.5, 0.75, 1.0])
    assert np.allclose(feats[:, COL["ymin"]], 0) and np.allclose(feats[:, COL["ymax"]], 1)
    assert np.allclose(feats[:, COL["area_share"]], 0.25)
    # edge density: only the superpixels at the colour step (1 and 2) see an edge
    dens = feats[:, COL["edge_density"]]
    assert dens[0] == 0 and dens[3] == 0 and dens[1] > 0 and dens[2] > 0
    edge = np.zeros((16, 32), np.float32)
    edge[:, :8] = 1.0
    given = superpixel_features(image, labels, edge_map=edge)[:, COL["edge_density"]]
    assert np.allclose(given, [1, 0, 0, 0])
    # texture: the step superpixels respond, the flat outer ones do not
    grad = feats[:, COL["grad_s1"]]
    assert grad[0] < 1e-6 and grad[3] < 1e-6 and grad[1] > 0.01


def test_proposal_features_singletons_and_area_weighting():
    image, labels = _red_green()
    labels = labels.copy()
    # unequal areas: superpixel 0 = columns 0..11 (192 px), 1 = columns 12..15 (64 px)
    labels[:, :12] = 0
    labels[:, 12:16] = 1
    feats = superpixel_features(image, labels)
    sp_area = areas(labels)
    assert sp_area.tolist() == [192, 64, 128, 128]
    membership = sp.csr_matrix(np.array([[1, 0, 0, 0],
                                         [0, 1, 0, 0],
                                         [1, 1, 0, 0],
                                         [0, 1, 1, 0],
                                         [1, 1, 1, 1]], bool))
    out = proposal_features(feats, membership, sp_area)
    d = len(FEATURE_NAMES)
    assert out.shape == (5, d + len(PROPOSAL_EXTRA_NAMES)) and np.isfinite(out).all()
    # singletons reproduce their own features exactly
    assert np.array_equal(out[0, :d], feats[0]) and np.array_equal(out[1, :d], feats[1])
    # area weighting: (64 f1 + 128 f2) / 192
    expected = (64 * feats[1].astype(np.float64) + 128 * feats[2]) / 192
    assert np.allclose(out[3, :d], expected, atol=1e-6)
    assert not np.allclose(out[3, :d], (feats[1] + feats[2]) / 2, atol=1e-4)
    # shape columns: area share, box height / width, fill
    share, box_h, box_w, fill = out[:, d:].T
    assert np.allclose(share, [0.375, 0.125, 0.5, 0.375, 1.0])
    assert np.allclose(box_h, 1.0)
    assert np.allclose(box_w, [0.375, 0.125, 0.5, 0.375, 1.0])
    assert np.allclose(fill, 1.0)


def test_proposal_features_errors():
    feats = np.zeros((3, 5), np.float32)
    m = sp.csr_matrix(np.eye(3, dtype=bool))
    with pytest.raises(ValueError, match="boxes"):
        proposal_features(feats, m, np.ones(3))
    out = proposal_features(feats, m, np.ones(3), boxes=np.tile([0, 1, 0, 1], (3, 1)))
    assert out.shape == (3, 9)
    with pytest.raises(ValueError, match="S"):
        proposal_features(feats, sp.csr_matrix(np.eye(4, dtype=bool)), np.ones(3))


def test_real_image_finite_and_discriminative():
    path = sorted(SAMPLE.glob("*.jpg"))[0]
    image = cv2.cvtColor(cv2.imread(str(path)), cv2.COLOR_BGR2RGB)
    labels = superpixels(image, region_size=16)
    before = image.copy()
    feats = superpixel_features(image, labels)
    assert np.array_equal(image, before)
    n = int(labels.max()) + 1
    assert feats.shape == (n, 94) and np.isfinite(feats).all()
    # features vary across superpixels in most columns
    assert (feats.std(0) > 0).sum() >= 60
    props = hierarchical_proposals(image, labels)
    pf = proposal_features(feats, props, areas(labels))
    assert pf.shape == (props.shape[0], 98) and np.isfinite(pf).all()
    assert np.array_equal(pf[:n, :94], feats)


def test_features_and_edges_are_bitwise_reproducible():
    """Two runs of one configuration must give the same pseudo-labels: the features feed the
    classifiers, and a last-bit difference changes what they learn. cv2.magnitude varied with
    memory alignment (in the superpixel features of these photos within six calls); nothing here may."""
    from wsseg.tasks.edges.weighting import feature_region_map

    for name in ("1_10_s", "2_20_s", "3_26_s", "3_30_s"):  # the sample photos where it showed
        image = cv2.cvtColor(cv2.imread(str(SAMPLE / f"{name}.jpg")), cv2.COLOR_BGR2RGB)
        labels = superpixels(image, method="slico", region_size=16)
        edges = [feature_region_map(image) for _ in range(6)]
        feats = [superpixel_features(image, labels) for _ in range(6)]
        assert all(np.array_equal(edges[0], e) for e in edges[1:]), name
        assert all(np.array_equal(feats[0], f) for f in feats[1:]), name


def test_lbp_is_scikit_image_s_bit_for_bit():
    """The vectorised uniform LBP must be scikit-image's exactly (the features, hence the
    classifiers and the pseudo-labels, would move otherwise): the sample photos, noise, a
    flat image and a few-level image with many equal neighbours, at P=8, R=1 and two others."""
    from skimage.feature import local_binary_pattern

    from wsseg.tasks.wsss.features import _lbp_uniform

    rng = np.random.default_rng(0)
    grays = [cv2.cvtColor(cv2.imread(str(p)), cv2.COLOR_BGR2GRAY) for p in sorted(SAMPLE.glob("*.jpg"))[:12]]
    grays += [rng.integers(0, 256, (41, 57)).astype(np.uint8), np.full((9, 13), 7, np.uint8),
              (rng.integers(0, 3, (37, 53)) * 100).astype(np.uint8)]
    for gray in grays:
        for p, r in ((8, 1), (8, 2), (16, 2)):
            want = local_binary_pattern(gray, p, r, method="uniform")
            got = _lbp_uniform(gray, p, r)
            assert got.dtype == want.dtype and np.array_equal(got, want), (gray.shape, p, r)
