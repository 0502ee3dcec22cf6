"""Two-backbone multi-scale fusion network (METHOD.md section B).

A ResNet50 and a MobileNetV2 run side by side on the same input (RGB plus the
edge-feature region map as a fourth channel **[ours]**). Each gives five
feature levels at strides 2, 4, 8, 16, 32. The decoder starts from the deepest
level and works upwards::

    x = fuse_4( proj_r4(r4), proj_m4(m4) )                       stride 32
    for level i = 3, 2, 1, 0:                                    strides 16 .. 2
        x = up(x, size of level i)          bilinear, x2 (exactly ceil(n / 2**(i+1)))
        x = conv3x3-bn-relu(x)
        x = fuse_i( proj_ri(ri), proj_mi(mi), x )  concatenate, conv3x3-bn-relu
    logits = up(classifier_1x1(x), input size)

``proj_*`` are 1x1 conv-bn-relu lateral projections to the level's decoder width.
The 1x1 classifier is applied at stride 2 and its logits are upsampled to the
input's H x W: bilinear interpolation and a 1x1 convolution are both linear
per pixel (and the interpolation weights sum to one), so this equals
"upsample, then classify" exactly, at a quarter of the cost.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from wsseg.models.backbones import _make_divisible, load_backbone_weights, mobilenet_v2, resnet50

__all__ = ["ConvBNReLU", "FusionDecoder", "FusionNet", "fusion_net", "load_encoder_weights"]

NormLayer = Callable[[int], nn.Module]


class ConvBNReLU(nn.Sequential):
    """``Sequential(conv (no bias), norm, ReLU)`` with 'same' padding."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 3,
                 norm_layer: NormLayer | None = None) -> None:
        if norm_layer is None:
            norm_layer = nn.BatchNorm2d
        super().__init__(
            nn.Conv2d(in_channels, out_channels, kernel_size, padding=kernel_size // 2, bias=False),
            norm_layer(out_channels),
            nn.ReLU(inplace=True),
        )


class FusionDecoder(nn.Module):
    """Top-down decoder that fuses two encoders level by level.

    Parameters
    ----------
    channels_a, channels_b : tuple of 5 int
        ``out_channels`` of the two encoders (strides 2, 4, 8, 16, 32).
    decoder_channels : int or sequence of 5 int
        Width of the lateral projections and of the decoder path at each level
        (strides 2, 4, 8, 16, 32); an int uses the same width everywhere.
    norm_layer : callable or None
        ``norm_layer(num_channels)``; ``None`` means ``nn.BatchNorm2d``.

    Attributes
    ----------
    out_channels : int
        Width of the stride-2 output, ``decoder_channels[0]``.
    """

    def __init__(self, channels_a: tuple[int, ...], channels_b: tuple[int, ...],
                 decoder_channels: int | Sequence[int] = 64, norm_layer: NormLayer | None = None) -> None:
        super().__init__()
        if len(channels_a) != 5 or len(channels_b) != 5:
            raise ValueError(f"both encoders must expose 5 levels; got {channels_a} and {channels_b}")
        d = _level_widths(decoder_channels)
        self.lateral_a = nn.ModuleList(ConvBNReLU(c, d[i], 1, norm_layer) for i, c in enumerate(channels_a))
        self.lateral_b = nn.ModuleList(ConvBNReLU(c, d[i], 1, norm_layer) for i, c in enumerate(channels_b))
        # fuse[4] merges the two stride-32 maps; fuse[i < 4] also takes the upsampled path.
        self.fuse = nn.ModuleList(ConvBNReLU((2 if i == 4 else 3) * d[i], d[i], 3, norm_layer) for i in range(5))
        # up_conv[i] is the 3x3 convolution after upsampling from level i + 1 to level i (i = 0..3).
        self.up_conv = nn.ModuleList(ConvBNReLU(d[i + 1], d[i], 3, norm_layer) for i in range(4))
        self.out_channels = d[0]

    def forward(self, feats_a: list[Tensor], feats_b: list[Tensor]) -> Tensor:
        """``(feats_a, feats_b)`` -> ``(B, out_channels, H_2, W_2)`` at stride 2."""
        x = self.fuse[4](torch.cat([self.lateral_a[4](feats_a[4]), self.lateral_b[4](feats_b[4])], dim=1))
        for i in range(3, -1, -1):
            x = F.interpolate(x, size=feats_a[i].shape[-2:], mode="bilinear", align_corners=False)
            x = self.up_conv[i](x)
            x = self.fuse[i](torch.cat([self.lateral_a[i](feats_a[i]), self.lateral_b[i](feats_b[i]), x], dim=1))
        return x


def _level_widths(decoder_channels: int | Sequence[int]) -> tuple[int, ...]:
    """Per-level decoder widths (strides 2..32) from an int or a sequence of 5."""
    if isinstance(decoder_channels, int):
        widths = (decoder_channels,) * 5
    else:
        widths = tuple(decoder_channels)
    if len(widths) != 5 or not all(isinstance(w, int) and w >= 1 for w in widths):
        raise ValueError("decoder_channels must be an int >= 1 or 5 such ints (strides 2, 4, 8, 16, 32), "
                         f"e.g. 64 or (16, 32, 64, 64, 64); got {decoder_channels!r}")
    return widths


class FusionNet(nn.Module):
    """ResNet50 + MobileNetV2 encoders, a top-down fusion decoder, per-pixel classes.

    Parameters
    ----------
    num_classes : int
        Output classes K.
    in_channels : int
        Input channels of both encoders (4 = RGB + edge-feature map).
    width : float
        Channel scale of both encoders: ResNet stem width ``64 * width`` (rounded
        to a multiple of 8) and MobileNetV2 ``width_mult=width``. 1.0 gives the
        exact torchvision-shaped encoders (checkpoints load).
    decoder_channels : int or sequence of 5 int
        Decoder width, or one width per level (strides 2, 4, 8, 16, 32).
    norm_layer : callable or None
        Norm layer of encoders and decoder; ``None`` means ``nn.BatchNorm2d``.

    Attributes
    ----------
    encoders : nn.ModuleDict
        ``{"resnet50": ResNet, "mobilenet_v2": MobileNetV2}``, without their
        classification heads (``num_classes=0``), each with ``out_channels``.
    decoder : FusionDecoder
    classifier : nn.Conv2d
        1x1 convolution ``decoder.out_channels -> num_classes``.
    """

    def __init__(self, num_classes: int, in_channels: int = 4, *, width: float = 1.0,
                 decoder_channels: int | Sequence[int] = 64, norm_layer: NormLayer | None = None) -> None:
        super().__init__()
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        if in_channels < 1:
            raise ValueError(f"in_channels must be >= 1, got {in_channels}")
        if not 0 < width <= 4:
            raise ValueError(f"width must be in (0, 4] (1.0 = torchvision backbones), got {width}")
        _level_widths(decoder_channels)  # validate before building the encoders
        base = 64 if width == 1.0 else _make_divisible(64 * width, 8)
        self.encoders = nn.ModuleDict({
            "resnet50": resnet50(num_classes=0, norm_layer=norm_layer, in_channels=in_channels,
                                 base_channels=base),
            "mobilenet_v2": mobilenet_v2(num_classes=0, width_mult=width, norm_layer=norm_layer,
                                         in_channels=in_channels),
        })
        self.decoder = FusionDecoder(self.encoders["resnet50"].out_channels,
                                     self.encoders["mobilenet_v2"].out_channels,
                                     decoder_channels, norm_layer)
        self.classifier = nn.Conv2d(self.decoder.out_channels, num_classes, kernel_size=1)
        self.num_classes = num_classes
        self.in_channels = in_channels
        self.width = width

    def forward(self, x: Tensor) -> Tensor:
        """Per-pixel logits.

        Parameters
        ----------
        x : (B, in_channels, H, W) float tensor
            Any H, W >= 1 (odd sizes too).

        Returns
        -------
        (B, num_classes, H, W) float tensor
        """
        if x.ndim != 4 or x.shape[1] != self.in_channels:
            raise ValueError(f"expected input of shape (B, {self.in_channels}, H, W), got {tuple(x.shape)}")
        feats_r = self.encoders["resnet50"].forward_features(x)
        feats_m = self.encoders["mobilenet_v2"].forward_features(x)
        logits = self.classifier(self.decoder(feats_r, feats_m))
        return F.interpolate(logits, size=x.shape[-2:], mode="bilinear", align_corners=False)


def load_encoder_weights(net: FusionNet, weights: Mapping[str, Mapping[str, Tensor]],
                         sources: Mapping[str, str] | None = None) -> FusionNet:
    """Load torchvision ImageNet state dicts into ``net``'s encoders: ``weights`` is
    ``{"resnet50": state_dict, "mobilenet_v2": state_dict}`` (either key optional), each loaded with
    :func:`models.backbones.load_backbone_weights` (head dropped, extra input channels initialised
    as the mean of the RGB filters); ``sources`` names where each came from (its file) in errors.

    Raises
    ------
    ValueError
        For an unknown key, an encoder of another width than 1.0, or a state dict that does not
        match (the message names its source).
    """
    unknown = set(weights) - set(net.encoders)
    if unknown:
        raise ValueError(f"unknown pretrained keys {sorted(unknown)}; valid keys are {sorted(net.encoders)}")
    if net.width != 1.0:
        raise ValueError(f"pretrained weights need the torchvision-shaped encoders: pass width=1.0, not {net.width}")
    for name, state in weights.items():
        load_backbone_weights(net.encoders[name], state, drop_head=True,
                              source=(sources or {}).get(name, f"{name} weights"))
    return net


def fusion_net(
    num_classes: int,
    in_channels: int = 4,
    *,
    width: float = 1.0,
    decoder_channels: int | Sequence[int] = 64,
    weights: Mapping[str, Mapping[str, Tensor]] | None = None,
) -> FusionNet:
    """Build the two-backbone fusion network of METHOD.md B.

    Parameters
    ----------
    num_classes : int
        Output classes K; logits are ``(B, K, H, W)``.
    in_channels : int
        4 = RGB + edge-feature map.
    width : float
        Encoder channel scale; 1.0 = torchvision ResNet50 / MobileNetV2
        (required for ``weights``), 0.25 is a CPU-sized network.
    decoder_channels : int or sequence of 5 int
        Decoder width, or one width per level (strides 2, 4, 8, 16, 32);
        the stride-2 and stride-4 levels dominate the cost, so narrow them
        first for CPU training, e.g. ``(16, 32, 64, 64, 64)``.
    weights : dict or None
        ``{"resnet50": state_dict, "mobilenet_v2": state_dict}`` (either key
        optional): torchvision ImageNet state dicts, loaded with
        :func:`load_encoder_weights`. The files are read by the caller
        (:func:`tasks.store.checkpoints.build_network` reads the option
        ``pretrained``'s paths through the store).

    Raises
    ------
    ValueError
        For an unknown ``weights`` key, weights with ``width != 1.0``, or a
        state dict that does not match.

    Examples
    --------
    >>> net = fusion_net(21, width=0.25)
    >>> net(torch.zeros(1, 4, 97, 130)).shape
    torch.Size([1, 21, 97, 130])
    """
    net = FusionNet(num_classes, in_channels, width=width, decoder_channels=decoder_channels)
    if weights:
        load_encoder_weights(net, weights)
    return net
