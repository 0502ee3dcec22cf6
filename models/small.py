"""A compact CNN for CPU work: an encoder shared by the image classifier (CAMs) and a
segmentation network with a light two-skip decoder."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


def conv_bn_relu(cin: int, cout: int, stride: int = 1, dilation: int = 1,
                 norm_layer: Callable[[int], nn.Module] = nn.BatchNorm2d) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride=stride, padding=dilation, dilation=dilation, bias=False),
        norm_layer(cout),
        nn.ReLU(inplace=True),
    )


class SmallEncoder(nn.Module):
    """Eight 3x3 convs in four stages; features at strides 2, 4, 8 and 8 (dilated last stage)
    or 16 (``dilate_last=False``, four times cheaper in the last stage).

    ``out_channels`` lists the channels of the returned features.
    """

    def __init__(self, in_channels: int = 3, width: int = 32, *, norm_layer=None, dilate_last: bool = True):
        super().__init__()
        norm_layer = norm_layer or nn.BatchNorm2d
        w = [width, width * 2, width * 4, width * 8]
        self.stage1 = nn.Sequential(conv_bn_relu(in_channels, w[0], 2, norm_layer=norm_layer),
                                    conv_bn_relu(w[0], w[0], norm_layer=norm_layer))
        self.stage2 = nn.Sequential(conv_bn_relu(w[0], w[1], 2, norm_layer=norm_layer),
                                    conv_bn_relu(w[1], w[1], norm_layer=norm_layer))
        self.stage3 = nn.Sequential(conv_bn_relu(w[1], w[2], 2, norm_layer=norm_layer),
                                    conv_bn_relu(w[2], w[2], norm_layer=norm_layer))
        d = 2 if dilate_last else 1
        self.stage4 = nn.Sequential(conv_bn_relu(w[2], w[3], 1 if dilate_last else 2, dilation=d, norm_layer=norm_layer),
                                    conv_bn_relu(w[3], w[3], dilation=d, norm_layer=norm_layer))
        self.out_channels = (w[0], w[1], w[2], w[3])

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        f1 = self.stage1(x)
        f2 = self.stage2(f1)
        f3 = self.stage3(f2)
        f4 = self.stage4(f3)
        return [f1, f2, f3, f4]


class ImageClassifier(nn.Module):
    """Multi-label image classifier whose 1x1 classifier map is the class activation map.

    ``forward`` returns image logits (B, K) (global average of the class map);
    ``cam`` returns the class map (B, K, H/s, W/s) before pooling (s = 8 or 16).
    """

    def __init__(self, num_classes: int, in_channels: int = 3, width: int = 32, stride: int = 16):
        super().__init__()
        if stride not in (8, 16):
            raise ValueError(f"stride must be 8 or 16, got {stride}")
        self.encoder = SmallEncoder(in_channels, width, dilate_last=stride == 8)
        self.dropout = nn.Dropout2d(0.2)
        self.classifier = nn.Conv2d(self.encoder.out_channels[-1], num_classes, 1)

    def cam(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.encoder(x)[-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.dropout(self.encoder(x)[-1])
        return self.classifier(f).mean(dim=(2, 3))


class SmallSegNet(nn.Module):
    """Encoder + decoder: stride-16 (or dilated stride-8) context fused with the stride-4
    features, logits upsampled to the input size."""

    def __init__(self, num_classes: int, in_channels: int = 4, width: int = 16, dilate_last: bool = False):
        super().__init__()
        self.encoder = SmallEncoder(in_channels, width, dilate_last=dilate_last)
        c1, c2, c3, c4 = self.encoder.out_channels
        d = max(32, width * 2)
        self.context = nn.Sequential(nn.Conv2d(c4 + c3, d, 1, bias=False), nn.BatchNorm2d(d),
                                     nn.ReLU(inplace=True), nn.Dropout2d(0.1))
        self.fuse = conv_bn_relu(d + c2, d)
        self.classifier = nn.Conv2d(d, num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = x.shape[-2:]
        _, f2, f3, f4 = self.encoder(x)
        if f4.shape[-2:] != f3.shape[-2:]:
            f4 = F.interpolate(f4, size=f3.shape[-2:], mode="bilinear", align_corners=False)
        y = self.context(torch.cat([f4, f3], 1))
        y = F.interpolate(y, size=f2.shape[-2:], mode="bilinear", align_corners=False)
        y = self.fuse(torch.cat([y, f2], 1))
        return F.interpolate(self.classifier(y), size=size, mode="bilinear", align_corners=False)


def load_encoder_from(net: nn.Module, source: nn.Module) -> int:
    """Copy ``source.encoder``'s weights (an image classifier trained on the tags) into
    ``net.encoder``; returns how many tensors were copied, 0 when ``net`` has no encoder of the
    same kind and shape (a :class:`SmallEncoder` or the same EfficientNet-Lite; another network
    keeps its own initialisation).

    The first convolution may take more input channels than the source's (the segmenter's
    4th, edge-feature channel): the RGB weights are copied and the extra channels' weights
    start at zero, so the copied encoder sees exactly what it was trained on until the edge
    channel learns a use. Dilation differs between the classifier's stride-8 and the
    segmenter's stride-16 last stage; the kernels are the same shape and transfer as they are.
    """
    from wsseg.models.efficientnet_lite import EfficientNetLite

    src, dst = getattr(source, "encoder", None), getattr(net, "encoder", None)
    kinds = (SmallEncoder, EfficientNetLite)
    if not isinstance(src, kinds) or type(src) is not type(dst):
        return 0
    want, have = dst.state_dict(), src.state_dict()
    if want.keys() != have.keys():
        return 0
    out = {}
    for k, v in have.items():
        w = want[k]
        if w.shape == v.shape:
            out[k] = v.clone()
        elif v.dim() == 4 and w.shape[0] == v.shape[0] and w.shape[2:] == v.shape[2:] and w.shape[1] > v.shape[1]:
            w = torch.zeros_like(w)
            w[:, :v.shape[1]] = v
            out[k] = w
        else:  # another width: nothing carries over
            return 0
    dst.load_state_dict(out)
    return len(out)


def small_segnet(num_classes: int, in_channels: int = 4, *, width: int = 16, dilate_last: bool = False) -> SmallSegNet:
    return SmallSegNet(num_classes, in_channels, width, dilate_last)


def image_classifier(num_classes: int, in_channels: int = 3, *, width: int = 32, stride: int = 16) -> ImageClassifier:
    return ImageClassifier(num_classes, in_channels, width, stride)
