import numpy as np
import pytest

from wsseg.tasks.wsss.crf import crf_labels, dense_crf, pydensecrf_available


def _noisy_scene(seed=0, split=40):
    """Two-colour 60x80 image; class 0 left, class 1 right; a weak, noisy unary."""
    rng = np.random.default_rng(seed)
    img = np.zeros((60, 80, 3))
    img[:, :split] = (200, 50, 40)
    img[:, split:] = (40, 60, 190)
    img = np.clip(img + rng.normal(0, 6, img.shape), 0, 255).astype(np.uint8)
    truth = np.zeros((60, 80), np.int64)
    truth[:, split:] = 1
    p = np.where(truth == 0, 0.65, 0.35) + rng.normal(0, 0.25, truth.shape)
    p = np.clip(p, 0.01, 0.99)
    return img, np.stack([p, 1 - p]).astype(np.float32), truth


@pytest.mark.parametrize("backend", ["approx", "auto"])
def test_crf_cleans_noisy_map_and_normalises(backend):
    img, prob, truth = _noisy_scene()
    before = np.mean(prob.argmax(0) == truth)
    q = dense_crf(img, prob, backend=backend)
    after = np.mean(q.argmax(0) == truth)
    assert before < 0.8  # the noise flips about a quarter of the pixels
    assert after > 0.98 and after > before
    assert q.shape == prob.shape and q.dtype == np.float32
    np.testing.assert_allclose(q.sum(axis=0), 1.0, atol=1e-5)
    assert np.all(q >= 0)


def test_crf_follows_colour_edge_not_just_smoothing():
    # The unary is uninformative (0.5) except for a few confident pixels on each
    # side: the bilateral kernel must carry each label up to the colour edge,
    # which is off the middle between them (spatial smoothing alone splits at 40).
    img, _, truth = _noisy_scene(seed=1, split=25)
    prob = np.full((2, 60, 80), 0.5, np.float32)
    prob[:, 25:35, 5:10] = [[[0.9]], [[0.1]]]
    prob[:, 25:35, 70:75] = [[[0.1]], [[0.9]]]
    q = dense_crf(img, prob, backend="approx", n_iter=10)
    assert np.mean(q.argmax(0) == truth) > 0.95
    q = dense_crf(img, prob, backend="approx", n_iter=10, bilateral_compat=0)
    assert np.mean(q.argmax(0) == truth) < 0.9


def test_crf_input_not_modified_and_validation():
    img, prob, _ = _noisy_scene()
    copy = prob.copy()
    dense_crf(img, prob, backend="approx", n_iter=2)
    np.testing.assert_array_equal(prob, copy)
    with pytest.raises(ValueError, match="prob must be"):
        dense_crf(img, prob[:, :10])
    with pytest.raises(ValueError, match="backend"):
        dense_crf(img, prob, backend="lattice")
    with pytest.raises(ValueError, match="n_iter"):
        dense_crf(img, prob, n_iter=0)
    if not pydensecrf_available():
        with pytest.raises(ImportError, match="pydensecrf2"):
            dense_crf(img, prob, backend="pydensecrf")


# ---------------------------------------------------------------------------- crf_labels (cam_crf baseline)
def _halves(h=40, w=60):
    """Left half dark red, right half light blue; truth: class 1 left, class 3 right."""
    image = np.zeros((h, w, 3), np.uint8)
    image[:, : w // 2] = (150, 30, 30)
    image[:, w // 2:] = (40, 140, 220)
    truth = np.full((h, w), 3, np.uint8)
    truth[:, : w // 2] = 1
    return image, truth


@pytest.mark.parametrize("backend", ["pydensecrf", "approx"])
def test_crf_labels_uses_only_tagged_classes_and_cleans_noise(backend):
    image, truth = _halves()
    rng = np.random.default_rng(0)
    k = 5
    prob = rng.uniform(0.0, 1.0, (k,) + truth.shape).astype(np.float32)
    # the two tagged classes lean weakly towards the truth, untagged ones are strong noise
    prob[1] += 0.35 * (truth == 1)
    prob[3] += 0.35 * (truth == 3)
    prob[[0, 2, 4]] *= 2.0
    allowed = np.array([False, True, False, True, False])
    before = allowed.nonzero()[0][prob[allowed].argmax(0)]
    label = crf_labels(image, prob, allowed, backend=backend)
    assert label.dtype == np.uint8 and label.shape == truth.shape
    assert set(np.unique(label)) <= {1, 3}
    acc_before, acc_after = np.mean(before == truth), np.mean(label == truth)
    assert acc_before < 0.85
    assert acc_after > 0.97 and acc_after > acc_before


def test_crf_labels_validates_and_handles_one_tag():
    image, truth = _halves(8, 8)
    prob = np.ones((3, 8, 8), np.float32)
    assert (crf_labels(image, prob, np.array([False, False, True])) == 2).all()
    with pytest.raises(ValueError, match="no True"):
        crf_labels(image, prob, np.zeros(3, bool))
    with pytest.raises(ValueError, match="allowed must be"):
        crf_labels(image, prob, np.ones(4, bool))
    with pytest.raises(ValueError, match="prob must be"):
        crf_labels(image, prob[:, :4], np.ones(3, bool))
