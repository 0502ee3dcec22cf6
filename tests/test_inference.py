"""What a user's images are labelled with, and the pictures that show it."""
from __future__ import annotations

import numpy as np

from wsseg.tasks.report.overlay import grid, legend, palette, with_legend
from wsseg.tasks.wsss.pipeline import trained_classes_only


def test_untrained_classes_are_never_the_answer():
    prob = np.zeros((4, 2, 3), np.float32)
    prob[2] = 0.7  # a class no training image was tagged with is the most probable everywhere
    prob[0, :, :2], prob[1, :, 2:] = 0.2, 0.25
    state = {"meta": {"trained_classes": [0, 1, 3]}}
    out = trained_classes_only(prob, state)
    assert (out.argmax(0) != 2).all() and np.allclose(out.sum(0), 1, atol=1e-5)
    assert out.argmax(0).tolist() == [[0, 0, 1], [0, 0, 1]]
    assert trained_classes_only(prob, {"meta": {}}) is prob            # an older checkpoint: as it is
    assert trained_classes_only(prob, {"meta": {"trained_classes": [0, 1, 2, 3]}}) is prob


def test_legend_shows_each_class_colour_and_wraps():
    names = [f"class number {i}" for i in range(6)]
    key = legend(names, [0, 3, 5, 255], 160)
    assert key.shape[1] == 160 and key.shape[0] > 2 * 22  # four entries do not fit one 160-pixel line
    pal = palette()
    for c in (3, 5):
        assert (key == pal[c]).all(-1).sum() > 50  # the swatch of each class is drawn in its colour
    pic = np.zeros((40, 160, 3), np.uint8)
    lab = np.zeros((40, 160), np.uint8)
    lab[:, 80:] = 3
    assert with_legend(pic, names, lab).shape[0] > 40


def test_grid_rows_share_one_width_whatever_the_orientation():
    landscape = np.zeros((60, 120, 3), np.uint8)
    portrait = np.zeros((120, 60, 3), np.uint8)
    out = grid([[("a very long title that cannot fit a small panel at all", landscape)] * 3,
                [("portrait", portrait)] * 3])
    # the portrait row is scaled up to the landscape row's width instead of leaving it half empty
    left_half_dark = (out[:, : out.shape[1] // 2] < 50).all(-1).sum()
    right_half_dark = (out[:, out.shape[1] // 2:] < 50).all(-1).sum()
    assert abs(left_half_dark - right_half_dark) / max(left_half_dark, 1) < 0.1
