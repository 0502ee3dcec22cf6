"""Segmentation networks of wsseg and the registry that every flow and the CLI use (``--model``).

A registry entry is a builder ``build(num_classes, in_channels=4, **options) -> nn.Module`` whose
``forward(x: (B, in_channels, H, W)) -> logits (B, num_classes, H, W)``.
"""
from __future__ import annotations

import importlib
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: see tasks/__init__.py
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


def save_checkpoint(path, model: nn.Module, *, builder_ref: str, num_classes: int, in_channels: int,
                    options: dict | None = None, meta: dict | None = None) -> None:
    """A self-describing inference checkpoint: weights plus how to rebuild the network.

    ``builder_ref`` is a registry name or ``"module:function"``.
    """
    import os
    from pathlib import Path

    import torch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"builder": builder_ref, "num_classes": num_classes, "in_channels": in_channels,
             "options": options or {}, "meta": meta or {},
             "model": {k: v.detach().cpu() for k, v in model.state_dict().items()}}
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path, device="cpu") -> tuple[nn.Module, dict]:
    """Rebuild a network saved by :func:`save_checkpoint`; returns (model in eval mode, state)."""
    import torch

    try:
        state = torch.load(path, map_location=device, weights_only=False)
    except (OSError, RuntimeError) as e:
        raise ValueError(f"{path}: not a readable wsseg checkpoint ({e})") from e
    if not isinstance(state, dict) or "builder" not in state:
        raise ValueError(f"{path}: not a wsseg checkpoint (no 'builder' entry); "
                         "pass a file written by `wsseg train` or an MLflow run's model.pt")
    ref = state["builder"]
    if ":" in ref:
        module, attr = ref.split(":")
        build = getattr(importlib.import_module(module), attr)
    else:
        build = builder(ref)
    model = build(state["num_classes"], in_channels=state["in_channels"], **state["options"])
    model.load_state_dict(state["model"])
    return model.to(device).eval(), state
