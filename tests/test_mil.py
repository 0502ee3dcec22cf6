"""tasks.wsss.mil: targets and mixtures by construction; refinement corrects a systematically wrong
preliminary result using what the other images show."""
import numpy as np
import pytest
import torch

from wsseg.tasks.wsss.mil import evidence, hard_targets, refine
from wsseg.tasks.wsss.proposal_classifier import combine_evidence


def test_hard_targets_respect_allowed():
    ev = np.array([[0.1, 0.2, 0.7], [0.6, 0.3, 0.1]])
    allowed = np.array([True, True, False])
    assert np.array_equal(hard_targets(ev, allowed), [[0, 1, 0], [1, 0, 0]])
    with pytest.raises(ValueError, match="allowed"):
        hard_targets(ev, np.ones(2, bool))


def test_mix_endpoints_and_normalisation():
    pred = np.array([[0.9, 0.1, 0.0]])
    prelim = np.array([[0.2, 0.8, 0.0]])
    allowed = np.array([True, True, False])
    mix = lambda w: combine_evidence(prelim, pred, allowed, weight=w)  # noqa: E731
    assert np.allclose(mix(0.0), [[0.9, 0.1, 0]], atol=1e-3)
    assert np.allclose(mix(1.0), [[0.2, 0.8, 0]], atol=1e-3)
    half = mix(0.5)
    assert np.allclose(half.sum(1), 1) and half[0, 2] == 0
    assert np.isclose(half[0, 0] / half[0, 1], np.sqrt(0.9 * 0.2 / (0.1 * 0.8)), rtol=1e-3)
    with pytest.raises(ValueError):
        mix(1.5)


def _corpus(rng, n_images=30, n_sp=40):
    """Classes 0 (e.g. grass) and 1 (cow) readable from feature 0; images tagged {0, 1} have a
    preliminary result that gives a third of class-1 superpixels to class 0 (the co-occurrence
    error), images tagged {0} alone are all class 0."""
    feats, prelims, allowed, areas, truth = [], [], [], [], []
    for i in range(n_images):
        both = i % 3 != 0
        y = (rng.random(n_sp) < 0.5).astype(int) if both else np.zeros(n_sp, int)
        x = rng.normal(size=(n_sp, 4)).astype(np.float32)
        x[:, 0] += 4 * y
        p = np.eye(3, dtype=np.float32)[y] * 0.8 + 0.1
        wrong = (y == 1) & (rng.random(n_sp) < 0.35)
        p[wrong] = [0.7, 0.2, 0.1]
        tags = np.array([True, both, False])
        feats.append(x)
        prelims.append(p)
        allowed.append(tags)
        areas.append(rng.integers(50, 150, n_sp))
        truth.append(y)
    return feats, prelims, allowed, areas, truth


def _accuracy(evs, allowed, truth):
    return np.mean(np.concatenate([hard_targets(e, a).argmax(1) == y for e, a, y in zip(evs, allowed, truth)]))


def test_refine_corrects_the_preliminary_result():
    feats, prelims, allowed, areas, truth = _corpus(np.random.default_rng(0))
    before = _accuracy(prelims, allowed, truth)
    res = refine(feats, prelims, allowed, areas, iterations=3, prior_weight=0.3, epochs=20, lr=1e-2,
                 batch_size=64)
    assert isinstance(res.model.net, torch.nn.Linear)  # logistic regression
    after = _accuracy([evidence(res.model, x, p, a, 0.3) for x, p, a in zip(feats, prelims, allowed)],
                      allowed, truth)
    assert before < 0.9 and after > 0.97, (before, after)
    assert len(res.changed) == 3 and res.changed[0] > res.changed[-1]
    # untagged classes never appear
    ev = evidence(res.model, feats[0], prelims[0], allowed[0], 0.3)
    assert ev[:, 1:].max() == 0


def test_refine_off_and_bad_input():
    feats, prelims, allowed, areas, _ = _corpus(np.random.default_rng(1), n_images=2, n_sp=5)
    res = refine(feats, prelims, allowed, areas, iterations=0)
    assert res.model is None
    assert np.allclose(evidence(None, feats[1], prelims[1], allowed[1], 0.3).sum(1), 1)
    with pytest.raises(ValueError, match="image 1"):
        refine(feats, [prelims[0], prelims[1][:3]], allowed, areas)


def test_negatives_separate_classes_that_share_every_image():
    """Classes 0 (face) and 1 (body) are tagged together in every image where 0 appears, and the
    preliminary result cannot tell them apart (a tie, so the argmax gives everything to 0). Class 1
    also appears with class 2 alone. Only the images not tagged 0 say what 0 is not: with the
    softmax over every class in training (negatives) the MIL learns that body-looking superpixels
    are not class 0; with the softmax over the tags alone those images teach the 0-vs-1 choice
    nothing and body stays class 0."""
    rng = np.random.default_rng(5)
    feats, prelims, allowed, areas, truth = [], [], [], [], []
    for i in range(40):
        face = i % 2 == 0
        y = np.where(rng.random(30) < 0.5, 1, 0 if face else 2)
        x = rng.normal(size=(30, 3)).astype(np.float32)
        x[np.arange(30), y] += 4  # each class readable from its own feature
        tags = np.array([face, True, not face])
        p = np.where(tags, 1.0, 0.0)[None].repeat(30, 0).astype(np.float32)
        if not face:
            p[y == 1], p[y == 2] = [0, 0.8, 0.2], [0, 0.2, 0.8]  # localised where the classes differ
        p /= p.sum(1, keepdims=True)
        feats.append(x), prelims.append(p), areas.append(np.full(30, 100)), truth.append(y)
        allowed.append(tags)
    kw = dict(iterations=3, prior_weight=0.3, epochs=20, lr=1e-2, batch_size=64)

    def face_images_accuracy(res):
        idx = [i for i in range(40) if i % 2 == 0]
        return _accuracy([evidence(res.model, feats[i], prelims[i], allowed[i], 0.3) for i in idx],
                         [allowed[i] for i in idx], [truth[i] for i in idx])
    tags_only = face_images_accuracy(refine(feats, prelims, allowed, areas, negatives=False, **kw))
    everyone = face_images_accuracy(refine(feats, prelims, allowed, areas, negatives=True, **kw))
    assert tags_only < 0.7 and everyone > 0.95, (tags_only, everyone)
