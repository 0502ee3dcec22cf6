import numpy as np
import pytest
import scipy.sparse as sp

from wsseg.tasks.wsss.fusion import fuse_class, pseudo_label, seed_map, seeded_segmentation, three_way

# The constructed cases below were built for these options (pseudo_label's defaults before they
# became the configuration's, see test_pseudo_label_defaults_are_the_configuration's)
OLD_DEFAULTS = dict(t1=0.5, p1=0.5, p2=0.1, fusion="topk", seeding="random_walker", downscale=1, prior_weight=0.0)


def test_pseudo_label_defaults_are_the_configuration_s():
    """One source of defaults: pseudo_label's keyword defaults are ProposalConfig's."""
    import inspect

    from wsseg.tasks.config import ProposalConfig

    cfg = ProposalConfig()
    names = {"seed_prior_weight": "prior_weight"}
    params = inspect.signature(pseudo_label).parameters
    for field in ("t1", "p1", "t2", "p2", "fusion", "k", "threshold", "seeding", "beta", "downscale",
                  "seed_prior_weight", "grabcut_iters"):
        assert params[names.get(field, field)].default == getattr(cfg, field), field


def _membership(rows, n_sp):
    dense = np.zeros((len(rows), n_sp), bool)
    for p, cols in enumerate(rows):
        dense[p, cols] = True
    return sp.csr_matrix(dense)


# 3x3 grid of superpixels 0..8 (row-major); the object is the top-left 2x2 block
# {0, 1, 3, 4}. Proposals: the exact object (0.9), the object plus the column to its
# right (0.6), its corner {4} (0.3), and {8} (0.8, not positive).
GRID_PROPOSALS = _membership([[0, 1, 3, 4], [0, 1, 2, 3, 4, 5], [4], [8]], 9)
GRID_PROB = np.array([0.9, 0.6, 0.3, 0.8])
GRID_POSITIVE = np.array([True, True, True, False])


def test_fuse_class_grid_known_values():
    fused = fuse_class(GRID_PROPOSALS, GRID_PROB, GRID_POSITIVE, mode="topk", k=5)
    expected = np.array([1.5, 1.5, 0.6, 1.5, 1.8, 0.6, 0, 0, 0]) / 1.8
    assert fused.dtype == np.float32
    np.testing.assert_allclose(fused, expected, rtol=1e-6)
    # threshold mode keeps the positives with prob >= 0.5: proposals 0 and 1.
    fused = fuse_class(GRID_PROPOSALS, GRID_PROB, GRID_POSITIVE, mode="threshold", threshold=0.5)
    np.testing.assert_allclose(fused, [1, 1, 0.4, 1, 1, 0.4, 0, 0, 0], rtol=1e-6)
    # top-1 = the exact object mask.
    fused = fuse_class(GRID_PROPOSALS, GRID_PROB, GRID_POSITIVE, k=1)
    np.testing.assert_array_equal(fused, [1, 1, 0, 1, 1, 0, 0, 0, 0])
    # No positive -> zeros.
    fused = fuse_class(GRID_PROPOSALS, GRID_PROB, np.zeros(4, bool))
    np.testing.assert_array_equal(fused, np.zeros(9))


def test_three_way_grid_zones_and_seed_map():
    fused = fuse_class(GRID_PROPOSALS, GRID_PROB, GRID_POSITIVE)
    # Values {0 (x3), 1/3 (x2), 5/6 (x3), 1}: the best 3-clustering merges 5/6 and 1.
    zones = three_way(fused, weights=np.full(9, 16))
    np.testing.assert_array_equal(zones, [2, 2, 1, 2, 2, 1, 0, 0, 0])
    seeds = seed_map(fused[:, None], zones[:, None], background=2)
    np.testing.assert_array_equal(seeds, [1, 1, 0, 1, 1, 0, 2, 2, 2])
    # Without an implicit background the near-background area is not seeded.
    seeds = seed_map(fused[:, None], zones[:, None])
    np.testing.assert_array_equal(seeds, [1, 1, 0, 1, 1, 0, 0, 0, 0])


def test_three_way_kmeans_is_the_global_optimum():
    rng = np.random.default_rng(0)
    for _ in range(30):
        x = np.round(rng.random(9), 1)
        w = rng.random(9) + 0.1
        v = np.unique(x)
        if v.size < 3:
            continue
        best = None
        for a in range(1, v.size - 1):
            for b in range(a + 1, v.size):
                cost = 0.0
                for lo, hi in ((0, a), (a, b), (b, v.size)):
                    m = np.isin(x, v[lo:hi])
                    cost += np.sum(w[m] * (x[m] - np.average(x[m], weights=w[m])) ** 2)
                if best is None or cost < best[0] - 1e-12:
                    best = (cost, a, b)
        _, a, b = best
        expected = np.where(x <= v[a - 1], 0, np.where(x <= v[b - 1], 1, 2))
        np.testing.assert_array_equal(three_way(x, weights=w), expected)


def test_three_way_weights_move_the_split():
    # Four points, three clusters: the cheapest merge w_i w_j / (w_i + w_j) d^2 wins.
    x = np.array([0.0, 0.35, 0.6, 1.0])
    np.testing.assert_array_equal(three_way(x), [0, 1, 1, 2])  # merge 0.35 + 0.6
    # Heavy 0.35 and 0.6 make their merge costly: 0 joins 0.35 instead.
    np.testing.assert_array_equal(three_way(x, weights=[1, 100, 100, 1]), [0, 0, 1, 2])


def test_three_way_degenerate():
    np.testing.assert_array_equal(three_way(np.zeros(4)), [0, 0, 0, 0])
    np.testing.assert_array_equal(three_way(np.ones(3)), [2, 2, 2])
    np.testing.assert_array_equal(three_way(np.array([0.2, 0.7, 0.2])), [0, 2, 0])


def test_seed_map_several_near_object_takes_highest_fused():
    fused = np.array([[0.9, 0.7], [0.6, 0.8], [0.9, 0.0], [0.1, 0.2]])
    zones = np.array([[2, 2], [2, 2], [1, 0], [0, 0]], np.int8)
    np.testing.assert_array_equal(seed_map(fused, zones, background=3), [1, 2, 0, 3])
    with pytest.raises(ValueError, match="collides"):
        seed_map(fused, zones, background=2)


def _two_colour(h=30, w=40, split=20, noise=6, seed=0):
    rng = np.random.default_rng(seed)
    img = np.zeros((h, w, 3), np.float64)
    img[:, :split] = (200, 50, 40)
    img[:, split:] = (40, 60, 190)
    img = np.clip(img + rng.normal(0, noise, img.shape), 0, 255).astype(np.uint8)
    truth = np.ones((h, w), np.int32)
    truth[:, split:] = 2
    return img, truth


@pytest.mark.parametrize("method", ["random_walker", "grabcut"])
@pytest.mark.parametrize("downscale", [1, 2])
def test_seeded_segmentation_recovers_two_regions(method, downscale):
    img, truth = _two_colour()
    seeds = np.zeros(truth.shape, np.int32)
    seeds[10:18, 3:11] = 1
    seeds[10:18, 28:36] = 2
    labels, conf = seeded_segmentation(img, seeds, method=method, downscale=downscale)
    assert labels.dtype == np.int32 and conf.dtype == np.float32
    np.testing.assert_array_equal(labels, truth)
    assert np.all(conf[seeds > 0] == 1.0)
    assert np.all((conf > 0.5) & (conf <= 1.0))


def test_seeded_segmentation_prior_decides_where_colour_cannot():
    # one flat colour: the random walker splits the image between the seeds by distance alone;
    # a prior that says "label 2 everywhere but the left seed's column block" moves the border
    img = np.full((20, 40, 3), 120, np.uint8)
    seeds = np.zeros((20, 40), np.int32)
    seeds[8:12, 1:3] = 1
    seeds[8:12, 37:39] = 2
    plain, _ = seeded_segmentation(img, seeds)
    assert (plain[:, :15] == 1).all() and (plain[:, 25:] == 2).all()
    prior = np.zeros((2, 20, 40), np.float32)
    prior[0, :, :6] = 1.0
    prior[1, :, 6:] = 1.0
    labels, conf = seeded_segmentation(img, seeds, prior=prior, prior_weight=0.5)
    assert (labels[:, 6:] == 2).all() and (labels[8:12, 1:3] == 1).all()
    assert np.all(conf[seeds > 0] == 1.0)
    # weight 0 ignores the prior; a prior of the wrong shape is refused
    same, _ = seeded_segmentation(img, seeds, prior=prior, prior_weight=0.0)
    np.testing.assert_array_equal(same, plain)
    with pytest.raises(ValueError, match="prior must be"):
        seeded_segmentation(img, seeds, prior=prior[:1], prior_weight=0.5)


def test_seeded_segmentation_edge_cases():
    img, truth = _two_colour()
    seeds = np.zeros(truth.shape, np.int32)
    labels, conf = seeded_segmentation(img, seeds)
    assert np.all(labels == 0) and np.all(conf == 0)
    seeds[0, 0] = 3
    labels, conf = seeded_segmentation(img, seeds)
    assert np.all(labels == 3) and np.all(conf == 1)
    seeds[-1, -1] = 1
    labels, conf = seeded_segmentation(img, seeds, method="none")
    assert np.count_nonzero(labels) == 2 and conf.sum() == 2
    labels, _ = seeded_segmentation(img, seeds, method="nearest")
    assert labels[0, 1] == 3 and labels[-1, -2] == 1
    with pytest.raises(ValueError, match="random_walker"):
        seeded_segmentation(img, seeds, method="watershed")
    with pytest.raises(ValueError, match="shape"):
        seeded_segmentation(img, seeds[:5])


def _strip_scene():
    """30x30: red left half = class 0, blue right half = class 1, class 2 untagged.

    Superpixels: 3 rows x 6 column strips of 10x5 pixels, ids row * 6 + col.
    """
    img, truth = _two_colour(h=30, w=30, split=15, seed=1)
    rows = np.arange(30)[:, None] // 10
    cols = np.arange(30)[None, :] // 5
    sp_labels = (rows * 6 + cols).astype(np.int32)
    label_true = (truth - 1).astype(np.uint8)
    prelim = np.zeros((3, 30, 30), np.float32)
    prelim[0][label_true == 0] = 0.8
    prelim[1][label_true == 1] = 0.8
    prelim[2] = 0.2 - 0.1 * (label_true == 0)

    def strips(*cs):
        return [r * 6 + c for r in range(3) for c in cs]

    membership = _membership(
        [strips(0, 1, 2), strips(0, 1), strips(0, 1, 2, 3),
         strips(3, 4, 5), strips(4, 5), strips(2, 3, 4, 5), [0]],
        18,
    )
    prob = np.array(
        [[0.9, 0.05, 0.05], [0.8, 0.1, 0.1], [0.6, 0.3, 0.1],
         [0.05, 0.9, 0.05], [0.1, 0.8, 0.1], [0.3, 0.6, 0.1], [0.2, 0.2, 0.6]],
        np.float32,
    )
    tags = np.array([True, True, False])
    return img, sp_labels, membership, prob, prelim, tags, label_true


@pytest.mark.parametrize("seeding", ["random_walker", "grabcut"])
def test_pseudo_label_perfect_preliminary_map_is_returned(seeding):
    img, sp_labels, membership, prob, prelim, tags, label_true = _strip_scene()
    label, info = pseudo_label(img, sp_labels, membership, prob, prelim, tags, **{**OLD_DEFAULTS, 'seeding': seeding})
    assert label.dtype == np.uint8
    np.testing.assert_array_equal(label, label_true)
    assert info["positives"] == {0: 3, 1: 3}
    assert info["fallback"] == []
    # Seeds: strips 0, 1 (class 0) and 4, 5 (class 1); strips 2, 3 ambiguous.
    assert info["seed_share"] == pytest.approx(4 / 6)
    assert info["ambiguous_share"] == pytest.approx(2 / 6)
    assert info["ignore_share"] == 0.0


def test_pseudo_label_fallback():
    img, sp_labels, membership, prob, prelim, tags, label_true = _strip_scene()
    prob = prob.copy()
    prob[:, 1] = 0.0  # no positive for class 1 -> its preliminary map is used
    label, info = pseudo_label(img, sp_labels, membership, prob, prelim, tags, **OLD_DEFAULTS)
    assert info["fallback"] == [1] and info["positives"][1] == 0
    np.testing.assert_array_equal(label, label_true)


def test_pseudo_label_single_tag_is_whole_image():
    img, sp_labels, membership, prob, prelim, _, _ = _strip_scene()
    label, _ = pseudo_label(img, sp_labels, membership, prob, prelim, np.array([False, True, False]), **OLD_DEFAULTS)
    assert np.all(label == 1)


def test_pseudo_label_implicit_background():
    # Dark 30x30 image with a bright 10x10 square = class 1; class 0 = background.
    rng = np.random.default_rng(2)
    img = np.full((30, 30, 3), 30.0)
    img[10:20, 10:20] = 220
    img = np.clip(img + rng.normal(0, 5, img.shape), 0, 255).astype(np.uint8)
    truth = np.zeros((30, 30), np.uint8)
    truth[10:20, 10:20] = 1
    sp_labels = ((np.arange(30)[:, None] // 10) * 3 + np.arange(30)[None, :] // 10).astype(np.int32)
    prelim = np.stack([(truth == 0) * 0.9, (truth == 1) * 0.9, np.full((30, 30), 0.05)]).astype(np.float32)
    membership = _membership([[4], [4, 5], [0]], 9)
    prob = np.array([[0.1, 0.9, 0.0], [0.3, 0.6, 0.1], [0.9, 0.1, 0.0]], np.float32)
    tags = np.array([False, True, False])
    label, info = pseudo_label(img, sp_labels, membership, prob, prelim, tags, background=0, **OLD_DEFAULTS)
    np.testing.assert_array_equal(label, truth)
    assert np.count_nonzero(label == 0) == 800
    # Superpixel 5 (fused 0.4) is the only ambiguous one.
    assert info["ambiguous_share"] == pytest.approx(1 / 9)
    # Background with no object tag: all background; no background: single tag fills all.
    label, _ = pseudo_label(img, sp_labels, membership, prob, prelim, np.zeros(3, bool), background=0, **OLD_DEFAULTS)
    assert np.all(label == 0)
    label, _ = pseudo_label(img, sp_labels, membership, prob, prelim, tags, **OLD_DEFAULTS)
    assert np.all(label == 1)


def test_fast_internals_are_the_plain_formulas_bit_for_bit():
    """The seeded segmentation's shortcuts must not move the pseudo-labels by one bit: the GMM
    density (term by term, on distinct colours) against ``np.einsum`` on every pixel, with
    GrabCut models fitted on a sample photo; block means and block seeds against their plain
    numpy formulas; the channel argmax against ``np.argmax`` (ties, NaN)."""
    from pathlib import Path

    import cv2

    from wsseg.tasks.wsss.fusion import _argmax_channels, _block_mean, _block_seeds, _gmm_logpdf

    path = sorted((Path(__file__).resolve().parents[1] / "flows" / "sample" / "msrc21" / "images").glob("*.jpg"))[0]
    image = np.ascontiguousarray(cv2.cvtColor(cv2.imread(str(path)), cv2.COLOR_BGR2RGB)[::2, ::2])
    h, w = image.shape[:2]
    mask = np.full((h, w), cv2.GC_PR_BGD, np.uint8)
    mask[: h // 3] = cv2.GC_BGD
    mask[-h // 3:, w // 4: 3 * w // 4] = cv2.GC_FGD
    bgd, fgd = np.zeros((1, 65)), np.zeros((1, 65))
    cv2.setRNGSeed(0)
    cv2.grabCut(image, mask, None, bgd, fgd, 2, cv2.GC_INIT_WITH_MASK)
    pixels = image.reshape(-1, 3).astype(np.float64)
    for model in (bgd, fgd):
        m = model.ravel()
        coefs, means = m[:5], m[5:20].reshape(5, 3)
        covs = m[20:].reshape(5, 3, 3) + 1e-2 * np.eye(3)
        logs = []
        for c in range(5):
            if coefs[c] > 0:
                d = pixels - means[c]
                maha = np.einsum("ni,ij,nj->n", d, np.linalg.inv(covs[c]), d)
                logs.append(np.log(coefs[c]) - 0.5 * (maha + np.linalg.slogdet(covs[c])[1] + 3 * np.log(2 * np.pi)))
        want = np.logaddexp.reduce(np.stack(logs), axis=0)
        assert np.array_equal(_gmm_logpdf(model, pixels), want)
        colours, first = np.unique(pixels, axis=0, return_index=True)
        cols = tuple(np.ascontiguousarray(colours[:, i]) for i in range(3))
        assert np.array_equal(_gmm_logpdf(model, cols), want[first])

    rng = np.random.default_rng(0)
    for f in (2, 3):
        want = np.pad(image.astype(np.float64), ((0, -h % f), (0, -w % f), (0, 0)), mode="edge")
        want = want.reshape(want.shape[0] // f, f, want.shape[1] // f, f, 3).mean(axis=(1, 3))
        assert np.array_equal(_block_mean(image, f), want)
        seeds = rng.integers(0, 4, (h, w)) * (rng.random((h, w)) < 0.7)
        seeds[: h // 2] = 2
        padded = np.pad(seeds, ((0, -h % f), (0, -w % f)), mode="edge")
        blocks = padded.reshape(padded.shape[0] // f, f, -1, f).transpose(0, 2, 1, 3).reshape(
            padded.shape[0] // f, padded.shape[1] // f, f * f)
        want = np.zeros(blocks.shape[:2], np.int32)
        for c in range(1, 4):
            want[(blocks == c).sum(axis=-1) * 2 > f * f] = c
        got = _block_seeds(seeds, f, 3)
        assert got.dtype == want.dtype and np.array_equal(got, want)

    maps = rng.integers(0, 3, (5, 20, 30)).astype(np.float32)  # many ties
    channels = np.array([0, 2, 3, 4])
    assert np.array_equal(_argmax_channels(maps, channels), np.argmax(maps[channels], axis=0))
    maps[3, 4, 5] = np.nan
    assert np.array_equal(_argmax_channels(maps, channels), np.argmax(maps[channels], axis=0))
