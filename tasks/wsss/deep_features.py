"""Superpixel features from the ImageNet-pretrained EfficientNet-Lite encoder (issue 31): the
encoder's stride-8, 16 and 32 maps (40 + 112 + 320 channels for lite0), averaged over each
superpixel, beside the hand-made colour and texture features of :mod:`tasks.wsss.features`. The
superpixel MIL and the proposal classifier read both (the proposals pool them by area like the
rest).

The encoder is ImageNet's as shipped, not the run's classifier: the features are computed once per
image content in step 2, before any network of the run is trained, and cached like the others
(the feature key carries the weight file's digest).
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn.functional as F

from models.efficientnet_lite import efficientnet_lite, preprocess
from tasks.store.checkpoints import imagenet_weights

#: the encoder levels that are pooled (indices into ``forward_features``: strides 8, 16, 32)
LEVELS = (2, 3, 4)
#: the pooling grid's step in pixels (a 16-pixel superpixel covers about 16 cells)
GRID = 4


@lru_cache(maxsize=2)
def _encoder(variant: str):
    return efficientnet_lite(variant, output_stride=32, weights=imagenet_weights(variant)).eval()


def deep_feature_dim(variant: str = "lite0") -> int:
    return sum(_encoder(variant).out_channels[i] for i in LEVELS)


@torch.no_grad()
def deep_superpixel_features(image: np.ndarray, labels: np.ndarray, variant: str = "lite0") -> np.ndarray:
    """(S, D) float32 mean encoder features of each superpixel of ``labels`` (ids 0..S-1) on the
    (H, W, 3) uint8 RGB ``image``.

    The maps are resampled (bilinear) to a grid of one cell per :data:`GRID` pixels, whose cells
    take the superpixel at their centre; a superpixel that holds no cell centre (a sliver) takes
    the cell at its centroid."""
    h, w = labels.shape
    n = int(labels.max()) + 1
    x = preprocess(torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1)[None].float())
    maps = _encoder(variant).forward_features(x)
    cells = labels[GRID // 2::GRID, GRID // 2::GRID]
    gh, gw = cells.shape
    grid = torch.cat([F.interpolate(maps[i], size=(gh, gw), mode="bilinear", align_corners=False) for i in LEVELS], 1)
    feats = grid[0].reshape(grid.shape[1], -1).T.numpy().astype(np.float64)  # (cells, D)
    ids = cells.ravel()
    member = sp.csr_matrix((np.ones(len(ids)), (ids, np.arange(len(ids)))), shape=(n, len(ids)))
    counts = np.asarray(member.sum(1)).ravel()
    out = member @ feats
    empty = np.flatnonzero(counts == 0)
    if len(empty):
        ys, xs = np.indices((h, w))
        area = np.bincount(labels.ravel(), minlength=n)
        cy = np.bincount(labels.ravel(), ys.ravel(), minlength=n)[empty] / area[empty]
        cx = np.bincount(labels.ravel(), xs.ravel(), minlength=n)[empty] / area[empty]
        gy = np.clip(np.round((cy - GRID // 2) / GRID).astype(int), 0, gh - 1)
        gx = np.clip(np.round((cx - GRID // 2) / GRID).astype(int), 0, gw - 1)
        out[empty] = feats[gy * gw + gx]
        counts[empty] = 1
    return (out / counts[:, None]).astype(np.float32)
