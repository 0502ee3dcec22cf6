"""ResNet50 and MobileNetV2 encoders with torchvision-compatible state_dict keys.

Both networks are written after torchvision's ``models/resnet.py`` and
``models/mobilenetv2.py``: blocks, then the network, then keyword-only builders.
Attribute names are the checkpoint format, so a torchvision ImageNet checkpoint
(``resnet50-*.pth``, ``mobilenet_v2-*.pth``) loads with ``load_state_dict``
unchanged, or with :func:`load_backbone_weights` when the stem takes extra input
channels or the classifier head is removed. Both take state dicts: the files are read by the
store (:func:`tasks.store.checkpoints.backbone_weights`), never here.

Encoder contract (segmentation_models_pytorch / timm ``feature_info`` style):
``forward_features(x)`` returns five feature maps at strides 2, 4, 8, 16, 32
and ``out_channels`` gives their channel counts, so a decoder can be built from
``encoder.out_channels`` alone.

Spatial size rule: every stride-2 layer (7x7/3x3 convolutions with padding
``k // 2``, the 3x3 max-pool with padding 1 and the 1x1 stride-2 shortcut)
maps a side of length ``n`` to ``ceil(n / 2)``.  The feature map at stride
``2**i`` therefore has side ``ceil(n / 2**i)`` (applied level by level, which
is the same number), e.g. an input of 97 x 130 gives 49 x 65, 25 x 33, 13 x 17,
7 x 9 and 4 x 5.  Any input size >= 1 works.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor, nn

__all__ = [
    "Bottleneck",
    "ResNet",
    "resnet50",
    "Conv2dNormActivation",
    "InvertedResidual",
    "MobileNetV2",
    "mobilenet_v2",
    "load_backbone_weights",
    "unwrap_state_dict",
]

NormLayer = Callable[[int], nn.Module]


# ----------------------------------------------------------------------------
# ResNet (torchvision v1.5: the stride sits on the 3x3 convolution)
# ----------------------------------------------------------------------------


def conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    """3x3 convolution with padding 1, no bias (followed by a norm layer)."""
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


def conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    """1x1 convolution, no bias (followed by a norm layer)."""
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class Bottleneck(nn.Module):
    """ResNet bottleneck block: 1x1 reduce, 3x3 (strided), 1x1 expand by 4.

    Parameters
    ----------
    inplanes : int
        Input channels.
    planes : int
        Bottleneck width; the block outputs ``planes * 4`` channels.
    stride : int
        Stride of the 3x3 convolution (torchvision v1.5 placement).
    downsample : nn.Module or None
        Shortcut projection (``conv1x1`` + norm) when shape changes.
    norm_layer : callable
        ``norm_layer(num_channels) -> nn.Module``.
    """

    expansion: int = 4

    def __init__(
        self,
        inplanes: int,
        planes: int,
        stride: int = 1,
        downsample: nn.Module | None = None,
        norm_layer: NormLayer | None = None,
    ) -> None:
        super().__init__()
        if norm_layer is None:
            norm_layer = nn.BatchNorm2d
        self.conv1 = conv1x1(inplanes, planes)
        self.bn1 = norm_layer(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn2 = norm_layer(planes)
        self.conv3 = conv1x1(planes, planes * self.expansion)
        self.bn3 = norm_layer(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """ResNet with torchvision module names and a five-level feature path.

    Parameters
    ----------
    block : type
        Residual block class (:class:`Bottleneck`).
    layers : sequence of 4 int
        Blocks per stage, e.g. ``[3, 4, 6, 3]`` for ResNet50.
    num_classes : int
        Size of the ``fc`` head; ``0`` replaces the head by ``nn.Identity``
        (no head parameters, ``forward`` returns pooled features).
    norm_layer : callable or None
        ``norm_layer(num_channels)``; ``None`` means ``nn.BatchNorm2d``.
    in_channels : int
        Input channels of ``conv1`` (3 for RGB, 4 for RGB + edge map).
    base_channels : int
        Stem width; stage ``i`` has bottleneck width ``base_channels * 2**i``.
        64 is the torchvision network; smaller values give a thin network for CPU.
    zero_init_residual : bool
        Zero the last norm of each block (torchvision option).

    Attributes
    ----------
    out_channels : tuple of 5 int
        Channels of the feature maps at strides 2, 4, 8, 16, 32
        (``(64, 256, 512, 1024, 2048)`` for ResNet50).
    """

    stem_conv: str = "conv1"
    head_prefixes: tuple[str, ...] = ("fc.",)

    def __init__(
        self,
        block: type[Bottleneck],
        layers: Sequence[int],
        num_classes: int = 1000,
        norm_layer: NormLayer | None = None,
        in_channels: int = 3,
        base_channels: int = 64,
        zero_init_residual: bool = False,
    ) -> None:
        super().__init__()
        if len(layers) != 4:
            raise ValueError(f"layers must list 4 stage depths, e.g. [3, 4, 6, 3]; got {list(layers)}")
        if norm_layer is None:
            norm_layer = nn.BatchNorm2d
        self._norm_layer = norm_layer
        self.inplanes = base_channels

        self.conv1 = nn.Conv2d(in_channels, self.inplanes, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = norm_layer(self.inplanes)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, base_channels, layers[0])
        self.layer2 = self._make_layer(block, base_channels * 2, layers[1], stride=2)
        self.layer3 = self._make_layer(block, base_channels * 4, layers[2], stride=2)
        self.layer4 = self._make_layer(block, base_channels * 8, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        last = base_channels * 8 * block.expansion
        self.fc = nn.Linear(last, num_classes) if num_classes > 0 else nn.Identity()

        self.out_channels: tuple[int, ...] = (base_channels,) + tuple(
            base_channels * 2**i * block.expansion for i in range(4)
        )

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, Bottleneck) and m.bn3.weight is not None:
                    nn.init.constant_(m.bn3.weight, 0)

    def _make_layer(self, block: type[Bottleneck], planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        norm_layer = self._norm_layer
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                conv1x1(self.inplanes, planes * block.expansion, stride),
                norm_layer(planes * block.expansion),
            )
        layers = [block(self.inplanes, planes, stride, downsample, norm_layer)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes, norm_layer=norm_layer) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward_features(self, x: Tensor) -> list[Tensor]:
        """Feature maps at strides 2, 4, 8, 16, 32.

        Parameters
        ----------
        x : (B, in_channels, H, W) float tensor

        Returns
        -------
        list of 5 tensors
            ``(B, out_channels[i], ceil(H / 2**(i+1)), ceil(W / 2**(i+1)))``;
            level 0 is ``relu(bn1(conv1(x)))``, levels 1-4 are ``layer1``-``layer4``.
        """
        c1 = self.relu(self.bn1(self.conv1(x)))
        c2 = self.layer1(self.maxpool(c1))
        c3 = self.layer2(c2)
        c4 = self.layer3(c3)
        c5 = self.layer4(c4)
        return [c1, c2, c3, c4, c5]

    def forward(self, x: Tensor) -> Tensor:
        """Image classification: ``(B, C, H, W) -> (B, num_classes)`` logits."""
        x = self.forward_features(x)[-1]
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


def resnet50(
    *,
    num_classes: int = 1000,
    norm_layer: NormLayer | None = None,
    in_channels: int = 3,
    base_channels: int = 64,
) -> ResNet:
    """ResNet50 (torchvision v1.5 layout): 25,557,032 parameters with the 1000-class head.

    ``load_state_dict`` of a torchvision ImageNet checkpoint works unchanged
    when ``in_channels=3`` and ``base_channels=64``; see
    :func:`load_backbone_weights` for other input channel counts.
    ``base_channels`` < 64 gives a thin network (no pretrained weights).
    """
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes=num_classes, norm_layer=norm_layer,
                  in_channels=in_channels, base_channels=base_channels)


# ----------------------------------------------------------------------------
# MobileNetV2
# ----------------------------------------------------------------------------


def _make_divisible(v: float, divisor: int = 8, min_value: int | None = None) -> int:
    """Round ``v`` to a multiple of ``divisor`` without going below 90 % of it (torchvision)."""
    if min_value is None:
        min_value = divisor
    new_v = max(min_value, int(v + divisor / 2) // divisor * divisor)
    if new_v < 0.9 * v:
        new_v += divisor
    return new_v


class Conv2dNormActivation(nn.Sequential):
    """``Sequential(conv, norm, activation)``; keys ``.0.weight``, ``.1.*`` as in torchvision."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int = 3,
        stride: int = 1,
        groups: int = 1,
        norm_layer: NormLayer | None = None,
        activation_layer: Callable[..., nn.Module] | None = nn.ReLU6,
    ) -> None:
        if norm_layer is None:
            norm_layer = nn.BatchNorm2d
        layers: list[nn.Module] = [
            nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding=(kernel_size - 1) // 2,
                      groups=groups, bias=False),
            norm_layer(out_channels),
        ]
        if activation_layer is not None:
            layers.append(activation_layer(inplace=True))
        super().__init__(*layers)
        self.out_channels = out_channels


class InvertedResidual(nn.Module):
    """MobileNetV2 block: 1x1 expand (if t != 1), 3x3 depthwise (strided), 1x1 linear project.

    ``self.conv`` is laid out as torchvision's: with expansion
    ``[Conv2dNormActivation (1x1), Conv2dNormActivation (dw 3x3), Conv2d, norm]``
    (keys ``conv.0.0``, ``conv.1.0``, ``conv.2``, ``conv.3``), without it
    ``[Conv2dNormActivation (dw 3x3), Conv2d, norm]``.
    """

    def __init__(self, inp: int, oup: int, stride: int, expand_ratio: int,
                 norm_layer: NormLayer | None = None) -> None:
        super().__init__()
        if stride not in (1, 2):
            raise ValueError(f"stride must be 1 or 2, got {stride}")
        if norm_layer is None:
            norm_layer = nn.BatchNorm2d
        self.stride = stride
        hidden_dim = int(round(inp * expand_ratio))
        self.use_res_connect = stride == 1 and inp == oup
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers.append(Conv2dNormActivation(inp, hidden_dim, kernel_size=1, norm_layer=norm_layer))
        layers += [
            Conv2dNormActivation(hidden_dim, hidden_dim, stride=stride, groups=hidden_dim, norm_layer=norm_layer),
            nn.Conv2d(hidden_dim, oup, 1, 1, 0, bias=False),
            norm_layer(oup),
        ]
        self.conv = nn.Sequential(*layers)
        self.out_channels = oup

    def forward(self, x: Tensor) -> Tensor:
        if self.use_res_connect:
            return x + self.conv(x)
        return self.conv(x)


# Inverted residual table: expansion t, output channels c, repeats n, first stride s.
MOBILENET_V2_SETTING: tuple[tuple[int, int, int, int], ...] = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)


class MobileNetV2(nn.Module):
    """MobileNetV2 with torchvision module names and a five-level feature path.

    Parameters
    ----------
    num_classes : int
        Size of the head ``classifier.1``; ``0`` replaces the classifier by
        ``nn.Identity`` (no head parameters).
    width_mult : float
        Channel multiplier (channels rounded to multiples of 8; the last 1x1
        convolution keeps 1280 channels for ``width_mult <= 1``, as torchvision).
    inverted_residual_setting : sequence of (t, c, n, s) or None
        Block table; ``None`` means :data:`MOBILENET_V2_SETTING`.
    norm_layer : callable or None
        ``norm_layer(num_channels)``; ``None`` means ``nn.BatchNorm2d``.
    in_channels : int
        Input channels of ``features.0.0``.
    dropout : float
        Dropout before the classifier's linear layer.

    Attributes
    ----------
    out_channels : tuple of 5 int
        Channels of the taps at strides 2, 4, 8, 16, 32. The taps are the
        outputs of ``features.1`` (16 @ 2), ``features.3`` (24 @ 4), ``features.6``
        (32 @ 8), ``features.13`` (96 @ 16) and ``features.18`` (the final 1x1
        convolution, 1280 @ 32), i.e. the last block at each stride as in
        segmentation_models_pytorch's MobileNetV2 encoder:
        ``(16, 24, 32, 96, 1280)`` at ``width_mult=1``.
    """

    stem_conv: str = "features.0.0"
    head_prefixes: tuple[str, ...] = ("classifier.",)

    def __init__(
        self,
        num_classes: int = 1000,
        width_mult: float = 1.0,
        inverted_residual_setting: Sequence[Sequence[int]] | None = None,
        round_nearest: int = 8,
        norm_layer: NormLayer | None = None,
        in_channels: int = 3,
        dropout: float = 0.2,
    ) -> None:
        super().__init__()
        if width_mult <= 0:
            raise ValueError(f"width_mult must be > 0, got {width_mult}")
        if inverted_residual_setting is None:
            inverted_residual_setting = MOBILENET_V2_SETTING
        if any(len(row) != 4 for row in inverted_residual_setting):
            raise ValueError("inverted_residual_setting rows must be (t, c, n, s)")
        if norm_layer is None:
            norm_layer = nn.BatchNorm2d

        input_channel = _make_divisible(32 * width_mult, round_nearest)
        self.last_channel = _make_divisible(1280 * max(1.0, width_mult), round_nearest)
        features: list[nn.Module] = [
            Conv2dNormActivation(in_channels, input_channel, stride=2, norm_layer=norm_layer)
        ]
        # Record, per block, its output channels and cumulative stride: the tap
        # of each stride level is the last module that runs at that stride.
        channels, strides = [input_channel], [2]
        for t, c, n, s in inverted_residual_setting:
            output_channel = _make_divisible(c * width_mult, round_nearest)
            for i in range(n):
                stride = s if i == 0 else 1
                features.append(InvertedResidual(input_channel, output_channel, stride, t, norm_layer))
                input_channel = output_channel
                channels.append(output_channel)
                strides.append(strides[-1] * stride)
        features.append(Conv2dNormActivation(input_channel, self.last_channel, kernel_size=1,
                                             norm_layer=norm_layer))
        channels.append(self.last_channel)
        strides.append(strides[-1])
        self.features = nn.Sequential(*features)
        self.classifier = (
            nn.Sequential(nn.Dropout(p=dropout), nn.Linear(self.last_channel, num_classes))
            if num_classes > 0 else nn.Identity()
        )

        levels = (2, 4, 8, 16, 32)
        if strides[-1] != 32 or any(s not in strides for s in levels):
            raise ValueError(f"the block table must reach strides {levels} by stride-2 steps; got {sorted(set(strides))}")
        self._tap_indices: tuple[int, ...] = tuple(max(i for i, s in enumerate(strides) if s == lv) for lv in levels)
        self.out_channels: tuple[int, ...] = tuple(channels[i] for i in self._tap_indices)

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward_features(self, x: Tensor) -> list[Tensor]:
        """Feature maps at strides 2, 4, 8, 16, 32.

        Parameters
        ----------
        x : (B, in_channels, H, W) float tensor

        Returns
        -------
        list of 5 tensors
            ``(B, out_channels[i], ceil(H / 2**(i+1)), ceil(W / 2**(i+1)))``.
        """
        feats = []
        taps = set(self._tap_indices)
        for i, module in enumerate(self.features):
            x = module(x)
            if i in taps:
                feats.append(x)
        return feats

    def forward(self, x: Tensor) -> Tensor:
        """Image classification: ``(B, C, H, W) -> (B, num_classes)`` logits."""
        x = self.forward_features(x)[-1]
        x = torch.flatten(nn.functional.adaptive_avg_pool2d(x, (1, 1)), 1)
        return self.classifier(x)


def mobilenet_v2(
    *,
    num_classes: int = 1000,
    width_mult: float = 1.0,
    norm_layer: NormLayer | None = None,
    in_channels: int = 3,
) -> MobileNetV2:
    """MobileNetV2: 3,504,872 parameters with the 1000-class head at ``width_mult=1``.

    ``load_state_dict`` of a torchvision ImageNet checkpoint works unchanged
    when ``in_channels=3`` and ``width_mult=1``.
    """
    return MobileNetV2(num_classes=num_classes, width_mult=width_mult, norm_layer=norm_layer,
                       in_channels=in_channels)


# ----------------------------------------------------------------------------
# Checkpoint loading
# ----------------------------------------------------------------------------


def unwrap_state_dict(obj: object, source: str) -> dict[str, Tensor]:
    """Accept a plain state_dict, or one under 'state_dict'/'model', with optional 'module.' prefix
    (the forms torchvision and DataParallel files take); ``source`` names it in the error."""
    if isinstance(obj, Mapping) and len(obj) == 1 and next(iter(obj)) in ("state_dict", "model"):
        obj = next(iter(obj.values()))
    if not isinstance(obj, Mapping) or not all(isinstance(v, Tensor) for v in obj.values()):
        raise ValueError(f"{source}: expected a state_dict (a mapping of parameter names to tensors), "
                         f"got {type(obj).__name__}; save checkpoints with torch.save(model.state_dict(), path)")
    sd = dict(obj)
    if sd and all(k.startswith("module.") for k in sd):
        sd = {k[len("module."):]: v for k, v in sd.items()}
    return sd


def _first(keys: Sequence[str], n: int = 5) -> str:
    shown = ", ".join(repr(k) for k in keys[:n])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > n else "")


def load_backbone_weights(
    model: nn.Module,
    state: Mapping[str, Tensor],
    *,
    drop_head: bool = False,
    source: str = "state_dict",
) -> nn.Module:
    """Load a torchvision-format state dict into ``model``, adapting the stem.

    Parameters
    ----------
    model : ResNet or MobileNetV2 (any nn.Module works)
        Loaded in place. ``model.stem_conv`` names the first convolution and
        ``model.head_prefixes`` the classifier head (both set on the two
        backbones here).
    state : mapping of str to Tensor
        The content of a file written by ``torch.save(state_dict)``, read by
        the caller (:func:`tasks.store.checkpoints.backbone_weights`: models
        read no files). A dict holding only ``'state_dict'`` or ``'model'``
        is unwrapped and a ``'module.'`` prefix on every key is stripped.
    drop_head : bool
        If True, classifier head keys (``fc.*`` / ``classifier.*``) of the
        checkpoint that the model lacks or that have another shape are dropped,
        and head keys missing from the checkpoint keep their initialisation.
        Use it for models built with another ``num_classes`` (or 0).
    source : str
        Where ``state`` came from (its file), named in the errors.

    Returns
    -------
    model : nn.Module
        The same object, for chaining.

    Notes
    -----
    When the model's first convolution has ``C > 3`` input channels and the
    checkpoint's has 3, the RGB filters are copied to channels 0-2 and every
    extra channel gets their mean over the input-channel axis. Missing
    ``num_batches_tracked`` buffers (old torchvision checkpoints) keep the
    model's value.

    Raises
    ------
    ValueError
        If ``state`` is not a state_dict or its keys/shapes do not match the
        model; the message names ``source`` and the first few missing,
        unexpected and mis-shaped keys.

    Examples
    --------
    >>> src = resnet50(num_classes=1000)
    >>> net = resnet50(in_channels=4, num_classes=0)
    >>> load_backbone_weights(net, src.state_dict(), drop_head=True) is net
    True
    """
    ckpt = unwrap_state_dict(state, source)
    own = model.state_dict()
    head_prefixes = tuple(getattr(model, "head_prefixes", ()))
    stem_key = getattr(model, "stem_conv", None)
    stem_key = f"{stem_key}.weight" if stem_key else None

    def is_head(k: str) -> bool:
        return any(k.startswith(p) for p in head_prefixes)

    new_sd: dict[str, Tensor] = {}
    unexpected, misshaped = [], []
    for k, v in ckpt.items():
        if k not in own:
            if not (drop_head and is_head(k)):
                unexpected.append(k)
            continue
        target = own[k]
        if v.shape == target.shape:
            new_sd[k] = v
        elif (k == stem_key and v.ndim == 4 and v.shape[1] == 3 and target.shape[1] > 3
              and v.shape[0] == target.shape[0] and v.shape[2:] == target.shape[2:]):
            extra = v.mean(dim=1, keepdim=True).expand(-1, target.shape[1] - 3, -1, -1)
            new_sd[k] = torch.cat([v, extra], dim=1).to(target.dtype)
        elif drop_head and is_head(k):
            continue
        else:
            misshaped.append(f"{k}: file {tuple(v.shape)} vs model {tuple(target.shape)}")
    missing = []
    for k, v in own.items():
        if k in new_sd:
            continue
        if k.endswith("num_batches_tracked") or (drop_head and is_head(k)):
            new_sd[k] = v
        else:
            missing.append(k)

    if missing or unexpected or misshaped:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing keys ({_first(missing)})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected keys ({_first(unexpected)})")
        if misshaped:
            parts.append(f"{len(misshaped)} mis-shaped keys ({_first(misshaped, 3)})")
        raise ValueError(
            f"checkpoint {source!r} does not match {type(model).__name__}: " + "; ".join(parts)
            + ". Pass a torchvision state_dict of the same architecture at full width "
            "(resnet50 base_channels=64, mobilenet_v2 width_mult=1.0)"
            + ("" if drop_head else ", or drop_head=True to ignore the classifier head") + "."
        )
    model.load_state_dict(new_sd, strict=True)
    return model
