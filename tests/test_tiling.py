"""Patch grid, extraction and stitching: an identity model must reproduce the image."""

import numpy as np
import pytest
import torch

from wsseg.models.tiling import RowStitcher, Stitcher, extract_patches, patch_grid, stitch

SIZES = [(64, 64), (64, 96), (70, 101), (33, 129), (20, 50), (5, 7)]


@pytest.mark.parametrize("height,width", SIZES)
@pytest.mark.parametrize("overlap", [0, 5, 16])
def test_grid_covers_image_with_full_size_patches(height, width, overlap):
    patch = 32
    boxes = patch_grid(height, width, patch, overlap=overlap)
    covered = np.zeros((height, width), dtype=int)
    for y0, x0, y1, x1 in boxes:
        assert (y1 - y0, x1 - x0) == (patch, patch)
        assert y0 >= 0 and x0 >= 0
        # inside the image along every axis at least one patch long
        if height >= patch:
            assert y1 <= height
        if width >= patch:
            assert x1 <= width
        covered[y0:y1, x0:x1] += 1
    assert (covered >= 1).all()
    # neighbours overlap by at least `overlap` (stride never exceeds patch - overlap)
    ys = sorted({b[0] for b in boxes})
    assert all(b - a <= patch - overlap for a, b in zip(ys, ys[1:]))
    # number of boxes is minimal: ceil((L - p) / stride) + 1 per axis
    def n(length):
        return 1 if length <= patch else int(np.ceil((length - patch) / (patch - overlap))) + 1
    assert len(boxes) == n(height) * n(width)


def test_grid_known_answer_and_errors():
    assert patch_grid(5, 7, 4) == [(0, 0, 4, 4), (0, 3, 4, 7), (1, 0, 5, 4), (1, 3, 5, 7)]
    assert patch_grid(8, 8, 4) == [(0, 0, 4, 4), (0, 4, 4, 8), (4, 0, 8, 4), (4, 4, 8, 8)]
    assert patch_grid(3, 9, 4, overlap=2) == [(0, 0, 4, 4), (0, 2, 4, 6), (0, 4, 4, 8), (0, 5, 4, 9)]
    with pytest.raises(ValueError, match="overlap"):
        patch_grid(10, 10, 4, overlap=4)
    with pytest.raises(ValueError, match="positive"):
        patch_grid(0, 10, 4)


@pytest.mark.parametrize("height,width", SIZES)
@pytest.mark.parametrize("overlap", [0, 7])
def test_identity_model_roundtrip_numpy(height, width, overlap):
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    boxes = patch_grid(height, width, 32, overlap=overlap)
    patches = extract_patches(image, boxes)
    assert patches.shape == (len(boxes), 32, 32, 3) and patches.dtype == np.uint8
    outputs = patches.transpose(0, 3, 1, 2).astype(np.float64)        # identity "model"
    out = stitch(outputs, boxes, height, width)
    np.testing.assert_array_equal(out, image.transpose(2, 0, 1).astype(np.float64))
    np.testing.assert_array_equal(stitch(outputs, boxes, height, width, mode="max"), out)


def test_padding_of_small_images():
    image = np.arange(12, dtype=np.uint8).reshape(3, 4)
    boxes = patch_grid(3, 4, 5)
    patches = extract_patches(image, boxes, channel_axis=None, pad_value=255)
    assert patches.shape == (1, 5, 5)
    np.testing.assert_array_equal(patches[0, :3, :4], image)
    assert (patches[0, 3:] == 255).all() and (patches[0, :, 4:] == 255).all()
    np.testing.assert_array_equal(stitch(patches[:, None], boxes, 3, 4)[0], image)


def test_torch_streaming_average_and_gradients():
    torch.manual_seed(0)
    image = torch.randn(2, 45, 70, requires_grad=True)
    boxes = patch_grid(45, 70, 16, overlap=4)
    patches = extract_patches(image, boxes, channel_axis=0)
    assert patches.shape == (len(boxes), 2, 16, 16)
    stitcher = Stitcher(45, 70)
    for i in range(0, len(boxes), 3):                                  # streamed in batches of 3
        stitcher.add(patches[i:i + 3] * 2.0, boxes[i:i + 3])
    out = stitcher.result()
    torch.testing.assert_close(out, image * 2.0)
    assert stitcher.covered().all()
    out.sum().backward()
    torch.testing.assert_close(image.grad, torch.full_like(image, 2.0))


def test_average_of_overlapping_values_known_answer():
    s = Stitcher(2, 3)
    s.add(np.ones((1, 1, 2, 2)), [(0, 0, 2, 2)])
    s.add(np.full((1, 1, 2, 2), 3.0), [(0, 1, 2, 3)])
    np.testing.assert_array_equal(s.result()[0], [[1, 2, 3], [1, 2, 3]])
    m = Stitcher(2, 3, mode="max")
    m.add(np.full((1, 1, 2, 2), 5.0), [(0, 0, 2, 2)])
    m.add(np.full((1, 1, 2, 2), 3.0), [(0, 1, 2, 3)])
    np.testing.assert_array_equal(m.result()[0], [[5, 5, 3], [5, 5, 3]])
    with pytest.raises(ValueError, match="mode"):
        Stitcher(2, 2, mode="median")
    with pytest.raises(ValueError, match="add"):
        Stitcher(2, 2).result()


@pytest.mark.parametrize("height,width,overlap", [(70, 101, 0), (70, 101, 9), (33, 40, 3), (20, 50, 0)])
def test_row_stitcher_equals_full_stitch(height, width, overlap):
    rng = np.random.default_rng(1)
    outputs_all = rng.normal(size=(len(patch_grid(height, width, 32, overlap=overlap)), 2, 32, 32))
    boxes = patch_grid(height, width, 32, overlap=overlap)
    want = stitch(outputs_all, boxes, height, width)
    rows = RowStitcher(height, width, 32)
    parts = []
    for y0 in sorted({b[0] for b in boxes}):
        part = rows.pop_until(y0)
        if part is not None:
            parts.append(part)
        idx = [i for i, b in enumerate(boxes) if b[0] == y0]
        rows.add(outputs_all[idx], [boxes[i] for i in idx])
    parts.append(rows.pop_until(height))
    got = np.concatenate(parts, axis=1)
    assert got.shape == (2, height, width)
    np.testing.assert_allclose(got, want)
    with pytest.raises(ValueError, match="row order"):
        rows.add(outputs_all[:1], [boxes[0]])
