"""Tests of tasks.edges.weighting (METHOD.md B.1-B.7) on arrays with known answers."""

import numpy as np
import pytest

from wsseg.tasks.edges.weighting import OPERATORS, cv_weights, edge_fires, edge_maps, feature_region_map


def _step(h=32, w=64):
    img = np.zeros((h, w, 3), np.uint8)
    img[:, w // 2:] = 255
    return img


def test_edge_maps_keys_range_and_location():
    maps = edge_maps(_step())
    assert tuple(maps) == OPERATORS
    for name, emap in maps.items():
        assert emap.shape == (32, 64) and emap.dtype == np.float32
        assert emap.min() >= 0 and emap.max() == pytest.approx(1.0), name
        # strongest response next to the step, nothing far from it
        assert emap[:, :20].max() < 1e-6 and emap[:, 44:].max() < 1e-6, name
    assert np.argmax(maps["sobel"][16]) in (31, 32)


def test_edge_fires_on_step():
    fires = edge_fires(edge_maps(_step()))
    for name, fire in fires.items():
        assert fire.dtype == bool
        # fires next to the step on every row (LoG: on both sides of its zero crossing)
        assert fire[:, 26:38].any(axis=1).all(), name
        assert not fire[:, :20].any() and not fire[:, 44:].any(), name
    pct = edge_fires(edge_maps(_step()), method="percentile", percentile=95)
    assert not pct["sobel"][:, :20].any()


def test_feature_region_map_step_edge():
    region, weights = feature_region_map(_step(), return_weights=True)
    assert region.dtype == np.uint8 and set(np.unique(region)) == {0, 1}
    # thin band at the step, zero in the flat areas
    cols = np.nonzero(region.any(axis=0))[0]
    assert cols.min() >= 28 and cols.max() <= 35
    assert region[:, 31:33].any(axis=1).all()
    assert region[:, :28].sum() == 0 and region[:, 36:].sum() == 0
    assert set(weights) == set(OPERATORS)
    assert sum(weights.values()) == pytest.approx(1.0)
    assert all(w > 0 for w in weights.values())


def test_flat_image_all_zero_and_equal_weights():
    region, weights = feature_region_map(np.full((20, 30, 3), 117, np.uint8), return_weights=True)
    assert region.shape == (20, 30) and region.sum() == 0
    assert all(w == pytest.approx(0.25) for w in weights.values())


def test_tau_above_one_gives_empty_map_and_tau_zero_full():
    img = _step()
    assert feature_region_map(img, tau=1.01).sum() == 0
    assert feature_region_map(img, tau=1.5).sum() == 0
    assert feature_region_map(img, tau=0.0).all()


def test_cv_weights_hand_computation():
    a = np.array([[0.0, 1.0], [1.0, 0.0]])
    b = np.array([[0.0, 1.0], [1.0, 1.0]])
    # mean image [[0, 1], [1, .5]]; deviations a: [0,0,0,-.5], b: [0,0,0,.5]
    # sigma_a = sigma_b = sqrt(.25 / 4) = .25; mu_a = .5, mu_b = .75
    cv_a, cv_b = 0.25 / 0.5, 0.25 / 0.75
    w = cv_weights({"a": a, "b": b})
    assert w["a"] == pytest.approx(cv_a / (cv_a + cv_b))
    assert w["b"] == pytest.approx(cv_b / (cv_a + cv_b))


def test_cv_weights_guards():
    zero = np.zeros((2, 2))
    one = np.array([[0.0, 1.0], [0.0, 0.0]])
    # mu = 0 -> that map gets no weight
    w = cv_weights({"z": zero, "o": one})
    assert w == {"z": 0.0, "o": 1.0}
    # all CV zero -> equal weights
    w = cv_weights({"a": one, "b": one.copy(), "c": one.copy()})
    assert all(v == pytest.approx(1 / 3) for v in w.values())


def test_input_validation_and_no_mutation():
    img = _step()
    before = img.copy()
    feature_region_map(img)
    assert np.array_equal(img, before)
    with pytest.raises(ValueError, match="uint8"):
        edge_maps(img.astype(np.float32))
    with pytest.raises(ValueError, match="RGB"):
        edge_maps(np.zeros((4, 4, 4), np.uint8))
    with pytest.raises(ValueError, match="otsu"):
        edge_fires(edge_maps(img), method="mean")
