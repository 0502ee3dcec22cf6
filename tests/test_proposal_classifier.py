"""tasks.wsss.proposal_classifier: targets by construction, and a classifier that learns."""
import numpy as np
import scipy.sparse as sp

from wsseg.tasks.wsss.proposal_classifier import predict_proposals, proposal_targets, train_proposal_classifier


def test_targets_known_answer():
    # 3 superpixels of areas 1, 1, 2; proposal 0 = {0}, proposal 1 = {1, 2}
    m = sp.csr_matrix(np.array([[1, 0, 0], [0, 1, 1]], bool))
    sp_prob = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.5, 0.5, 0.0]])
    areas = np.array([1, 1, 2])
    tags = np.array([True, True, False])
    t = proposal_targets(m, sp_prob, areas, tags, sharpen=1.0)
    assert np.allclose(t[0], [1, 0, 0])
    # area-weighted mean of superpixels 1 and 2: (0*1 + 0.5*2)/3 = 1/3 and (1*1 + 0.5*2)/3 = 2/3
    assert np.allclose(t[1], [1 / 3, 2 / 3, 0])
    t2 = proposal_targets(m, sp_prob, areas, tags, sharpen=2.0)
    assert np.allclose(t2[1], [0.2, 0.8, 0])  # (1/9, 4/9) renormalised


def test_classifier_learns_and_respects_tags():
    rng = np.random.default_rng(0)
    feats, targets, tags = [], [], []
    for i in range(20):
        y = rng.integers(0, 3, 40)
        x = rng.normal(size=(40, 5)).astype(np.float32)
        x[:, 0] += 3 * y  # the class is readable from feature 0
        feats.append(x)
        targets.append(np.eye(3, dtype=np.float32)[y])
        tags.append(np.ones(3, bool))
    model, losses = train_proposal_classifier(feats, targets, tags, hidden=32, epochs=20, lr=1e-2, batch_size=64)
    assert losses[-1] < 0.5 * losses[0]
    x = np.array([[0, 0, 0, 0, 0], [6, 0, 0, 0, 0]], np.float32)
    p = predict_proposals(model, x, np.ones(3, bool))
    assert p[0].argmax() == 0 and p[1].argmax() == 2
    # a class that is not tagged gets no probability
    q = predict_proposals(model, x, np.array([True, True, False]))
    assert q[:, 2].max() == 0 and np.allclose(q.sum(1), 1)


def test_negatives_learn_from_images_without_the_tag():
    """Images tagged {0, 1} say nothing about which proposal is which (uniform targets); images
    tagged {1} alone show what class 1 looks like. Only with ``negatives`` do those images count
    against class 0, so the classifier prefers 1 on class-1-looking proposals."""
    rng = np.random.default_rng(2)
    feats, targets, tags = [], [], []
    for i in range(30):
        both = i % 2 == 0
        y = rng.integers(0, 2, 40) if both else np.ones(40, int)
        x = rng.normal(size=(40, 3)).astype(np.float32)
        x[:, 0] += 4 * y
        feats.append(x)
        targets.append(np.tile([0.5, 0.5, 0.0], (40, 1)).astype(np.float32) if both
                       else np.eye(3, dtype=np.float32)[y])
        tags.append(np.array([True, True, False]) if both else np.array([False, True, False]))
    x1 = np.array([[4, 0, 0]], np.float32)
    both = np.array([True, True, False])
    p = {neg: predict_proposals(train_proposal_classifier(feats, targets, tags, hidden=0, epochs=20, lr=1e-2,
                                                          batch_size=64, negatives=neg)[0], x1, both)[0, 1]
         for neg in (False, True)}
    assert abs(p[False] - 0.5) < 0.1 and p[True] > 0.8, p
