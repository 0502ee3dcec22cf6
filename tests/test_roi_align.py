"""ROIAlign against a brute-force loop over bins and samples (torchvision's definition)."""

import math

import pytest
import torch

from wsseg.models.roi_align import RoIAlign, roi_align


def _bilinear(fmap, y, x):
    """torchvision's bilinear_interpolate for one (C, H, W) map and one point."""
    _, height, width = fmap.shape
    if y < -1.0 or y > height or x < -1.0 or x > width:
        return torch.zeros(fmap.shape[0], dtype=fmap.dtype)
    y, x = max(y, 0.0), max(x, 0.0)
    y_low, x_low = int(y), int(x)
    if y_low >= height - 1:
        y_high = y_low = height - 1
        y = float(y_low)
    else:
        y_high = y_low + 1
    if x_low >= width - 1:
        x_high = x_low = width - 1
        x = float(x_low)
    else:
        x_high = x_low + 1
    ly, lx = y - y_low, x - x_low
    hy, hx = 1.0 - ly, 1.0 - lx
    return (hy * hx * fmap[:, y_low, x_low] + hy * lx * fmap[:, y_low, x_high]
            + ly * hx * fmap[:, y_high, x_low] + ly * lx * fmap[:, y_high, x_high])


def _reference(features, boxes, out_h, out_w, scale, sampling_ratio, aligned):
    out = torch.zeros(boxes.shape[0], features.shape[1], out_h, out_w, dtype=features.dtype)
    offset = 0.5 if aligned else 0.0
    for r, (b, x1, y1, x2, y2) in enumerate(boxes.tolist()):
        fmap = features[int(b)]
        sw, sh = x1 * scale - offset, y1 * scale - offset
        rw, rh = x2 * scale - offset - sw, y2 * scale - offset - sh
        if not aligned:
            rw, rh = max(rw, 1.0), max(rh, 1.0)
        bh, bw = rh / out_h, rw / out_w
        gh = sampling_ratio if sampling_ratio > 0 else math.ceil(rh / out_h)
        gw = sampling_ratio if sampling_ratio > 0 else math.ceil(rw / out_w)
        count = max(gh * gw, 1)
        for ph in range(out_h):
            for pw in range(out_w):
                acc = torch.zeros(features.shape[1], dtype=features.dtype)
                for iy in range(gh):
                    y = sh + ph * bh + (iy + 0.5) * bh / gh
                    for ix in range(gw):
                        x = sw + pw * bw + (ix + 0.5) * bw / gw
                        acc += _bilinear(fmap, y, x)
                out[r, :, ph, pw] = acc / count
    return out


def _random_boxes(gen, n, n_batch, height, width, scale):
    """Boxes in input coordinates: some inside, some crossing the border, some tiny."""
    h_in, w_in = height / scale, width / scale
    x1 = torch.rand(n, generator=gen, dtype=torch.float64) * w_in * 1.2 - 0.1 * w_in
    y1 = torch.rand(n, generator=gen, dtype=torch.float64) * h_in * 1.2 - 0.1 * h_in
    bw = torch.rand(n, generator=gen, dtype=torch.float64) * w_in * 0.9 + 0.2
    bh = torch.rand(n, generator=gen, dtype=torch.float64) * h_in * 0.9 + 0.2
    b = torch.randint(0, n_batch, (n,), generator=gen).to(torch.float64)
    return torch.stack([b, x1, y1, x1 + bw, y1 + bh], dim=1)


@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("sampling_ratio", [-1, 1, 2, 3])
@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_matches_brute_force(aligned, sampling_ratio, scale):
    gen = torch.Generator().manual_seed(7)
    features = torch.randn(2, 3, 9, 11, generator=gen, dtype=torch.float64)
    boxes = _random_boxes(gen, 6, 2, 9, 11, scale)
    got = roi_align(features, boxes, (3, 4), scale, sampling_ratio, aligned)
    want = _reference(features, boxes, 3, 4, scale, sampling_ratio, aligned)
    assert got.shape == (6, 3, 3, 4)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_degenerate_boxes_match_reference():
    features = torch.randn(1, 2, 6, 6, dtype=torch.float64)
    boxes = torch.tensor([[0, 2.0, 2.0, 2.0, 2.0],      # empty
                          [0, 4.0, 1.0, 1.0, 5.0],      # negative width
                          [0, -9.0, -9.0, -3.0, -3.0],  # entirely outside
                          [0, 0.0, 0.0, 40.0, 3.0]],    # large: adaptive grid of 10 samples
                         dtype=torch.float64)
    for aligned in (True, False):
        for sr in (-1, 2):
            got = roi_align(features, boxes, (2, 3), 1.0, sr, aligned)
            want = _reference(features, boxes, 2, 3, 1.0, sr, aligned)
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_identity_box_reproduces_map():
    f = torch.arange(20.0).reshape(1, 1, 4, 5)
    out = roi_align(f, torch.tensor([[0.0, 0, 0, 5, 4]]), (4, 5), aligned=True)
    torch.testing.assert_close(out, f)
    # half resolution input coordinates with spatial_scale
    out = roi_align(f, torch.tensor([[0.0, 0, 0, 10, 8]]), (4, 5), spatial_scale=0.5)
    torch.testing.assert_close(out, f)


def test_gradcheck_and_module():
    gen = torch.Generator().manual_seed(3)
    features = torch.randn(2, 2, 5, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    boxes = torch.tensor([[0, 0.3, 0.7, 4.2, 3.9], [1, 1.0, 0.0, 5.5, 4.5]], dtype=torch.float64)
    for aligned in (True, False):
        assert torch.autograd.gradcheck(
            lambda f: roi_align(f, boxes, (3, 2), 1.0, -1, aligned), (features,))
    layer = RoIAlign((3, 2), spatial_scale=1.0)
    torch.testing.assert_close(layer(features, boxes), roi_align(features, boxes, (3, 2)))


def test_bad_input_raises():
    f = torch.zeros(1, 1, 4, 4)
    with pytest.raises(ValueError, match=r"\(R, 5\)"):
        roi_align(f, torch.zeros(2, 4), 2)
    with pytest.raises(ValueError, match="batch indices"):
        roi_align(f, torch.tensor([[1.0, 0, 0, 2, 2]]), 2)
    with pytest.raises(ValueError, match=r"\(B, C, H, W\)"):
        roi_align(f[0], torch.zeros(1, 5), 2)
