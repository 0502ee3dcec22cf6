"""Torch files: the only code that calls ``torch.save`` and ``torch.load``, and the one place
that turns a network's weight options into weights (:func:`build_network`).

Every file is written atomically (a temporary file in the same folder, then a rename) and read
with ``torch.load(weights_only=True)`` (:func:`read_plain`, the one call): a file holds tensors
and plain data (numbers, strings, lists, dicts), never code. A torch file is a zip archive whose
every member carries a CRC-32; torch does not check them, so :func:`read_plain` does first, and a
changed byte is a :class:`DamagedCheckpointError` instead of wrong weights. A network is rebuilt from its
checkpoint by a builder taken from the model registry (:func:`models.build_model`) by name, so a
file cannot name a function to run either. :mod:`models` reads no file: its networks take
weights as state dicts, which :func:`build_network` reads here from the user's options
(``pretrained``): the ImageNet files of the EfficientNet-Lite packages (:func:`imagenet_weights`)
and torchvision checkpoints for the fusion network (:func:`backbone_weights`).

Three kinds of file are written and read back:

* **model checkpoints** (:func:`save_model` / :func:`load_model`): weights plus how to rebuild
  the network (registry name, class count, input channels, builder options) and free metadata;
* **corpus classifiers** (:func:`save_classifier` / :func:`load_classifier`): the superpixel MIL
  and proposal classifiers (:class:`models.proposal_mlp.ProposalMLP`), weights plus their
  shape, and whatever plain data the trainer recorded (losses, changed shares);
* **training state** (:class:`StateFile`): model, optimiser and schedule of an unfinished
  training, written after every epoch so that a stopped training resumes.
"""
from __future__ import annotations

import inspect
import io
import os
import pickle
import tempfile
from collections.abc import Iterator, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from wsseg.models import efficientnet_lite as el
from wsseg.tasks.store.remote import as_path
from wsseg.models.proposal_mlp import ProposalMLP
from wsseg.tasks.store.damage import DamagedFileError

__all__ = ["CheckpointError", "DamagedCheckpointError", "read_plain", "read_local", "read_file", "imagenet_weights",
           "backbone_weights", "build_network", "network_options", "check_network_options", "save_model",
           "load_model", "save_classifier", "load_classifier", "StateFile"]

#: builder references of checkpoints written before the registry knew every network by name
LEGACY_BUILDERS = {"models.small:image_classifier": "image_classifier",
                   "models.small:small_segnet": "small", "models.fusion_net:fusion_net": "fusion",
                   "models.global_local:global_local": "global_local"}


def _atomic_save(obj: Any, path: str | os.PathLike) -> Path:
    path = as_path(path)
    if not isinstance(path, Path):  # object storage: one put, whole or not at all
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        path.write_bytes(buffer.getvalue())
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


class CheckpointError(ValueError):
    """A torch file that cannot be used; the message names the file and the problem."""


class DamagedCheckpointError(CheckpointError, DamagedFileError):
    """A torch file that does not read back as written (cut short, a CRC that fails): a
    :class:`CheckpointError` (its maker computes it again, :meth:`tasks.store.Store.usable_checkpoint`)
    and a :class:`~tasks.store.damage.DamagedFileError` (its message names ``wsseg check``)."""


def _check_crc(source, name) -> None:
    """Compare every member of the zip archive ``source`` (a torch file: a path or a file object)
    with its CRC-32; a file that is no zip archive (cut short, an older torch format) is left to
    ``torch.load``."""
    import zipfile
    import zlib

    try:
        zf = zipfile.ZipFile(source)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError):
        if hasattr(source, "seek"):
            source.seek(0)
        return
    try:
        with zf:
            bad = zf.testzip()  # the first member whose CRC fails (named without the archive's folder)
            problem = f"its zip member {str(bad).split('/', 1)[-1]} fails its CRC-32 check (bytes changed since it " \
                      "was written)"
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, RuntimeError, zlib.error) as e:
        bad, problem = True, f"its zip archive does not read ({type(e).__name__}: {e})"
    finally:
        if hasattr(source, "seek"):
            source.seek(0)
    if bad is not None:
        raise DamagedCheckpointError(name, f"damaged: {problem}")


def _load(source, name, device: str | torch.device = "cpu") -> Any:
    """The one ``torch.load`` of wsseg: ``weights_only=True``, tensors and plain data only; its
    refusals and failures become a :class:`CheckpointError` naming ``name``."""
    try:
        return torch.load(source, map_location=device, weights_only=True)
    except pickle.UnpicklingError as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        first = next((ln for ln in lines if "GLOBAL" in ln or "Unsupported" in ln), lines[-1] if lines else
                     type(e).__name__)
        raise CheckpointError(f"{name}: refused: the file holds more than tensors and plain data, and "
                              f"wsseg never runs code from a file ({first})") from None
    except (OSError, RuntimeError, EOFError, ValueError, KeyError, IndexError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise DamagedCheckpointError(name, "not a readable checkpoint, truncated or not written by torch "
                                           f"({type(e).__name__}: {first})") from None


def read_plain(source, name, device: str | torch.device = "cpu") -> dict:
    """The plain content of the torch file ``source`` (a local path or a file object; ``name``
    names it in errors), loaded with ``weights_only=True``: tensors and plain data only.

    Raises
    ------
    CheckpointError
        When the file is cut short, not a torch file, not a dict, or holds anything but tensors
        and plain data (a pickled object or function is refused, never run).
    """
    _check_crc(source, name)
    state = _load(source, name, device)
    if not isinstance(state, dict):
        raise CheckpointError(f"{name}: not a wsseg checkpoint (a {type(state).__name__}, not a dict)")
    return state


def read_local(path, device: str | torch.device = "cpu") -> dict:
    """:func:`read_plain` of a local file; a missing one is a :class:`CheckpointError` too."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    return read_plain(path, path, device)


def read_file(path: str | os.PathLike, device: str | torch.device = "cpu") -> dict:
    """The plain content of a checkpoint file, local or on object storage, loaded with
    ``weights_only=True`` (:func:`read_plain`).

    Raises
    ------
    CheckpointError
        When the file is missing, cut short, not a torch file, or holds anything but tensors
        and plain data (a pickled object or function is refused, never run).
    """
    path = as_path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    return read_plain(path if isinstance(path, Path) else io.BytesIO(path.read_bytes()), path, device)


# ---------------------------------------------------------------------------- weights of new networks
@lru_cache(maxsize=4)
def _imagenet_state(path: str, size: int, mtime_ns: int) -> dict[str, Tensor]:
    state = read_local(path)
    if not all(isinstance(k, str) and isinstance(v, Tensor) for k, v in state.items()):
        raise CheckpointError(f"{path}: not a state dict (names and tensors)")
    return state


def imagenet_weights(variant: str) -> dict[str, Tensor]:
    """The ImageNet state dict of EfficientNet-Lite ``variant``, from the weight file of its pinned
    package (:func:`models.efficientnet_lite.weights_path`), read through :func:`read_local`.

    Read once per process and file content (the cache is keyed by path, size and modification
    time): each call returns a new dict of the same tensors, which the networks copy
    (``load_state_dict``) and nothing modifies in place.

    Raises
    ------
    PretrainedWeightsError
        One line naming the package and the from-scratch option: the package is not installed,
        or its file is missing or damaged.
    """
    path = el.weights_path(variant)  # not installed: PretrainedWeightsError
    try:
        if not path.is_file():
            raise CheckpointError(f"{path}: no such checkpoint file")
        st = path.stat()
        state = _imagenet_state(str(path), st.st_size, st.st_mtime_ns)
    except CheckpointError as exc:
        raise el.PretrainedWeightsError(
            f"the weight file of package {el.VARIANTS[variant][2]} is damaged: {exc}; reinstall the package, "
            f"or {el.FROM_SCRATCH}") from None
    return dict(state)


def backbone_weights(path: str | os.PathLike) -> dict[str, Tensor]:
    """The state dict of a torchvision checkpoint file (``segmentation.backbone_weights``, the
    fusion network's encoders), read through :func:`read_plain`; a dict holding only
    ``'state_dict'`` or ``'model'`` is unwrapped and a ``'module.'`` prefix stripped.

    Raises
    ------
    FileNotFoundError
        When ``path`` does not exist.
    CheckpointError
        When the file is damaged or holds more than tensors and plain data.
    ValueError
        When it holds no state dict (the message names the file).
    """
    from wsseg.models.backbones import unwrap_state_dict

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint not found: {path!r}; pass the path of a torchvision state_dict file")
    return unwrap_state_dict(_load(path, path), path)


class _BackboneFiles(Mapping):
    """Encoder name -> state dict of its file, each read when it is loaded (after the fusion
    network checked the names), one at a time."""

    def __init__(self, paths: Mapping[str, str | os.PathLike]):
        self.paths = {k: os.fspath(v) for k, v in paths.items()}

    def __getitem__(self, key: str) -> dict[str, Tensor]:
        return backbone_weights(self.paths[key])

    def __iter__(self) -> Iterator[str]:
        return iter(self.paths)

    def __len__(self) -> int:
        return len(self.paths)


#: the networks whose option ``pretrained`` :func:`build_network` turns into weights, and its
#: default: ImageNet's for the lite networks and global_local's lite backbones (a bool), the
#: fusion network's torchvision files (``{"resnet50": path, "mobilenet_v2": path}`` or None)
PRETRAINED = {"lite": True, "lite_classifier": True, "global_local": True, "fusion": None}


def network_options(name: str) -> tuple[str, ...]:
    """The options a configuration may give network ``name``: its builder's, with ``pretrained``
    in place of ``weights`` (state dicts, which only :func:`build_network` passes)."""
    from wsseg import models

    own = tuple(o for o in models.option_names(name) if o != "weights")
    return own + (("pretrained",) if name in PRETRAINED else ())


def check_network_options(name: str, options: Mapping[str, Any]) -> None:
    """Raise a one-line ``ValueError`` naming the options that network ``name`` does not take
    (:func:`models.check_options` with :func:`network_options`; ``weights`` is refused even where
    the builder passes its options on)."""
    from wsseg import models

    models.check_options(name, options, known=network_options(name), refused=("weights",))


def _default(fn, option: str) -> Any:
    return inspect.signature(fn).parameters[option].default


def build_network(name: str, num_classes: int, in_channels: int = 4, **options) -> nn.Module:
    """Build registry network ``name`` (:func:`models.build_model`) with the weights its options
    ask for, read here: the one place that turns the user-facing option ``pretrained`` into state
    dicts.

    * ``lite``, ``lite_classifier``: ``pretrained`` (default true) loads the ImageNet weights of
      the ``variant``'s package into the encoder (whose early blocks are then frozen);
    * ``global_local``: the same for a lite ``backbone`` (hrnet: ignored);
    * ``fusion``: ``pretrained`` is ``{"resnet50": path, "mobilenet_v2": path}`` (either key
      optional), torchvision checkpoints loaded into the encoders;
    * other networks take no ``pretrained``.

    A network rebuilt from a checkpoint (:func:`load_model`) is built with ``pretrained`` false (its weights are in
    the file). Raises what the reads raise (:func:`imagenet_weights`: one-line
    ``PretrainedWeightsError``; :func:`backbone_weights`) and ``ValueError`` for an unknown option.
    """
    from wsseg import models

    check_network_options(name, options)
    options = dict(options)
    if name not in PRETRAINED:
        return models.build_model(name, num_classes, in_channels=in_channels, **options)
    pretrained = options.pop("pretrained", PRETRAINED[name])
    if name == "fusion":
        net = models.build_model(name, num_classes, in_channels=in_channels, **options)
        if not pretrained:
            return net
        if not isinstance(pretrained, Mapping):
            raise ValueError(f"fusion's option pretrained is {{'resnet50': path, 'mobilenet_v2': path}}, "
                             f"not {pretrained!r}")
        from wsseg.models.fusion_net import load_encoder_weights

        files = _BackboneFiles(pretrained)  # each file read after the names are checked, named in its errors
        return load_encoder_weights(net, files, sources=files.paths)
    variant = imagenet_variant(name, {**options, "pretrained": pretrained})
    weights = imagenet_weights(variant) if variant else None
    return models.build_model(name, num_classes, in_channels=in_channels, **options,
                              **({} if weights is None else {"weights": weights}))


def imagenet_variant(name: str, options: Mapping[str, Any]) -> str | None:
    """The EfficientNet-Lite whose ImageNet weights :func:`build_network` loads into network ``name``
    (a lite network's ``variant``, global_local's lite ``backbone``), or None (``pretrained`` false,
    an hrnet backbone, another network)."""
    from wsseg import models

    if name not in ("lite", "lite_classifier", "global_local") or not options.get("pretrained", PRETRAINED[name]):
        return None
    if name == "global_local":
        from wsseg.models.global_local import GlobalLocalNet

        backbone = options.get("backbone", _default(GlobalLocalNet, "backbone"))
        return backbone if backbone in el.VARIANTS else None
    return options.get("variant", _default(models.builder(name), "variant"))


def initial_weights(name: str, options: Mapping[str, Any]) -> str:
    """What :func:`build_network` starts network ``name`` from with ``options``, in words: ImageNet's
    weights of its lite encoder or backbone, torchvision's files (fusion), or random weights.

    >>> initial_weights("lite", {}), initial_weights("lite", {"pretrained": False})
    ("ImageNet's lite0 weights", 'random weights')
    """
    if name == "fusion" and options.get("pretrained"):
        return "torchvision's ImageNet files"
    variant = imagenet_variant(name, options)
    return f"ImageNet's {variant} weights" if variant else "random weights"


# ---------------------------------------------------------------------------- networks
def save_model(path: str | os.PathLike, model: nn.Module, *, builder: str, num_classes: int, in_channels: int,
               options: dict | None = None, meta: dict | None = None) -> Path:
    """A self-describing inference checkpoint: weights plus how to rebuild the network.

    ``builder`` is a name of the model registry (:func:`models.available`)."""
    from wsseg import models

    if builder not in models.available():
        raise ValueError(f"builder {builder!r} is not a registered model; choose one of: "
                         f"{', '.join(models.available())}")
    state = {"builder": builder, "num_classes": int(num_classes), "in_channels": int(in_channels),
             "options": dict(options or {}), "meta": dict(meta or {}),
             "model": {k: v.detach().cpu() for k, v in model.state_dict().items()}}
    return _atomic_save(state, path)


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu") -> tuple[nn.Module, dict]:
    """Rebuild a network saved by :func:`save_model`; returns (model in eval mode, its state dict
    of metadata). The builder comes from the registry by name, never from the file."""
    from wsseg import models

    path = as_path(path)
    state = read_file(path, device)
    if "builder" not in state or "model" not in state:
        raise CheckpointError(f"{path}: not a wsseg model checkpoint (no 'builder' entry); pass a file "
                              "written by `wsseg train`, `wsseg bench highres` or an MLflow run's model.pt")
    name = LEGACY_BUILDERS.get(state["builder"], state["builder"])
    if not isinstance(name, str) or name not in models.available():
        raise CheckpointError(f"{path}: refused: its builder {state['builder']!r} is not a registered model "
                              f"({', '.join(models.available())}); wsseg builds networks by name only")
    try:
        options = dict(state.get("options") or {})
        if name in PRETRAINED:  # the weights are in the file: rebuilt without reading ImageNet's or torchvision's
            options["pretrained"] = False
        model = build_network(name, int(state["num_classes"]), in_channels=int(state["in_channels"]), **options)
        model.load_state_dict(state["model"])
    except (TypeError, ValueError, RuntimeError, KeyError) as e:
        raise CheckpointError(f"{path}: its weights do not fit the {name!r} network it names "
                              f"({str(e).splitlines()[0]})") from None
    return model.to(device).eval(), state


# ---------------------------------------------------------------------------- corpus classifiers
def save_classifier(path: str | os.PathLike, model: nn.Module | None, **extra: Any) -> Path:
    """A :class:`~tasks.wsss.proposal_classifier.ProposalMLP` (or None: no model) and plain data."""
    spec = None
    if model is not None:
        spec = {"in_features": int(model.mean.numel()), "num_classes": int(model.num_classes),
                "hidden": int(model.hidden), "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()}}
    return _atomic_save({"kind": "proposal_mlp", "model": spec, **extra}, path)


def load_classifier(path: str | os.PathLike) -> dict:
    """The content of :func:`save_classifier`'s file with ``model`` rebuilt (eval mode) or None."""
    path = as_path(path)
    state = read_file(path)
    if state.get("kind") != "proposal_mlp":
        raise CheckpointError(f"{path}: not a wsseg corpus classifier (no kind 'proposal_mlp')")
    spec = state.get("model")
    if spec is not None:
        try:
            model = ProposalMLP(spec["in_features"], spec["num_classes"], spec["hidden"])
            model.load_state_dict(spec["state_dict"])
        except (TypeError, KeyError, RuntimeError, ValueError) as e:
            raise CheckpointError(f"{path}: corpus classifier weights do not fit ({str(e).splitlines()[0]})") \
                from None
        state["model"] = model.eval()
    return state


# ---------------------------------------------------------------------------- training state
class StateFile:
    """Where an unfinished training keeps its state between epochs (see :func:`tasks.common.training.fit`).

    ``load()`` returns the saved dict or None (no file, or a damaged one: training then starts
    over, and says so through ``on_damaged``); ``save(state)`` replaces it atomically."""

    def __init__(self, path: str | os.PathLike):
        self.path = as_path(path)

    def __repr__(self) -> str:
        return f"StateFile({str(self.path)!r})"

    def exists(self) -> bool:
        return self.path.is_file()

    def load(self, device: str | torch.device = "cpu") -> dict | None:
        if not self.path.is_file():
            return None
        try:
            return read_file(self.path, device)
        except CheckpointError as e:
            import sys

            print(f"  [store] {e}; the training starts over", file=sys.stderr, flush=True)
            self.clear()
            return None

    def save(self, state: dict) -> None:
        _atomic_save(state, self.path)

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)
