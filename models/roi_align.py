"""ROIAlign in plain torch (same definition as ``torchvision.ops.roi_align``).

Each output bin averages ``grid_h * grid_w`` bilinear samples taken at the centres of a
regular sub-grid of the bin.  Bilinear interpolation is separable and the sample grid of a
bin is a Cartesian product, so the average over a bin factorises into a row weight matrix
``Wy`` (R, h, H) and a column weight matrix ``Wx`` (R, w, W)::

    out[r, c] = Wy[r] @ features[batch_idx[r], c] @ Wx[r].T

which is what this module computes: two batched matrix products, no loop over boxes,
bins or samples.  The result is differentiable with respect to ``features`` (the boxes are
treated as constants, as in torchvision).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["roi_align", "RoIAlign"]


def _axis_weights(start: Tensor, size: Tensor, n_bins: int, grid: Tensor, length: int) -> Tensor:
    """Averaged bilinear weights of one axis.

    Parameters
    ----------
    start, size : (R,) float
        Start coordinate and extent of each ROI on this axis (feature-map pixels).
    n_bins : int
        Number of output bins on this axis.
    grid : (R,) int64
        Number of samples per bin on this axis (>= 1).
    length : int
        Size of the feature map on this axis.

    Returns
    -------
    weights : (R, n_bins, length) float
        ``weights[r, b, i]`` = mean over the bin's samples of the bilinear weight of pixel i.
    """
    n_rois = start.shape[0]
    g_max = int(grid.max()) if n_rois else 1
    bin_size = size / n_bins                                              # (R,)
    b = torch.arange(n_bins, dtype=start.dtype, device=start.device)      # (h,)
    s = torch.arange(g_max, dtype=start.dtype, device=start.device)       # (G,)
    gridf = grid.to(start.dtype)
    # sample coordinate: start + b * bin + (s + 0.5) * bin / grid          -> (R, h, G)
    coord = (start[:, None, None] + b[None, :, None] * bin_size[:, None, None]
             + (s[None, None, :] + 0.5) * (bin_size / gridf)[:, None, None])
    used = s[None, None, :] < gridf[:, None, None]                        # padding samples off
    inside = (coord >= -1.0) & (coord <= length)                          # torchvision's rule
    coord = coord.clamp(min=0.0)
    low = coord.floor().long()
    at_end = low >= length - 1
    low = torch.where(at_end, torch.full_like(low, length - 1), low)
    high = torch.where(at_end, low, low + 1)
    coord = torch.where(at_end, low.to(coord.dtype), coord)
    frac = coord - low.to(coord.dtype)
    keep = (used & inside).to(coord.dtype) / gridf[:, None, None]         # mean over samples
    weights = torch.zeros(n_rois, n_bins, length, dtype=start.dtype, device=start.device)
    weights.scatter_add_(2, low.reshape(n_rois, n_bins, -1), ((1.0 - frac) * keep).reshape(n_rois, n_bins, -1))
    weights.scatter_add_(2, high.reshape(n_rois, n_bins, -1), (frac * keep).reshape(n_rois, n_bins, -1))
    return weights


def roi_align(
    features: Tensor,
    boxes: Tensor,
    output_size: int | tuple[int, int],
    spatial_scale: float = 1.0,
    sampling_ratio: int = -1,
    aligned: bool = True,
) -> Tensor:
    """Cut and resample box regions of a feature map (ROIAlign).

    Parameters
    ----------
    features : (B, C, H, W) float tensor
        Feature maps.
    boxes : (R, 5) tensor
        ``[batch_idx, x1, y1, x2, y2]`` per box, in input coordinates (multiplied by
        ``spatial_scale`` to get feature-map coordinates).
    output_size : int or (h, w)
        Number of output bins.
    spatial_scale : float
        Feature-map pixels per input pixel (e.g. 1/4 for a stride-4 feature map).
    sampling_ratio : int
        Samples per bin along each axis; ``<= 0`` picks ``ceil(roi_size / bins)`` per box
        (torchvision's adaptive grid).
    aligned : bool
        If True, box coordinates are shifted by -0.5 feature pixel so that pixel centres
        line up (the correct alignment); if False, the legacy definition, with ROI sizes
        clamped to at least one pixel.

    Returns
    -------
    out : (R, C, h, w) tensor
        Same dtype and device as ``features``.

    Raises
    ------
    ValueError
        If the shapes are wrong or a batch index is out of range.

    Examples
    --------
    >>> f = torch.arange(16.0).reshape(1, 1, 4, 4)
    >>> roi_align(f, torch.tensor([[0.0, 0, 0, 4, 4]]), 4).squeeze().equal(f.squeeze())
    True
    """
    if features.ndim != 4:
        raise ValueError(f"features must be (B, C, H, W), got shape {tuple(features.shape)}")
    if boxes.ndim != 2 or boxes.shape[1] != 5:
        raise ValueError(f"boxes must be (R, 5) [batch_idx, x1, y1, x2, y2], got shape {tuple(boxes.shape)}")
    if isinstance(output_size, int):
        output_size = (output_size, output_size)
    out_h, out_w = (int(v) for v in output_size)
    if out_h < 1 or out_w < 1:
        raise ValueError(f"output_size must be positive, got {output_size}")
    n_batch, channels, height, width = features.shape
    n_rois = boxes.shape[0]
    if n_rois == 0:
        return features.new_zeros(0, channels, out_h, out_w)

    # 1. boxes in feature coordinates (constants: no gradient, as in torchvision)
    boxes = boxes.detach().to(device=features.device, dtype=features.dtype)
    batch_idx = boxes[:, 0].round().long()
    if int(batch_idx.min()) < 0 or int(batch_idx.max()) >= n_batch:
        raise ValueError(f"box batch indices must lie in [0, {n_batch - 1}], got "
                         f"[{int(batch_idx.min())}, {int(batch_idx.max())}]")
    offset = 0.5 if aligned else 0.0
    x1, y1, x2, y2 = (boxes[:, i] * spatial_scale - offset for i in range(1, 5))
    roi_w, roi_h = x2 - x1, y2 - y1
    if not aligned:
        roi_w, roi_h = roi_w.clamp(min=1.0), roi_h.clamp(min=1.0)

    # 2. samples per bin
    if sampling_ratio > 0:
        grid_h = torch.full((n_rois,), sampling_ratio, dtype=torch.long, device=features.device)
        grid_w = grid_h
    else:
        grid_h = torch.ceil(roi_h / out_h).long().clamp(min=1)
        grid_w = torch.ceil(roi_w / out_w).long().clamp(min=1)
        # torchvision: an empty (or negative) ROI gets count = max(grid, 1) and zero samples
        grid_h = torch.where(roi_h > 0, grid_h, torch.ones_like(grid_h))
        grid_w = torch.where(roi_w > 0, grid_w, torch.ones_like(grid_w))

    # 3. separable bin weights and two matrix products
    wy = _axis_weights(y1, roi_h, out_h, grid_h, height)                  # (R, h, H)
    wx = _axis_weights(x1, roi_w, out_w, grid_w, width)                   # (R, w, W)
    if sampling_ratio <= 0:
        # ceil(size / bins) of a non-positive size is <= 0 in torchvision: no samples at all
        wy = wy * (torch.ceil(roi_h / out_h) > 0).to(wy.dtype)[:, None, None]
        wx = wx * (torch.ceil(roi_w / out_w) > 0).to(wx.dtype)[:, None, None]
    picked = features[batch_idx]                                          # (R, C, H, W)
    return torch.matmul(torch.matmul(wy[:, None], picked), wx[:, None].transpose(-1, -2))


class RoIAlign(torch.nn.Module):
    """Module wrapper of :func:`roi_align` (torchvision's ``ops.RoIAlign``)."""

    def __init__(self, output_size, spatial_scale: float = 1.0, sampling_ratio: int = -1,
                 aligned: bool = True) -> None:
        super().__init__()
        self.output_size = output_size
        self.spatial_scale = spatial_scale
        self.sampling_ratio = sampling_ratio
        self.aligned = aligned

    def forward(self, features: Tensor, boxes: Tensor) -> Tensor:
        return roi_align(features, boxes, self.output_size, self.spatial_scale,
                         self.sampling_ratio, self.aligned)

    def extra_repr(self) -> str:
        return (f"output_size={self.output_size}, spatial_scale={self.spatial_scale}, "
                f"sampling_ratio={self.sampling_ratio}, aligned={self.aligned}")
