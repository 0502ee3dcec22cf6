"""Global-local network for ultra-high-resolution segmentation (METHOD.md, section C).

A patch of the image and the *coarse image* (the whole image resized to the patch size)
go through the same backbone.  ROIAlign cuts the patch's region out of the coarse feature
map, so every patch sees its own pixels in detail (F1) and its surroundings at low
resolution (F2).  A pooling branch and a spatial-attention branch combine the two; a small
head predicts the patch's classes, and the patches are stitched back by their corners.

Shapes (``p`` = patch size, ``s`` = backbone stride = 4, ``h = w = p / s``, ``C = width``)::

    patch (N, 3, p, p) --backbone--> F1 (N, C, h, w)
    coarse (B, 3, p, p) --backbone--> G (B, C, h, w) --ROIAlign(box)--> F2 (N, C, h, w)
    A1[n, c] = mean_W(F1)[n, c] (h, 1) @ mean_H(F1)[n, c] (1, w)      -> (N, C, h, w)
    S = sigmoid(conv([conv3(M), conv7(M)])), M = [avg_c F1, max_c F1, avg_c F2, max_c F2]
    F4 = F1 * S, F5 = F2 * S
    F6 = [F1, F2, A1, A2, F4, F5] (6C) -> 1x1 reduce to C -> m x (3x3 conv-bn-relu)
    F7 = [conv1x1(F6'), conv3x3(F6')] (C) -> 1x1 classifier -> bilinear x s -> (N, K, p, p)

The pooling branch is the outer product, per channel, of the column of row means (average
pooled along W) and the row of column means (average pooled along H): the matrix product of
an (h, 1) and a (1, w) matrix.  ``use_global=False`` drops the coarse path (F2, A2, F5 and
F2's maps in the spatial branch): the "patches without global context" ablation.

Options (all off by default, which is the network above; the benchmark's ``global_local`` turns
them on, ``tasks/highres/train.py:VARIANTS``): ``coarse_head`` adds a 1x1 classifier on the coarse
feature map G, whose logits :meth:`forward_patches` returns on request (``with_coarse``) for an
auxiliary loss on the coarse image; ``coarse_residual`` (with ``coarse_head``) adds that head's
logits of each patch's region (ROIAlign of the coarse logits, at F1's size) to the patch's logits,
so that the network predicts what the whole image resized says, corrected by what the patch shows
(``coarse_detach``: without a gradient back into the coarse head); ``coarse_backbone`` gives the
coarse image a backbone of its own.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from wsseg.models.roi_align import roi_align
from wsseg.models.tiling import RowStitcher, Stitcher, extract_patches, patch_grid

__all__ = ["CompactHRNet", "GlobalLocalNet", "global_local", "segment_large", "coarse_image", "coarse_input",
           "indexed_boxes", "patch_boxes_in_coarse", "normalize"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def _conv_bn_relu(cin: int, cout: int, kernel: int = 3, stride: int = 1,
                  norm_layer: Callable[[int], nn.Module] = nn.BatchNorm2d) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, kernel, stride, kernel // 2, bias=False),
                         norm_layer(cout), nn.ReLU(inplace=True))


def _spatial_branch(n_maps: int, n_convs: int, norm_layer) -> tuple[nn.ModuleList, nn.Conv2d]:
    """The spatial branch's n convolutions (kernel sizes 3, 7, 5, 9, 11, 13, then 15, 17, ...) on
    ``n_maps`` mean/max maps, and its 3x3 output convolution to one attention map."""
    kernels = [3, 7, 5, 9, 11, 13][:n_convs] + [2 * i + 3 for i in range(6, n_convs)]
    return (nn.ModuleList(_conv_bn_relu(n_maps, 8, k, 1, norm_layer) for k in kernels),
            nn.Conv2d(8 * n_convs, 1, 3, padding=1))


class BasicBlock(nn.Module):
    """ResNet basic block (two 3x3 convolutions and an identity shortcut)."""

    def __init__(self, channels: int, norm_layer: Callable[[int], nn.Module] = nn.BatchNorm2d) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, 1, 1, bias=False)
        self.bn1 = norm_layer(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, 1, bias=False)
        self.bn2 = norm_layer(channels)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + x)


class CompactHRNet(nn.Module):
    """A small HRNet-like encoder: stride-4 output with ``width`` channels.

    Stem: two stride-2 3x3 convolutions (stride 4).  Then parallel branches at strides
    4, 8, 16, ... with ``width * 2**i`` channels, each a stack of basic blocks (``blocks[i]``
    of them); every lower-resolution branch is fed by a stride-2 convolution from the
    branch above, and is fused back into the stride-4 branch by a 1x1 convolution and
    bilinear upsampling (one HRNet exchange, high-resolution output only).

    Parameters
    ----------
    in_channels : int
        Image channels.
    width : int
        Channels of the stride-4 branch and of the output.
    blocks : sequence of int
        Basic blocks per branch; its length is the number of branches.
    """

    stride = 4

    def __init__(self, in_channels: int = 3, width: int = 32, blocks: Sequence[int] = (2, 2, 2),
                 norm_layer: Callable[[int], nn.Module] | None = None) -> None:
        super().__init__()
        norm_layer = norm_layer or nn.BatchNorm2d
        if len(blocks) < 1 or min(blocks) < 1:
            raise ValueError(f"blocks must list at least one positive block count, got {blocks}")
        self.out_channels = width
        self.stem = nn.Sequential(_conv_bn_relu(in_channels, max(width // 2, 8), 3, 2, norm_layer),
                                  _conv_bn_relu(max(width // 2, 8), width, 3, 2, norm_layer))
        chans = [width * 2 ** i for i in range(len(blocks))]
        self.down = nn.ModuleList(_conv_bn_relu(chans[i - 1], chans[i], 3, 2, norm_layer)
                                  for i in range(1, len(blocks)))
        self.branches = nn.ModuleList(nn.Sequential(*[BasicBlock(c, norm_layer) for _ in range(n)])
                                      for c, n in zip(chans, blocks))
        self.fuse = nn.ModuleList(nn.Sequential(nn.Conv2d(c, width, 1, bias=False), norm_layer(width))
                                  for c in chans[1:])
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        """(N, in_channels, H, W) -> (N, width, ceil(H/4), ceil(W/4))."""
        x = self.stem(x)
        feats = [self.branches[0](x)]
        for down, branch in zip(self.down, self.branches[1:]):
            feats.append(branch(down(feats[-1])))
        out = feats[0]
        for fuse, f in zip(self.fuse, feats[1:]):
            out = out + F.interpolate(fuse(f), size=out.shape[-2:], mode="bilinear", align_corners=False)
        return self.relu(out)


class GlobalLocalNet(nn.Module):
    """Global-local segmentation network (METHOD.md C); see the module docstring.

    Parameters
    ----------
    num_classes : int
        Output classes K.
    in_channels : int
        Image channels.
    patch_size : int
        Side p of the patches and of the coarse image (a multiple of 4).
    width : int
        Backbone output channels C.
    n_convs : int
        Convolutions (kernel sizes 3, 7, 5, 9, ...) of the spatial branch, >= 2.
    m_convs : int
        Identical 3x3 conv-bn-relu layers after the concatenation F6, >= 2.
    blocks : sequence of int
        Backbone blocks per branch (:class:`CompactHRNet`).
    use_global : bool
        False drops the coarse-image path (``patch_only``, ``downsampled``).
    overlap : int
        Overlap of the patches :meth:`forward` cuts.
    patch_batch : int
        Patches per backbone call in :meth:`forward`.
    coarse_head : bool
        Add a classifier on the coarse features (:meth:`coarse_logits`, auxiliary loss).
    coarse_residual : bool
        Add the coarse head's logits of each patch's region to the patch's logits (needs
        ``coarse_head``); the patch classifier then starts at zero (``residual_init``), so that the
        network starts as the coarse prediction and the patches learn a correction of it.
    coarse_detach : bool
        With ``coarse_residual``, the coarse logits enter the patches' without a gradient back: the
        coarse head learns the coarse image from its own loss only (its backbone also from the patch
        loss through F2), and the patch path takes that prediction as it is (as a stacked model takes
        a base model's), instead of also bending it towards whatever lowers the patch loss on the
        training images.
    coarse_backbone : bool
        The coarse image goes through a backbone of its own (same architecture, its own weights,
        as the global branch of GLNet, Chen et al. 2019) instead of the patches' backbone, so an
        auxiliary loss on the coarse image does not pull the patches' features towards what the
        coarse image can show.
    residual_init : {"zero", "random"}
        The patch classifier's start with ``coarse_residual``: zero (the network starts as the coarse
        prediction) or PyTorch's default random initialisation.
    backbone : {"hrnet", "lite0", "lite1", "lite2"}
        The patches' (and coarse images') backbone: :class:`CompactHRNet` from scratch, or an
        EfficientNet-Lite with ImageNet weights (:class:`models.lite_nets.LiteStride4`).
    weights : mapping of str to Tensor, optional
        A lite backbone's ImageNet state dict (of the ``backbone`` variant), loaded into it (and into
        the coarse backbone) with its early blocks frozen; None: a random start (a checkpoint
        rebuilt, or ``pretrained`` false in :func:`tasks.store.checkpoints.build_network`).
    """

    def __init__(self, num_classes: int, in_channels: int = 3, *, patch_size: int = 512, width: int = 32,
                 n_convs: int = 2, m_convs: int = 2, blocks: Sequence[int] = (2, 2, 2),
                 use_global: bool = True, overlap: int = 0, patch_batch: int = 4,
                 norm_layer: Callable[[int], nn.Module] | None = None, coarse_head: bool = False,
                 coarse_residual: bool = False, coarse_backbone: bool = False, residual_init: str = "zero",
                 backbone: str = "hrnet", coarse_detach: bool = False,
                 weights: Mapping[str, Tensor] | None = None) -> None:
        super().__init__()
        if backbone not in ("hrnet", "lite0", "lite1", "lite2"):
            raise ValueError(f"backbone must be hrnet, lite0, lite1 or lite2, got {backbone!r}")
        if weights is not None and backbone == "hrnet":
            raise ValueError("weights are ImageNet's for a lite backbone; the hrnet backbone starts at random")
        if coarse_residual and not (coarse_head and use_global):
            raise ValueError("coarse_residual needs coarse_head=True and use_global=True")
        if coarse_detach and not coarse_residual:
            raise ValueError("coarse_detach needs coarse_residual=True (it detaches the coarse logits added)")
        if coarse_backbone and not use_global:
            raise ValueError("coarse_backbone needs use_global=True")
        if residual_init not in ("zero", "random"):
            raise ValueError(f"residual_init must be 'zero' or 'random', got {residual_init!r}")
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        if patch_size < 8 or patch_size % 4:
            raise ValueError(f"patch_size must be a multiple of 4 (>= 8), got {patch_size}")
        if n_convs < 2 or m_convs < 2:
            raise ValueError(f"n_convs and m_convs must be >= 2 (METHOD.md C), got {n_convs}, {m_convs}")
        if not 0 <= overlap < patch_size:
            raise ValueError(f"overlap must lie in [0, patch_size), got {overlap}")
        norm_layer = norm_layer or nn.BatchNorm2d
        self.num_classes, self.in_channels, self.patch_size = num_classes, in_channels, patch_size
        self.use_global = use_global
        self.overlap, self.patch_batch = overlap, patch_batch
        self.coarse_size = patch_size  # the coarse image's side
        self.coarse_residual, self.coarse_detach = coarse_residual, bool(coarse_detach)
        c = width
        def make_backbone() -> nn.Module:
            if backbone == "hrnet":
                return CompactHRNet(in_channels, width, blocks, norm_layer)
            from wsseg.models.lite_nets import LiteStride4  # ImageNet-pretrained (issue 31)
            return LiteStride4(in_channels, width, backbone, weights)

        self.backbone = make_backbone()
        if coarse_backbone:  # the coarse image gets its own weights (GLNet's global branch)
            self.coarse_backbone = make_backbone()
        self.stride = self.backbone.stride
        n_maps = 4 if use_global else 2  # the spatial branch's mean/max maps: of F1 (and F2)
        self.spatial, self.spatial_out = _spatial_branch(n_maps, n_convs, norm_layer)
        if use_global and coarse_head:
            self.coarse_classifier = nn.Conv2d(c, num_classes, 1)
        # F6 -> reduce -> m identical conv-bn-relu -> two kernels concatenated (F7) -> classifier
        self.reduce = _conv_bn_relu((2 if use_global else 1) * 3 * c, c, 1, 1, norm_layer)
        self.convs = nn.Sequential(*[_conv_bn_relu(c, c, 3, 1, norm_layer) for _ in range(m_convs)])
        self.head1 = _conv_bn_relu(c, c // 2, 1, 1, norm_layer)
        self.head3 = _conv_bn_relu(c, c - c // 2, 3, 1, norm_layer)
        self.classifier = nn.Conv2d(c, num_classes, 1)
        if coarse_residual and residual_init == "zero":  # the patches start as the coarse prediction of their region
            nn.init.zeros_(self.classifier.weight)
            nn.init.zeros_(self.classifier.bias)

    def _branches(self, feats: list[Tensor]) -> list[Tensor]:
        """F6: each of ``feats`` (F1, F2), its pooling product (A1, A2) and its spatially attended copy
        (F4, F5), the attention computed from the mean and max maps of all of them."""
        parts = list(feats)
        parts += [self.pool_product(f) for f in feats]
        maps = torch.cat([m for f in feats for m in (f.mean(1, keepdim=True), f.amax(1, keepdim=True))], 1)
        s = torch.sigmoid(self.spatial_out(torch.cat([conv(maps) for conv in self.spatial], 1)))
        parts += [f * s for f in feats]
        return parts

    # -- building blocks -------------------------------------------------------------
    @staticmethod
    def pool_product(f: Tensor) -> Tensor:
        """Pooling branch: (N, C, h, w) -> (N, C, h, w) outer product of row and column means."""
        rows = f.mean(dim=3, keepdim=True)     # average-pooled along W: (N, C, h, 1)
        cols = f.mean(dim=2, keepdim=True)     # average-pooled along H: (N, C, 1, w)
        return torch.matmul(rows, cols)

    def coarse_features(self, coarse: Tensor) -> Tensor:
        """Backbone features of the coarse images: (B, C, p/4, p/4)."""
        return self.coarse_backbone(coarse) if hasattr(self, "coarse_backbone") else self.backbone(coarse)

    def local_global_features(self, patches: Tensor, coarse: Tensor | None = None, boxes: Tensor | None = None,
                              *, coarse_feats: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """F1 of the patches and F2 (ROIAlign of the coarse features) or None.

        Patches and coarse images go through the backbone as one batch, so that in
        training mode batch normalisation sees (and its running statistics average) one
        mixed population, the same at training and inference.  ``coarse_feats`` (the
        output of :meth:`coarse_features`) skips the coarse backbone pass at inference.
        """
        if not self.use_global:
            return self.backbone(patches), None
        f1, g = self._backbone_both(patches, coarse, coarse_feats)
        return f1, self._roi(g, boxes, f1)

    def _backbone_both(self, patches: Tensor, coarse: Tensor | None, coarse_feats: Tensor | None):
        """F1 and the coarse feature map G (one backbone batch when both have the same side)."""
        if coarse_feats is not None:
            return self.backbone(patches), coarse_feats
        coarse = coarse.to(patches.dtype)
        if coarse.shape[-1] != patches.shape[-1] or hasattr(self, "coarse_backbone"):
            return self.backbone(patches), self.coarse_features(coarse)
        both = self.backbone(torch.cat([patches, coarse]))
        return both[:patches.shape[0]], both[patches.shape[0]:]

    def _roi(self, g: Tensor, boxes: Tensor, f1: Tensor) -> Tensor:
        """F2: each box's region of G (boxes in coarse-image pixels), at F1's size."""
        scale = g.shape[-1] / self.coarse_size
        return roi_align(g, boxes.to(g.dtype), f1.shape[-2:], spatial_scale=scale, sampling_ratio=-1, aligned=True)

    def coarse_logits(self, coarse: Tensor) -> Tensor:
        """(B, K, c, c) logits of the coarse images from the coarse head (``coarse_head=True``)."""
        if not hasattr(self, "coarse_classifier"):
            raise ValueError("coarse_logits needs a model built with coarse_head=True")
        logits = self.coarse_classifier(self.coarse_features(coarse))
        return F.interpolate(logits, size=coarse.shape[-2:], mode="bilinear", align_corners=False)

    def forward_patches(self, patches: Tensor, coarse: Tensor | None = None, boxes: Tensor | None = None, *,
                        coarse_feats: Tensor | None = None, with_coarse: bool = False):
        """Segment patches with their global context.

        Parameters
        ----------
        patches : (N, C_in, p, p) float tensor
            Normalised image patches.
        coarse : (B, C_in, c, c) float tensor
            Normalised coarse images, ``c = coarse_size`` (the patch size; ignored when ``use_global`` is False).
        boxes : (N, 5) tensor
            ``[batch_idx into coarse, x1, y1, x2, y2]``: each patch's region in coarse-image
            pixel coordinates.
        coarse_feats : (B, C, c/4, c/4) tensor, optional
            ``self.coarse_features(coarse)`` computed once per image, used instead of
            ``coarse`` (inference over many patches of one image).
        with_coarse : bool
            Also return the coarse head's (B, num_classes, c, c) logits of ``coarse``
            (``coarse_head=True``; the backbone runs once on patches and coarse images).

        Returns
        -------
        logits : (N, num_classes, p, p) tensor
            (``with_coarse``: a tuple ``(logits, coarse_logits)``.)
        """
        if patches.ndim != 4:
            raise ValueError(f"patches must be (N, C, p, p), got shape {tuple(patches.shape)}")
        if self.use_global:
            if (coarse is None and coarse_feats is None) or boxes is None:
                raise ValueError("forward_patches needs coarse (or coarse_feats) and boxes when use_global=True")
            if tuple(boxes.shape) != (patches.shape[0], 5):
                raise ValueError(f"boxes must be (N={patches.shape[0]}, 5), got {tuple(boxes.shape)}")
            want = (patches.shape[1], self.coarse_size, self.coarse_size)
            if coarse is not None and tuple(coarse.shape[1:]) != want:
                raise ValueError(f"coarse images must be {want} (channels, coarse_size, coarse_size), "
                                 f"got {tuple(coarse.shape[1:])}")
        if with_coarse and (coarse is None or not hasattr(self, "coarse_classifier")):
            raise ValueError("with_coarse needs coarse images and a model built with coarse_head=True")
        coarse_logits = residual = None
        if not self.use_global:
            f1, f2 = self.backbone(patches), None
        else:
            f1, g = self._backbone_both(patches, coarse, coarse_feats)
            f2 = self._roi(g, boxes, f1)
            if with_coarse or self.coarse_residual:
                g_logits = self.coarse_classifier(g)
                if with_coarse:
                    coarse_logits = F.interpolate(g_logits, size=coarse.shape[-2:], mode="bilinear",
                                                  align_corners=False)
                if self.coarse_residual:  # each patch's region of the coarse prediction, at F1's size
                    source = g_logits.detach() if self.coarse_detach else g_logits
                    residual = roi_align(source, boxes.to(g_logits.dtype), f1.shape[-2:],
                                         spatial_scale=g.shape[-1] / self.coarse_size, sampling_ratio=-1,
                                         aligned=True)
        # fusion head
        x = self.convs(self.reduce(torch.cat(self._branches([f1] if f2 is None else [f1, f2]), 1)))
        f7 = torch.cat([self.head1(x), self.head3(x)], 1)
        out = self.classifier(f7)
        if residual is not None:
            out = out + residual
        logits = F.interpolate(out, size=patches.shape[-2:], mode="bilinear", align_corners=False)
        return logits if coarse_logits is None else (logits, coarse_logits)

    @property
    def needs_global_context(self) -> bool:
        """True when the network takes the coarse whole image beside each patch (``use_global``).

        Trainers that cut crops out of whole images (``flows.wsss.train_round_segmenter``)
        then pass each crop's coarse image and box (:func:`tasks.common.training.context_sample`)
        instead of letting :meth:`forward` treat the crop as a whole image.
        """
        return self.use_global

    def forward(self, x: Tensor, coarse: Tensor | None = None, boxes: Tensor | None = None) -> Tensor:
        """Segment whole images (cut into patches, coarse image added, stitched), or training patches.

        Parameters
        ----------
        x : (B, C_in, H, W) float tensor
            Normalised images of any size (smaller than a patch: zero-padded); or, with
            ``coarse`` and ``boxes``, (N, C_in, p, p) patches.
        coarse : (N, C_in, p, p) float tensor, optional
            The coarse image (:func:`coarse_input`) of each patch's whole image.
        boxes : (N, 4) or (N, 5) tensor, optional
            Each patch's ``[x1, y1, x2, y2]`` in its coarse image's pixels (``(N, 5)``: with
            a leading index into ``coarse``, as :meth:`forward_patches` takes).

        Returns
        -------
        logits : (B, num_classes, H, W) tensor
            Patch logits averaged where patches overlap; with ``coarse``:
            :meth:`forward_patches` of the patches, (N, num_classes, p, p).
        """
        if coarse is not None or boxes is not None:
            if coarse is None or boxes is None:
                raise ValueError("forward(x, coarse, boxes): pass both the coarse images and the boxes, or neither")
            return self.forward_patches(x, coarse, indexed_boxes(boxes))
        if x.ndim != 4:
            raise ValueError(f"x must be (B, C, H, W), got shape {tuple(x.shape)}")
        b, _, height, width = x.shape
        p = self.patch_size
        grid = patch_grid(height, width, p, overlap=self.overlap)
        coarse = coarse_input(x, self.coarse_size)
        outs = []
        boxes = patch_boxes_in_coarse(grid, height, width, self.coarse_size).to(x.device)
        for i in range(b):
            stitcher = Stitcher(height, width)
            # at inference the coarse features are computed once per image; in training the
            # coarse image rides along with every patch batch (see local_global_features)
            feats = self.coarse_features(coarse[i:i + 1]) if self.use_global and not self.training else None
            for j in range(0, len(grid), self.patch_batch):
                chunk = grid[j:j + self.patch_batch]
                patches = extract_patches(x[i], chunk, channel_axis=0)
                logits = self.forward_patches(patches, None if feats is not None else coarse[i:i + 1],
                                              boxes[j:j + len(chunk)], coarse_feats=feats)
                stitcher.add(logits, chunk)
            outs.append(stitcher.result())
        return torch.stack(outs)


def indexed_boxes(boxes: Tensor) -> Tensor:
    """(N, 4) boxes, one per patch of its own coarse image -> (N, 5) with each box's batch index
    (patch i uses coarse image i), as ROIAlign and :meth:`GlobalLocalNet.forward_patches` take
    them; (N, 5) boxes are returned as they are."""
    if boxes.ndim == 2 and boxes.shape[1] == 4:
        idx = torch.arange(boxes.shape[0], dtype=boxes.dtype, device=boxes.device)[:, None]
        return torch.cat([idx, boxes], 1)
    return boxes


def coarse_input(x: Tensor, size: int) -> Tensor:
    """The coarse images of normalised whole images: (B, C, H, W) -> (B, C, size, size).

    Bilinear with antialiasing (area-like when shrinking); the identity when the images
    already have that size.  :meth:`GlobalLocalNet.forward` and the WSSS trainer's
    samples (:func:`tasks.common.training.context_sample`) both use it, so a network trained on
    crops sees the same global context at inference.
    """
    if tuple(x.shape[-2:]) == (size, size):
        return x
    return F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=True)


def patch_boxes_in_coarse(grid: Sequence[tuple[int, int, int, int]], height: int, width: int, coarse_size: int,
                          batch_idx: int = 0) -> Tensor:
    """Patch boxes (y0, x0, y1, x1) of an H x W image -> (N, 5) ROIAlign boxes in coarse pixels.

    The coarse image is the whole image resized (aspect not kept) to ``coarse_size`` square,
    so x scales by ``coarse_size / W`` and y by ``coarse_size / H``.
    """
    g = torch.tensor(grid, dtype=torch.float32).reshape(-1, 4)
    sy, sx = coarse_size / height, coarse_size / width
    return torch.stack([torch.full_like(g[:, 0], float(batch_idx)), g[:, 1] * sx, g[:, 0] * sy,
                        g[:, 3] * sx, g[:, 2] * sy], 1)


def coarse_image(image, size: int, *, band: int = 64) -> np.ndarray:
    """Resize an (H, W, 3) uint8 image to the (size, size, 3) uint8 coarse image.

    Area interpolation when shrinking, done in two separable passes: each band of
    ``band`` rows is shrunk horizontally to ``size`` columns (float32), then the stacked
    (H, size, 3) result is shrunk vertically; this equals ``cv2.resize(image, (size, size),
    interpolation=cv2.INTER_AREA)`` and needs only one band of the image at a time, so
    ``image`` may be any array-like that supports slicing (numpy, memmap, zarr).  Images
    smaller than ``size`` along an axis are resized bilinearly in one go.
    """
    import cv2
    if len(image.shape) != 3:
        raise ValueError(f"image must be (H, W, C), got shape {tuple(image.shape)}")
    height, width = image.shape[:2]
    if min(height, width) < size:
        out = cv2.resize(np.ascontiguousarray(image[:]), (size, size), interpolation=cv2.INTER_LINEAR)
        return out.reshape(size, size, -1)
    rows = np.empty((height, size, image.shape[2]), dtype=np.float32)
    for r0 in range(0, height, band):
        piece = np.asarray(image[r0:r0 + band], dtype=np.float32)
        rows[r0:r0 + band] = cv2.resize(piece, (size, piece.shape[0]),
                                        interpolation=cv2.INTER_AREA).reshape(piece.shape[0], size, -1)
    out = cv2.resize(rows, (size, size), interpolation=cv2.INTER_AREA).reshape(size, size, -1)
    return np.clip(np.round(out), 0, 255).astype(np.uint8)


def normalize(images: np.ndarray | Tensor, mean: Sequence[float] = IMAGENET_MEAN,
              std: Sequence[float] = IMAGENET_STD) -> Tensor:
    """(..., H, W, C) uint8 -> (..., C, H, W) float32 tensor, scaled to [0, 1] and standardised.

    ``mean`` and ``std`` give one value per channel.  For a 4-channel input of RGB plus a
    0/255 edge map, ``mean = IMAGENET_MEAN + (0.5,)`` and ``std = IMAGENET_STD + (1.0,)``
    give the edge channel ``edge - 0.5``, as :func:`tasks.common.training.to_input` does.

    Raises
    ------
    ValueError
        If ``mean`` or ``std`` does not have one value per channel.
    """
    t = torch.as_tensor(np.asarray(images) if not isinstance(images, Tensor) else images)
    if len(mean) != t.shape[-1] or len(std) != t.shape[-1]:
        raise ValueError(f"images have {t.shape[-1]} channels but mean/std give {len(mean)}/{len(std)} values")
    t = t.movedim(-1, -3).float().div_(255.0)
    m = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)
    return (t - m) / s


@torch.no_grad()
def segment_large(model: GlobalLocalNet, image, *, patch_size: int | None = None, overlap: int = 0,
                  batch: int = 4, device: str | torch.device = "cpu", mean: Sequence[float] = IMAGENET_MEAN,
                  std: Sequence[float] = IMAGENET_STD, progress: Callable[[int, int], None] | None = None,
                  out=None):
    """Segment an image of any size with bounded memory.

    Patches are cut row by row (:func:`models.tiling.patch_grid` order), normalised and run
    in batches of ``batch``; their logits are averaged in overlaps by a
    :class:`models.tiling.RowStitcher` that keeps only one band of ``patch_size`` rows
    (``K x p x W`` floats); finished rows are turned into labels at once.  Peak memory is
    therefore the model on ``batch`` patches + one band + the input image and the
    (H, W) uint8 output.  The image is only ever read by slices (patches, and bands of
    rows for the coarse image, :func:`coarse_image`), and the labels are written row band
    by row band, so with an on-disk ``image`` (a zarr array or memmap) and ``out`` the
    memory no longer grows with the image at all (apart from an (H, p, 3) float32 buffer
    of the coarse-image resize).

    Parameters
    ----------
    model : GlobalLocalNet
        Trained model (put in eval mode here).
    image : (H, W, C) uint8 array-like
        The image (``C = model.in_channels``): a numpy array, or anything sliceable like
        one (zarr array, memmap).
    patch_size : int, optional
        Defaults to ``model.patch_size``; must equal it when the model uses global context.
    overlap : int
        Patch overlap in pixels.
    batch : int
        Patches per forward pass.
    device : str or torch.device
        Where the model runs.
    mean, std : sequences of C floats
        Normalisation used at training time (see :func:`normalize`).
    progress : callable(done, total), optional
        Called after each batch.
    out : (H, W) uint8 array-like, optional
        Where to write the labels (e.g. a zarr array); a new numpy array by default.

    Returns
    -------
    labels : (H, W) uint8
        Argmax class per pixel (``out`` when given).
    """
    if len(image.shape) != 3 or np.dtype(image.dtype) != np.uint8:
        raise ValueError(f"image must be an (H, W, C) uint8 array, got {image.dtype} {tuple(image.shape)}")
    if image.shape[2] != model.in_channels or len(mean) != image.shape[2] or len(std) != image.shape[2]:
        raise ValueError(f"image has {image.shape[2]} channels, the model takes {model.in_channels} and mean/std "
                         f"give {len(mean)}/{len(std)} values; they must agree")
    if out is not None and (tuple(out.shape) != tuple(image.shape[:2]) or np.dtype(out.dtype) != np.uint8):
        raise ValueError(f"out must be an {tuple(image.shape[:2])} uint8 array, got {out.dtype} {tuple(out.shape)}")
    p = int(patch_size or model.patch_size)
    if model.use_global and p != model.patch_size:
        raise ValueError(f"patch_size must equal model.patch_size={model.patch_size} for a global-local model")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    model.eval().to(device)
    height, width = image.shape[:2]
    grid = patch_grid(height, width, p, overlap=overlap)
    c = model.coarse_size
    coarse = normalize(coarse_image(image, c), mean, std)[None].to(device) if model.use_global else None
    coarse_feats = model.coarse_features(coarse) if coarse is not None else None
    boxes = patch_boxes_in_coarse(grid, height, width, c).to(device)
    labels = np.empty((height, width), dtype=np.uint8) if out is None else out
    rows = RowStitcher(height, width, p)
    done_rows = 0

    def flush(until: int) -> None:
        nonlocal done_rows
        part = rows.pop_until(until)
        if part is not None:
            n = part.shape[1]
            band = np.empty((n, width), np.uint8)
            for a in range(0, n, 32):       # argmax's int64 result 32 rows at a time
                band[a:a + 32] = part[:, a:a + 32].argmax(0).to(torch.uint8).cpu().numpy()
            del part
            labels[done_rows:done_rows + n] = band
            done_rows += n

    row_starts = sorted({b[0] for b in grid})
    done = 0
    for y0 in row_starts:
        flush(y0)
        idx = [i for i, b in enumerate(grid) if b[0] == y0]
        for j in range(0, len(idx), batch):
            sel = idx[j:j + batch]
            chunk = [grid[i] for i in sel]
            patches = normalize(extract_patches(image, chunk), mean, std)
            for k, (py0, px0, _, _) in enumerate(chunk):     # padding = 0 after normalising,
                patches[k, :, height - py0:] = 0             # as in forward()
                patches[k, :, :, width - px0:] = 0
            patches = patches.to(device)
            logits = model.forward_patches(patches, boxes=boxes[sel] if coarse is not None else None,
                                           coarse_feats=coarse_feats)
            rows.add(logits.float(), chunk)
            done += len(sel)
            if progress is not None:
                progress(done, len(grid))
    flush(height)
    return labels


def global_local(num_classes: int, in_channels: int = 3, *, patch_size: int = 512, width: int = 32,
                 n_convs: int = 2, **kwargs) -> GlobalLocalNet:
    """Build a :class:`GlobalLocalNet` (registry name ``global_local``)."""
    return GlobalLocalNet(num_classes, in_channels, patch_size=patch_size, width=width, n_convs=n_convs, **kwargs)


global_local.options_of = GlobalLocalNet  # its other options are GlobalLocalNet's (models.option_names)
