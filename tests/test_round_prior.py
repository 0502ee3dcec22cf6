"""What the rounds >= 1 keep of round 0: its pseudo-labels as a prior, mixed
with model r-1's probabilities; answers known by construction."""
from __future__ import annotations

import numpy as np
import pytest

from wsseg.tasks.config import WSSSConfig
from wsseg.tasks.wsss.pipeline import label_prior, mix_prior, round0_prior


def test_label_prior_gives_each_pixel_its_label_half_and_the_tags_the_rest():
    allowed = np.array([True, False, True, True])
    label = np.array([[0, 2, 3, 255, 1]], np.uint8)  # 255: ignore; 1: not among the image's tags
    p = label_prior(label, allowed, 4)
    assert p.shape == (4, 1, 5) and p.dtype == np.float32
    third = 0.5 / 3
    np.testing.assert_allclose(p[:, 0, 0], [0.5 + third, 0, third, third], rtol=1e-6)
    np.testing.assert_allclose(p[:, 0, 2], [third, 0, third, 0.5 + third], rtol=1e-6)
    for x in (3, 4):  # no usable label: even over the tags
        np.testing.assert_allclose(p[:, 0, x], [1 / 3, 0, 1 / 3, 1 / 3], rtol=1e-6)
    np.testing.assert_allclose(p.sum(0), 1.0, rtol=1e-6)


def test_an_unsure_model_keeps_round_0s_label_and_a_sure_one_overrides_it():
    allowed = np.array([True, True, True])
    prior = label_prior(np.zeros((1, 4), np.uint8), allowed, 3)  # round 0 labelled every pixel class 0
    # model r-1 on class 1 at 0.4, 0.55, 0.7, 0.9 (class 0 takes the rest but 0.05)
    on1 = np.array([0.4, 0.55, 0.7, 0.9])
    prob = np.stack([1 - on1 - 0.05, on1, np.full(4, 0.05)])[:, None, :]
    mixed = mix_prior(prob, prior, allowed, 0.5)
    # geometric mean at weight 0.5: class 1 wins where on1 * (1/6) > (1 - on1 - 0.05) * (2/3)
    assert mixed.argmax(0).tolist() == [[0, 0, 0, 1]]
    np.testing.assert_allclose(mixed.sum(0), 1.0, rtol=1e-5)
    assert mix_prior(prob, prior, allowed, 0.0).argmax(0).tolist() == [[0, 1, 1, 1]]  # the model alone


def test_the_default_prior_is_round_0s_labels_and_a_missing_one_names_the_image(tmp_path):
    from wsseg.tasks.store import ClassSpec, ImageRecord, Store

    store = Store(tmp_path / "run")
    classes = ClassSpec(("grass", "cow", "sky"))
    rec = ImageRecord("a", 2, 3, ("grass", "cow"), "0" * 64, "train", "a.jpg", False)
    store.write_pseudo(0, "a", np.array([[0, 0, 1], [1, 1, 1]], np.uint8))
    p = round0_prior(store, rec, classes)
    assert p.shape == (3, 2, 3) and p[:, 0, 0].tolist() == [0.75, 0.25, 0.0] and p[:, 1, 2].tolist() == [0.25, 0.75, 0.0]
    missing = ImageRecord("b", 2, 3, ("grass",), "1" * 64, "train", "b.jpg", False)
    with pytest.raises(FileNotFoundError, match=r"no round 0 pseudo-label of b \(the rounds >= 1 keep it as their prior\)"):
        round0_prior(store, missing, classes)

