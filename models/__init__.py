"""Segmentation networks of wsseg and the registry that every flow and the CLI use (``--model``).

A registry entry is a builder ``build(num_classes, in_channels=4, **options) -> nn.Module`` whose
``forward(x: (B, in_channels, H, W)) -> logits (B, num_classes, H, W)``.
"""
from __future__ import annotations

import importlib
from typing import Callable

from torch import nn

_REGISTRY: dict[str, tuple[str, str, str]] = {
    "small": ("models.small", "small_segnet", "compact encoder-decoder for CPU training (~1M parameters)"),
    "fusion": ("models.fusion_net", "fusion_net", "ResNet50 + MobileNetV2 multi-scale fusion network (method B)"),
    "global_local": ("models.global_local", "global_local",
                     "patch + coarse-image network for ultra-high-resolution images (method C)"),
}


def available() -> dict[str, str]:
    """Registry names and a one-line description of each."""
    return {name: desc for name, (_, _, desc) in _REGISTRY.items()}


def builder(name: str) -> Callable[..., nn.Module]:
    if name not in _REGISTRY:
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(_REGISTRY)}")
    module, attr, _ = _REGISTRY[name]
    return getattr(importlib.import_module(module), attr)


def build_model(name: str, num_classes: int, in_channels: int = 4, **options) -> nn.Module:
    """Build a registered segmentation network by name."""
    return builder(name)(num_classes, in_channels=in_channels, **options)
