"""Superpixel features from the ImageNet-pretrained EfficientNet-Lite encoder (issue 31): the
encoder's maps at the chosen strides (by default 8 and 16: 48 + 120 channels for Lite2, the
configuration's default encoder, 40 + 112 for Lite0; the
stride-32 map, 352 or 320 more, is an option), averaged over each superpixel, beside the hand-made colour
and texture features of :mod:`tasks.wsss.features`. The superpixel MIL and the proposal classifier
read both (the proposals pool them by area like the rest).

Why not stride 32 by default: its cells see far past their superpixel, so the water around a bird
carries the bird in its features, and classifiers trained on the CAM's targets learn to call it
bird (the CAM's co-occurrence bias, kept instead of undone). On msrc21 train the superpixel MIL
from round 0's CAMs reaches 0.722 mIoU with strides 8 and 16 against 0.657 with 8, 16 and 32.

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

from wsseg.models.efficientnet_lite import efficientnet_lite, preprocess
from wsseg.tasks.config import FeatureConfig
from wsseg.tasks.store.checkpoints import imagenet_weights

#: the index in ``forward_features`` of each stride that can be pooled
LEVEL_OF_STRIDE = {8: 2, 16: 3, 32: 4}
#: the strides pooled by default (:attr:`tasks.config.FeatureConfig.deep_strides`, whose default this is)
STRIDES: tuple[int, ...] = FeatureConfig.model_fields["deep_strides"].default
#: the pooling grid's step in pixels (a 16-pixel superpixel covers about 16 cells)
GRID = 4


@lru_cache(maxsize=2)
def _encoder(variant: str):
    return efficientnet_lite(variant, output_stride=32, weights=imagenet_weights(variant)).eval()


def deep_feature_dim(variant: str = "lite0", strides: tuple[int, ...] = STRIDES) -> int:
    return sum(_encoder(variant).out_channels[LEVEL_OF_STRIDE[s]] for s in strides)


@torch.no_grad()
def deep_superpixel_features(image: np.ndarray, labels: np.ndarray, variant: str = "lite0",
                             strides: tuple[int, ...] = STRIDES) -> np.ndarray:
    """(S, D) float32 mean encoder features of each superpixel of ``labels`` (ids 0..S-1) on the
    (H, W, 3) uint8 RGB ``image``, from the maps at ``strides`` (in that order).

    The maps are resampled (bilinear) to a grid of one cell per :data:`GRID` pixels, whose cells
    take the superpixel at their centre; a superpixel that holds no cell centre (a sliver) takes
    the cell at its centroid."""
    h, w = labels.shape
    n = int(labels.max()) + 1
    x = preprocess(torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1)[None].float())
    levels = [LEVEL_OF_STRIDE[s] for s in strides]
    maps = _encoder(variant).forward_features(x, levels=max(levels) + 1)
    cells = labels[GRID // 2::GRID, GRID // 2::GRID]
    gh, gw = cells.shape
    grid = torch.cat([F.interpolate(maps[i], size=(gh, gw), mode="bilinear", align_corners=False) for i in levels], 1)
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
