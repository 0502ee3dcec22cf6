"""Superpixel features from the image classifier's encoder (issues 31 and 54): the encoder's maps
at the chosen strides (by default 8 and 16: 48 + 120 channels for Lite2, the classifier's default
encoder, 40 + 112 for Lite0; stride 32 is an option), averaged over each superpixel, beside the
hand-made colour and texture features of :mod:`tasks.wsss.features`. The superpixel MIL and the
proposal classifier read both (the proposals pool them by area like the rest).

Where they come from: round 0's preliminary result runs the run's image classifier on every image
(its CAMs, at ``classifier.cam_scales``); the maps of that pass, the first scale's image without its
mirror, are pooled here and stored beside round 0's preliminary result
(:meth:`tasks.store.Store.write_deep`). The image is not run through an encoder a second time: until
2026-12-07 the features stage ran ImageNet's Lite2 at 1x for them (28 of its 70 core-ms an image),
and the classifier's maps, fine-tuned on the run's tags, also label better (msrc21 train round 0
0.799 -> 0.809 mIoU; docs/benchmarks.md#superpixel-features-from-the-classifier).

Why not stride 32 by default: its cells see far past their superpixel, so the water around a bird
carries the bird in its features, and classifiers trained on the CAM's targets learn to call it
bird (the CAM's co-occurrence bias, kept instead of undone). On msrc21 train the superpixel MIL
from round 0's CAMs reaches 0.722 mIoU with strides 8 and 16 against 0.657 with 8, 16 and 32
(ImageNet's encoder, 2026-12-03).
"""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn.functional as F

from wsseg.tasks.config import FeatureConfig

#: the index in ``forward_features`` of each stride that can be pooled
LEVEL_OF_STRIDE = {8: 2, 16: 3, 32: 4}
#: the strides pooled by default (:attr:`tasks.config.FeatureConfig.deep_strides`, whose default this is)
STRIDES: tuple[int, ...] = FeatureConfig.model_fields["deep_strides"].default
#: the pooling grid's step in pixels (a 16-pixel superpixel covers about 16 cells)
GRID = 4


def levels_of(strides: tuple[int, ...] = STRIDES) -> tuple[int, ...]:
    """The encoder levels (indices of ``forward_features``' maps) of ``strides``, in that order."""
    return tuple(LEVEL_OF_STRIDE[s] for s in strides)


def deep_feature_dim(encoder, strides: tuple[int, ...] = STRIDES) -> int:
    """Columns of the features pooled from ``encoder``'s maps (an EfficientNet-Lite) at ``strides``."""
    return sum(encoder.out_channels[lvl] for lvl in levels_of(strides))


def pool_superpixels(maps: list[torch.Tensor], labels: np.ndarray) -> np.ndarray:
    """(S, D) float32 mean of the (1, C, h, w) ``maps`` (concatenated in order) over each superpixel
    of ``labels`` (ids 0..S-1), whatever the maps' resolution (the image at another scale, any stride).

    The maps are resampled (bilinear) to a grid of one cell per :data:`GRID` pixels of ``labels``,
    whose cells take the superpixel at their centre; a superpixel that holds no cell centre (a
    sliver) takes the cell at its centroid."""
    h, w = labels.shape
    n = int(labels.max()) + 1
    cells = labels[GRID // 2::GRID, GRID // 2::GRID]
    gh, gw = cells.shape
    grid = torch.cat([F.interpolate(m.float(), size=(gh, gw), mode="bilinear", align_corners=False) for m in maps], 1)
    feats = grid[0].reshape(grid.shape[1], -1).T.cpu().numpy().astype(np.float64)  # (cells, D)
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


@torch.no_grad()
def classifier_superpixel_features(model: torch.nn.Module, image: np.ndarray, labels: np.ndarray,
                                   scale: float = 1.0, strides: tuple[int, ...] = STRIDES) -> np.ndarray:
    """(S, D) features of the superpixels ``labels`` of the (H, W, 3) uint8 RGB ``image`` from the
    image classifier ``model``'s encoder at ``scale``, as round 0's CAM pass gives them
    (:func:`tasks.common.training.class_activation_maps` with ``maps_levels``), in a pass of its own."""
    from wsseg.tasks.common.training import class_activation_maps

    _, maps = class_activation_maps(model, image, scales=(scale,), maps_levels=levels_of(strides))
    return pool_superpixels(maps, labels)


def stride_columns(encoder: str, strides: tuple[int, ...] = STRIDES, stride: int = 16) -> slice:
    """The columns of the superpixel features pooled at ``strides`` from an EfficientNet-Lite
    ``encoder`` (``lite0``, ``lite1``, ``lite2``) that come from ``stride``'s maps.

    >>> stride_columns("lite2"), stride_columns("lite0", (8, 16, 32), 32)
    (slice(48, 168, None), slice(152, 472, None))
    """
    from wsseg.models.efficientnet_lite import _LEVEL_STAGES, stage_table

    if stride not in strides:
        raise ValueError(f"no stride-{stride} maps among the pooled strides {tuple(strides)}")
    table = stage_table(encoder)
    widths = [table[_LEVEL_STAGES[LEVEL_OF_STRIDE[s]]][4] for s in strides]
    start = sum(widths[:list(strides).index(stride)])
    return slice(start, start + widths[list(strides).index(stride)])
