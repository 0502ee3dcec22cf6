"""The image classifier and the segmentation network of method A on an ImageNet-pretrained
EfficientNet-Lite encoder (:mod:`models.efficientnet_lite`): the default since issue 31, with
:mod:`models.small`'s networks kept as the from-scratch option (``encoder: small``).

Both take the inputs every wsseg network takes (:func:`tasks.common.training.to_input`: RGB scaled by
ImageNet's mean and std, plus the edge channel for the segmenter) and turn the RGB channels into
the Lite weights' own scale, ``(x - 127) / 128``, inside the network (:class:`LiteInput`), so
the data path is one for every network.

``weights`` is the encoder's ImageNet state dict (read by the caller:
:func:`tasks.store.checkpoints.build_network` turns the option ``pretrained`` into it) or None, a
random start; the early blocks are frozen exactly when it is given (:func:`freeze_early`).
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from wsseg.models.efficientnet_lite import EfficientNetLite, efficientnet_lite
from wsseg.models.small import conv_bn_relu

#: ImageNet mean and std of :func:`tasks.common.training.to_input` (repeated here: models do not import tasks)
_MEAN, _STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)

#: learning-rate factor of the pretrained encoder against the new layers (its features are kept
#: close to ImageNet's while the head and decoder learn from scratch)
ENCODER_LR = 0.1


class LiteInput(nn.Module):
    """Mean/std-normalised RGB -> ``(rgb * 255 - 127) / 128`` per channel; extra channels (the edge
    map) pass unchanged. A fixed affine map, not learned, not in the state dict."""

    def __init__(self):
        super().__init__()
        std, mean = torch.tensor(_STD), torch.tensor(_MEAN)
        self.register_buffer("scale", (std * 255 / 128).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("shift", ((mean * 255 - 127) / 128).view(1, 3, 1, 1), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        rgb = x[:, :3] * self.scale + self.shift
        return torch.cat([rgb, x[:, 3:]], 1) if x.shape[1] > 3 else rgb


#: blocks of the encoder (after the stem) kept at their ImageNet weights: the stride-2 to stride-8
#: stages (generic edges and textures), whose backward pass at full resolution is most of a
#: training step's cost on a CPU (lite0 classifier at 224 px, 2 cores: 293 -> 126 ms per image)
FROZEN_BLOCKS = 5


def freeze_early(encoder: EfficientNetLite, blocks: int) -> None:
    """Keep the stem and the first ``blocks`` blocks fixed: no gradients, batch norm statistics
    kept (those modules stay in eval mode, see :func:`keep_frozen_eval`). The stem of a 4th (edge)
    input channel stays trainable, or that channel could never learn a use."""
    if blocks <= 0:
        return
    encoder._frozen = blocks
    if encoder._conv_stem.in_channels == 3:
        for p in list(encoder._conv_stem.parameters()) + list(encoder._bn0.parameters()):
            p.requires_grad_(False)
    for blk in encoder._blocks[:blocks]:
        for p in blk.parameters():
            p.requires_grad_(False)


def keep_frozen_eval(encoder: EfficientNetLite) -> None:
    """After ``.train()``: the frozen blocks' batch norms back in eval mode (their ImageNet statistics)."""
    for blk in encoder._blocks[:getattr(encoder, "_frozen", 0)]:
        blk.eval()
    if encoder._conv_stem.in_channels == 3 and getattr(encoder, "_frozen", 0):
        encoder._bn0.eval()


def _groups(encoder: nn.Module, rest: list[nn.Module], lr: float) -> list[dict]:
    return [{"params": [p for p in encoder.parameters() if p.requires_grad], "lr": lr * ENCODER_LR},
            {"params": [p for m in rest for p in m.parameters()], "lr": lr}]


class _LiteNet(nn.Module):
    def train(self, mode: bool = True):
        super().train(mode)
        if mode:
            keep_frozen_eval(self.encoder)
        return self


class LiteClassifier(_LiteNet):
    """Multi-label image classifier: the Lite encoder (ImageNet start) and a 1x1 class map on its
    last feature (stride 16 or 8 by dilation), the class activation map; ``forward`` is the class
    map's global average (B, K), ``cam`` the map itself (B, K, H/s, W/s)."""

    def __init__(self, num_classes: int, in_channels: int = 3, variant: str = "lite0", stride: int = 16,
                 weights: Mapping[str, Tensor] | None = None):
        super().__init__()
        if stride not in (8, 16, 32):
            raise ValueError(f"stride must be 8, 16 or 32, got {stride}")
        self.input = LiteInput()
        self.encoder = efficientnet_lite(variant, in_channels=in_channels, output_stride=stride, weights=weights)
        freeze_early(self.encoder, FROZEN_BLOCKS if weights is not None else 0)
        self.dropout = nn.Dropout2d(0.2)
        self.classifier = nn.Conv2d(self.encoder.out_channels[-1], num_classes, 1)

    def features(self, x: Tensor) -> Tensor:
        """The last stage's map (320 channels for lite0). ImageNet's own 1280-channel head map on
        top of it names classes better but localises worse: on msrc21 train (8 epochs) the CAM was
        0.589 mIoU from this map, 0.437 from the head's."""
        return self.encoder.forward_features(self.input(x))[-1]

    def cam(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))

    def cam_and_maps(self, x: Tensor, levels: tuple[int, ...]) -> tuple[Tensor, list[Tensor]]:
        """The class map and, from the same pass, the encoder's maps at ``levels`` (indices of
        ``forward_features``: 2 = stride 8, 3 = stride 16), e.g. for superpixel features."""
        maps = self.encoder.forward_features(self.input(x))
        return self.classifier(maps[-1]), [maps[i] for i in levels]

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.dropout(self.features(x))).mean(dim=(2, 3))

    def param_groups(self, lr: float) -> list[dict]:
        """Optimiser groups: the encoder at ``lr * ENCODER_LR``, the class map at ``lr``."""
        return _groups(self.encoder, [self.classifier], lr)


class LiteSegNet(_LiteNet):
    """Lite encoder + a light DeepLabV3+-style decoder: the stride-16 context (last feature and the
    stride-16 stage, with an image-pooling branch) fused with the stride-4 features, logits
    upsampled to the input size.

    A 4th (edge) input channel enters the decoder beside the stride-4 features (averaged to that
    resolution), not the encoder's stem: the stem and first blocks stay at their ImageNet weights
    (:data:`FROZEN_BLOCKS`), and an edge channel in the stem would need the backward pass through
    them that freezing saves (on 2 CPU cores most of a step's cost)."""

    def __init__(self, num_classes: int, in_channels: int = 4, variant: str = "lite0", output_stride: int = 16,
                 decoder: int = 96, weights: Mapping[str, Tensor] | None = None):
        super().__init__()
        if in_channels not in (3, 4):
            raise ValueError(f"in_channels must be 3 (RGB) or 4 (RGB + edge map), got {in_channels}")
        self.input = LiteInput()
        self.extra = in_channels - 3
        self.encoder = efficientnet_lite(variant, in_channels=3, output_stride=output_stride, weights=weights)
        freeze_early(self.encoder, FROZEN_BLOCKS if weights is not None else 0)
        _, c2, _, c4, c5 = self.encoder.out_channels
        d = decoder
        self.context = nn.Sequential(nn.Conv2d(c5 + c4, d, 1, bias=False), nn.BatchNorm2d(d), nn.ReLU(inplace=True))
        self.pool = nn.Sequential(nn.Conv2d(c5, d, 1, bias=False), nn.ReLU(inplace=True))
        self.project = nn.Sequential(nn.Conv2d(2 * d, d, 1, bias=False), nn.BatchNorm2d(d), nn.ReLU(inplace=True),
                                     nn.Dropout2d(0.1))
        self.skip = nn.Sequential(nn.Conv2d(c2, 32, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU(inplace=True))
        self.fuse = conv_bn_relu(d + 32 + self.extra, d)
        self.classifier = nn.Conv2d(d, num_classes, 1)

    def forward(self, x: Tensor) -> Tensor:
        size = x.shape[-2:]
        x = self.input(x)
        _, f2, _, f4, f5 = self.encoder.forward_features(x[:, :3])
        if f5.shape[-2:] != f4.shape[-2:]:
            f5 = F.interpolate(f5, size=f4.shape[-2:], mode="bilinear", align_corners=False)
        y = self.context(torch.cat([f5, f4], 1))
        g = self.pool(f5.mean(dim=(2, 3), keepdim=True)).expand_as(y)
        y = self.project(torch.cat([y, g], 1))
        y = F.interpolate(y, size=f2.shape[-2:], mode="bilinear", align_corners=False)
        skip = [self.skip(f2)] + ([F.adaptive_avg_pool2d(x[:, 3:], f2.shape[-2:])] if self.extra else [])
        y = self.fuse(torch.cat([y, *skip], 1))
        return F.interpolate(self.classifier(y), size=size, mode="bilinear", align_corners=False)

    def param_groups(self, lr: float) -> list[dict]:
        """Optimiser groups: the encoder at ``lr * ENCODER_LR``, the decoder at ``lr``."""
        return _groups(self.encoder, [self.context, self.pool, self.project, self.skip, self.fuse,
                                      self.classifier], lr)


class LiteStride4(_LiteNet):
    """Method C's backbone on the Lite encoder (ImageNet start): its stride-4, 8 and 16 maps
    (24, 40 and 112 channels for lite0), each projected to ``width`` channels and summed at
    stride 4, the contract of :class:`models.global_local.CompactHRNet` (stride 4, ``width``
    channels out). The stride-32 stages are not run: a patch's context comes from the coarse
    image's branch."""

    stride = 4

    def __init__(self, in_channels: int = 3, width: int = 32, variant: str = "lite0",
                 weights: Mapping[str, Tensor] | None = None):
        super().__init__()
        if in_channels != 3:
            raise ValueError(f"the lite backbone takes RGB (in_channels 3), got {in_channels}")
        self.input = LiteInput()
        self.encoder = efficientnet_lite(variant, output_stride=16, weights=weights)
        freeze_early(self.encoder, 3 if weights is not None else 0)  # through stride 4
        self.out_channels = width
        self._last = self.encoder._level_ends[3]  # the stride-16 level's last block
        self.lateral = nn.ModuleList(nn.Sequential(nn.Conv2d(self.encoder.out_channels[i], width, 1, bias=False),
                                                   nn.BatchNorm2d(width)) for i in (1, 2, 3))
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        """(N, 3, H, W) -> (N, width, ceil(H/4), ceil(W/4))."""
        enc = self.encoder
        x = enc.act(enc._bn0(enc._conv_stem(self.input(x))))
        feats, ends = [], set(enc._level_ends[1:4])
        for i, blk in enumerate(enc._blocks[:self._last + 1]):
            x = blk(x)
            if i in ends:
                feats.append(x)
        out = self.lateral[0](feats[0])
        for lat, f in zip(self.lateral[1:], feats[1:]):
            out = out + F.interpolate(lat(f), size=out.shape[-2:], mode="bilinear", align_corners=False)
        return self.relu(out)


def lite_classifier(num_classes: int, in_channels: int = 3, *, variant: str = "lite0", stride: int = 16,
                    weights: Mapping[str, Tensor] | None = None) -> LiteClassifier:
    return LiteClassifier(num_classes, in_channels, variant, stride, weights)


def lite_segnet(num_classes: int, in_channels: int = 4, *, variant: str = "lite0", output_stride: int = 16,
                decoder: int = 96, weights: Mapping[str, Tensor] | None = None) -> LiteSegNet:
    return LiteSegNet(num_classes, in_channels, variant, output_stride, decoder, weights)


def is_lite(net: nn.Module) -> bool:
    return isinstance(getattr(net, "encoder", None), EfficientNetLite)
