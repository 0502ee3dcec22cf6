"""Tests of tasks.wsss.superpixels: bookkeeping on a hand-made map, superpixels of a real image."""

from pathlib import Path

import cv2
import numpy as np
import pytest
from skimage.measure import label as cc_label

from wsseg.tasks.wsss.superpixels import (METHODS, adjacency, areas, counts_per_label, paint, pool,
                                    superpixels)

SAMPLE = Path(__file__).resolve().parents[1] / "flows" / "sample" / "msrc21" / "images"

# 2x2 blocks of 2x2 pixels:  0 1 / 2 3
BLOCKS = np.kron(np.array([[0, 1], [2, 3]]), np.ones((2, 2), int)).astype(np.int32)


def _sample_image():
    path = sorted(SAMPLE.glob("*.jpg"))[0]
    return cv2.cvtColor(cv2.imread(str(path)), cv2.COLOR_BGR2RGB)


def test_areas_and_adjacency_of_blocks():
    assert areas(BLOCKS).tolist() == [4, 4, 4, 4]
    assert areas(BLOCKS, n=6).tolist() == [4, 4, 4, 4, 0, 0]
    pairs, lengths = adjacency(BLOCKS, return_lengths=True)
    assert pairs.dtype == np.int32
    assert pairs.tolist() == [[0, 1], [0, 2], [1, 3], [2, 3]]  # no diagonal 0-3 / 1-2
    assert lengths.tolist() == [2, 2, 2, 2]
    assert np.array_equal(adjacency(BLOCKS), pairs)
    # uneven boundary: 0 touches 1 along 3 pixel pairs, 2 along 1
    uneven = np.array([[0, 1], [0, 1], [0, 1], [2, 2]])
    pairs, lengths = adjacency(uneven, return_lengths=True)
    assert dict(zip(map(tuple, pairs.tolist()), lengths.tolist())) == {(0, 1): 3, (0, 2): 1, (1, 2): 1}


def test_pool_layouts_and_paint_inverse():
    values = np.arange(16, dtype=np.float64).reshape(4, 4)
    # block means: 0 -> (0+1+4+5)/4, 1 -> (2+3+6+7)/4, ...
    expected = np.array([2.5, 4.5, 10.5, 12.5])
    got = pool(values, BLOCKS)
    assert got.dtype == np.float64 and np.allclose(got, expected)
    # (K, H, W) channels-first and (H, W, C) channels-last give (S, C)
    chw = np.stack([values, 2 * values, np.ones_like(values)]).astype(np.float32)
    assert pool(chw, BLOCKS).dtype == np.float32
    assert np.allclose(pool(chw, BLOCKS), np.stack([expected, 2 * expected, np.ones(4)], axis=1))
    hwc = np.moveaxis(chw, 0, -1)
    assert np.allclose(pool(hwc, BLOCKS), pool(chw, BLOCKS))
    # ambiguous layout needs channel_axis
    cube = np.random.default_rng(0).random((4, 4, 4))
    with pytest.raises(ValueError, match="channel_axis"):
        pool(cube, BLOCKS)
    assert np.allclose(pool(cube, BLOCKS, channel_axis=0)[:, 1], pool(cube[1], BLOCKS))
    # paint is the inverse of pool on per-superpixel constant maps
    per_sp = np.array([[1.0, 0.0], [0.2, 0.8], [0.5, 0.5], [0.0, 1.0]], np.float32)
    chw_map = paint(per_sp, BLOCKS)
    assert chw_map.shape == (2, 4, 4) and chw_map[1, 3, 0] == pytest.approx(0.5)
    assert np.allclose(pool(chw_map, BLOCKS), per_sp)
    assert paint(per_sp, BLOCKS, channel_axis=-1).shape == (4, 4, 2)
    assert paint(np.array([7, 8, 9, 10]), BLOCKS)[3, 3] == 10


def test_counts_per_label():
    label_map = np.array([[0, 0, 1, 1],
                          [0, 255, 1, 2],
                          [2, 2, 2, 2],
                          [255, 255, 2, 0]], np.uint8)
    counts = counts_per_label(label_map, BLOCKS, 3)
    assert counts.dtype == np.int64
    assert counts.tolist() == [[3, 0, 0], [0, 3, 1], [0, 0, 2], [1, 0, 3]]
    with pytest.raises(ValueError, match="outside"):
        counts_per_label(label_map, BLOCKS, 2)


@pytest.mark.parametrize("method", METHODS)
def test_superpixels_real_image_connected_and_contiguous(method):
    image = _sample_image()
    before = image.copy()
    labels = superpixels(image, method=method, region_size=16)
    assert np.array_equal(image, before)
    assert labels.shape == image.shape[:2] and labels.dtype == np.int32
    n = int(labels.max()) + 1
    assert np.array_equal(np.unique(labels), np.arange(n))
    # every superpixel is one 4-connected piece: as many components as labels
    assert cc_label(labels + 1, background=0, connectivity=1).max() == n
    if method == "slico":
        target = image.shape[0] * image.shape[1] / 16**2
        assert 0.5 * target <= n <= 1.5 * target


def test_superpixels_n_segments_and_errors():
    image = _sample_image()
    labels = superpixels(image, n_segments=100)
    assert 50 <= labels.max() + 1 <= 150
    with pytest.raises(ValueError, match="slico"):
        superpixels(image, method="quickshift")
    with pytest.raises(ValueError, match="uint8"):
        superpixels(image.astype(np.float32))
