import numpy as np
import pytest

from wsseg.tasks.common.metrics import (
                                  ConfusionAccumulator,
                                  changed_share,
                                  confusion_matrix,
                                  ignore_share,
                                  iou_from_confusion,
                                  )

GT = np.array(
    [
        [0, 0, 1, 1],
        [0, 0, 1, 1],
        [2, 2, 255, 255],
        [2, 2, 2, 2],
    ],
    dtype=np.uint8,
)
PRED = np.array(
    [
        [0, 1, 1, 1],
        [0, 0, 1, 255],
        [2, 0, 0, 0],
        [2, 2, 2, 2],
    ],
    dtype=np.uint8,
)


def test_confusion_matrix_known_counts():
    conf = confusion_matrix(PRED, GT, 4)
    expected = np.array(
        [
            [3, 1, 0, 0, 0],
            [0, 3, 0, 0, 1],  # one class-1 pixel left undecided (255)
            [1, 0, 5, 0, 0],
            [0, 0, 0, 0, 0],
        ]
    )
    assert conf.dtype == np.int64
    np.testing.assert_array_equal(conf, expected)
    # The two void gt pixels (predicted 0) are skipped entirely.
    assert conf.sum() == 14


def test_iou_known_values_ignore_is_wrong_absent_is_nan():
    per_class, miou = iou_from_confusion(confusion_matrix(PRED, GT, 4))
    np.testing.assert_allclose(per_class[:3], [3 / 5, 3 / 5, 5 / 6])
    assert np.isnan(per_class[3])
    assert miou == pytest.approx((3 / 5 + 3 / 5 + 5 / 6) / 3)


def test_ignore_prediction_counts_against_class():
    gt = np.zeros((2, 2), np.uint8)
    pred = np.array([[0, 0], [0, 255]], np.uint8)
    per_class, miou = iou_from_confusion(confusion_matrix(pred, gt, 1))
    assert per_class[0] == pytest.approx(3 / 4)
    assert miou == pytest.approx(3 / 4)


def test_perfect_prediction_gives_one():
    _, miou = iou_from_confusion(confusion_matrix(GT, GT, 3))
    assert miou == pytest.approx(1.0)


def test_shape_mismatch_names_both_shapes():
    with pytest.raises(ValueError, match=r"\(4, 4\).*\(2, 8\)"):
        confusion_matrix(PRED, GT.reshape(2, 8), 4)
    with pytest.raises(ValueError, match="shape"):
        changed_share(PRED, PRED[:2])


def test_gt_out_of_range_raises():
    with pytest.raises(ValueError, match="n_classes"):
        confusion_matrix(PRED, GT, 2)


def test_changed_and_ignore_share():
    assert changed_share(PRED, GT) == pytest.approx(5 / 16)
    assert changed_share(GT, GT) == 0.0
    assert ignore_share(GT) == pytest.approx(2 / 16)
    assert ignore_share(PRED) == pytest.approx(1 / 16)


def test_accumulator_equals_summed_confusion():
    acc = ConfusionAccumulator(4)
    acc.update(PRED, GT)
    acc.update(GT, GT)
    conf = confusion_matrix(PRED, GT, 4) + confusion_matrix(GT, GT, 4)
    np.testing.assert_array_equal(acc.conf, conf)
    per_class, miou = iou_from_confusion(conf)
    np.testing.assert_allclose(acc.per_class, per_class)
    assert acc.miou == pytest.approx(miou)
    # IoU of class 0 over both images: TP 3+4, GT 4+4, PRED 4+4.
    assert acc.per_class[0] == pytest.approx(7 / (8 + 8 - 7))


def test_mean_class_accuracy_known_counts():
    from wsseg.tasks.common.metrics import class_accuracy_from_confusion

    # rows of the confusion of PRED against GT above: class 0 3/4 right, class 1 3/4 (one
    # undecided pixel is wrong), class 2 5/6, class 3 absent from the truth (NaN, left out)
    per_class, mean = class_accuracy_from_confusion(confusion_matrix(PRED, GT, 4))
    assert per_class[:3].tolist() == pytest.approx([0.75, 0.75, 5 / 6]) and np.isnan(per_class[3])
    assert mean == pytest.approx((0.75 + 0.75 + 5 / 6) / 3)
    acc = ConfusionAccumulator(4)
    acc.update(PRED, GT)
    assert acc.mean_class_accuracy == pytest.approx(mean)
    # a rare class weighs as much as a frequent one: all of class 0 right, none of class 1
    gt = np.array([0] * 98 + [1] * 2)
    per_class, mean = class_accuracy_from_confusion(confusion_matrix(np.zeros(100, int), gt, 2))
    assert per_class.tolist() == [1.0, 0.0] and mean == 0.5
    with pytest.raises(ValueError, match="conf must have shape"):
        class_accuracy_from_confusion(np.zeros((2, 4)))


def test_source_scores_report_class_accuracy_beside_miou():
    from wsseg.tasks.wsss.summary import source_scores

    conf = confusion_matrix(PRED, GT, 4)
    half = conf // 2
    out = source_scores([{"x": half.tolist()}, {"x": (conf - half).tolist()}], ["a", "b", "c", "d"])["x"]
    assert out["mean_class_accuracy"] == pytest.approx((0.75 + 0.75 + 5 / 6) / 3)
    assert out["per_class_accuracy"] == {"a": 0.75, "b": 0.75, "c": pytest.approx(5 / 6), "d": None}
    assert out["miou"] == pytest.approx(iou_from_confusion(conf)[1])
    from wsseg.tasks.common.metrics import chance_iou_from_confusion
    assert out["chance_miou"] == pytest.approx(chance_iou_from_confusion(conf)[1])
    assert out["per_class_chance_iou"]["d"] is None and out["per_class_chance_iou"]["a"] == pytest.approx(
        chance_iou_from_confusion(conf)[0][0])


def test_chance_iou_is_what_labels_placed_at_random_score():
    from wsseg.tasks.common.metrics import chance_iou_from_confusion

    # 10 pixels, truth 6 of class 0 and 4 of class 1, prediction the same shares: the expected
    # overlaps are 6*6/10 and 4*4/10, whatever the prediction's diagonal
    for conf in ([[6, 0], [0, 4]], [[2, 4], [4, 0]]):
        per_class, miou = chance_iou_from_confusion(np.array(conf))
        assert per_class.tolist() == pytest.approx([3.6 / 8.4, 1.6 / 6.4]) and miou == pytest.approx(
            (3.6 / 8.4 + 0.25) / 2)
    # labels drawn independently of the truth with known shares score their chance level: a
    # two-thirds background truth labelled 90 % background at random gives background IoU 0.62
    rng = np.random.default_rng(0)
    gt = (rng.random(1_000_000) < 1 / 3).astype(np.uint8)
    pred = (rng.random(1_000_000) < 0.1).astype(np.uint8)
    acc = ConfusionAccumulator(2)
    acc.update(pred, gt)
    chance = chance_iou_from_confusion(acc.conf)[0]
    assert acc.per_class == pytest.approx(chance, abs=2e-3) and chance[0] == pytest.approx(0.6207, abs=3e-3)
    assert acc.chance_miou == pytest.approx(acc.miou, abs=2e-3)
    # labels that know where things are score well above it; undecided pixels stay undecided
    assert iou_from_confusion(confusion_matrix(gt, gt, 2))[1] > acc.chance_miou + 0.5
    per_class, _ = chance_iou_from_confusion(confusion_matrix(PRED, GT, 4))
    conf = confusion_matrix(PRED, GT, 4).astype(float)
    n, gt_c, pred_c = conf.sum(), conf.sum(1), conf[:, :4].sum(0)
    assert per_class[0] == pytest.approx((gt_c[0] * pred_c[0] / n) / (gt_c[0] + pred_c[0] - gt_c[0] * pred_c[0] / n))
    assert np.isnan(per_class[3])


def test_reverted_share_counts_changes_that_go_back():
    from wsseg.tasks.common.metrics import reverted_share

    before = np.array([0, 0, 1, 1, 2])
    previous = np.array([1, 0, 1, 0, 2])  # pixels 0 and 3 changed in the round before
    label = np.array([0, 2, 1, 1, 1])  # 0 and 3 went back; 1 and 4 changed to something new
    assert reverted_share(label, previous, before) == pytest.approx(2 / 5)
    assert reverted_share(label, previous, None) == 0.0
    with pytest.raises(ValueError, match="same shape"):
        reverted_share(label, previous, before[:3])


def test_round_shares_from_shard_pixel_counts_and_from_older_per_image_stats():
    """The round's changed / ignore / reverted shares are pixel-weighted over the whole split:
    from the pseudo-label shards' summed pixel counts, and equally from the per-image shares a
    shard finished by an older wsseg recorded."""
    from wsseg.tasks.wsss.summary import label_shares, reverted_of

    new = [{"images": 2, "pixels": 300, "changed_pixels": 30, "reverted_pixels": 3, "ignore_pixels": 60},
           {"images": 1, "pixels": 100, "changed_pixels": 50, "reverted_pixels": 0, "ignore_pixels": 0}]
    old = [{"images": 2, "stats": [{"image_id": "a", "pixels": 200, "changed": 0.1, "reverted": 0.015, "ignore": 0.3},
                                   {"image_id": "b", "pixels": 100, "changed": 0.1, "reverted": 0.0, "ignore": 0.0}]},
           new[1]]
    assert label_shares(new) == (80 / 400, 60 / 400) and reverted_of(new) == 3 / 400
    assert label_shares(old) == pytest.approx((80 / 400, 60 / 400)) and reverted_of(old) == pytest.approx(3 / 400)


def test_tag_coverage_known_by_construction():
    """Tag coverage (the stopping rule's signal): the mean over tagged classes of the mean log
    label share on their images. Hand-counted: image A (tags 0, 1) labelled 3/4 class 0 and 1/4
    class 1, image B (tag 1) all class 1; a class the labels leave out counts as the floor."""
    from wsseg.tasks.common.metrics import SHARE_FLOOR, tag_coverage, tag_log_shares
    from wsseg.tasks.wsss.summary import coverage_of

    a = np.array([[0, 0], [0, 1]], np.uint8)
    b = np.ones((2, 2), np.uint8)
    la, ta = tag_log_shares(a, [0, 1], 3)
    lb, tb = tag_log_shares(b, [1], 3)
    assert ta.tolist() == [1, 1, 0] and tb.tolist() == [0, 1, 0]
    assert la == pytest.approx([np.log(0.75), np.log(0.25), 0.0]) and lb == pytest.approx([0.0, 0.0, 0.0])
    # class 0: log 0.75 on its one image; class 1: (log 0.25 + log 1) / 2 on its two
    expected = (np.log(0.75) + np.log(0.25) / 2) / 2
    assert tag_coverage(la + lb, ta + tb) == pytest.approx(expected)
    # undecided pixels (255) count in the image's size, not for any class
    lu, _ = tag_log_shares(np.array([[0, 255], [255, 255]], np.uint8), [0], 3)
    assert lu[0] == pytest.approx(np.log(0.25))
    # a tagged class absent from the labels: log(floor), not -inf
    lm, _ = tag_log_shares(b, [0, 1], 3)
    assert lm[0] == pytest.approx(np.log(SHARE_FLOOR))
    assert np.isnan(tag_coverage(np.zeros(3), np.zeros(3)))
    # summed over shards as tasks.wsss.pipeline.pseudo_shard records it; None for an older wsseg's shard
    shards = [{"tag_log_shares": la.tolist(), "tagged": ta.tolist()}, {"tag_log_shares": lb.tolist(), "tagged": tb.tolist()}]
    assert coverage_of(shards) == pytest.approx(expected)
    assert coverage_of(shards + [{"pixels": 4}]) is None and coverage_of([]) is None
    assert coverage_of([{"tag_log_shares": [0.0, 0.0], "tagged": [0, 0]}]) is None  # no tag: nothing to judge


def test_tag_coverage_falls_when_a_large_class_eats_a_small_one():
    """The drift the stopping rule is after: images tagged (sky, bird), the bird 5 % of each; labels
    that give half the bird to the sky score lower, labels that find all of it higher."""
    from wsseg.tasks.common.metrics import tag_coverage, tag_log_shares

    def coverage(bird_rows):
        sums, counts = np.zeros(2), np.zeros(2)
        for _ in range(10):
            label = np.zeros((100, 100), np.uint8)
            label[:bird_rows] = 1
            s, t = tag_log_shares(label, [0, 1], 2)
            sums, counts = sums + s, counts + t
        return tag_coverage(sums, counts)

    assert coverage(2) < coverage(5)
    # its blind side: a bird grown past its true size scores higher too (the rule cannot know the size)
    assert coverage(10) > coverage(5)


def test_miou_is_over_the_classes_of_the_truth_so_a_stray_absent_class_costs_only_its_pixels():
    # truth has classes 0 and 1; prediction a puts one pixel of class 2 (absent from the truth)
    gt = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    a = np.array([0, 0, 0, 2, 1, 1, 1, 1])
    b = np.array([0, 0, 0, 1, 1, 1, 1, 1])  # the same pixel wrong, as a class of the truth
    per_a, miou_a = iou_from_confusion(confusion_matrix(a, gt, 3))
    per_b, miou_b = iou_from_confusion(confusion_matrix(b, gt, 3))
    assert per_a.tolist() == [0.75, 1.0, 0.0] and miou_a == pytest.approx((0.75 + 1.0) / 2)
    assert np.isnan(per_b[2]) and miou_b == pytest.approx((0.75 + 0.8) / 2)
    # both are averaged over the truth's classes 0 and 1, whatever each predicts (a's stray pixel
    # counts as an error of class 0); before, a was averaged over three classes and b over two
    from wsseg.tasks.common.metrics import chance_iou_from_confusion
    per_chance, chance = chance_iou_from_confusion(confusion_matrix(a, gt, 3))
    assert per_chance[2] == 0.0 and chance == pytest.approx(np.mean(per_chance[:2]))
    acc = ConfusionAccumulator(3)
    acc.update(a, gt)
    assert acc.miou == pytest.approx(miou_a)
