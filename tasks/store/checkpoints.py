"""Checkpoint files: the only code that calls ``torch.save``, and (through
:mod:`models.torch_files`, which also reads the ImageNet weight files) ``torch.load``.

Every file is written atomically (a temporary file in the same folder, then a rename) and read
with ``torch.load(weights_only=True)``: a checkpoint holds tensors and plain data (numbers,
strings, lists, dicts), never code. A network is rebuilt from its checkpoint by a builder taken
from the model registry (:func:`models.build_model`) by name, so a file cannot name a function to
run either.

Three kinds of file:

* **model checkpoints** (:func:`save_model` / :func:`load_model`): weights plus how to rebuild
  the network (registry name, class count, input channels, builder options) and free metadata;
* **corpus classifiers** (:func:`save_classifier` / :func:`load_classifier`): the superpixel MIL
  and proposal classifiers (:class:`models.proposal_mlp.ProposalMLP`), weights plus their
  shape, and whatever plain data the trainer recorded (losses, changed shares);
* **training state** (:class:`StateFile`): model, optimiser and schedule of an unfinished
  training, written after every epoch so that a stopped training resumes.
"""
from __future__ import annotations

import io
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from models.proposal_mlp import ProposalMLP
from models.torch_files import CheckpointError, read_plain

__all__ = ["CheckpointError", "read_file", "save_model", "load_model", "save_classifier", "load_classifier",
           "StateFile"]

#: builder references of checkpoints written before the registry knew every network by name
LEGACY_BUILDERS = {"models.small:image_classifier": "image_classifier",
                   "models.small:small_segnet": "small", "models.fusion_net:fusion_net": "fusion",
                   "models.global_local:global_local": "global_local"}


def _as_path(path: Any) -> Path:
    """A local path as :class:`pathlib.Path`; a remote UPath (or an fsspec URL) as a UPath."""
    from tasks.store.remote import is_local, is_remote_url, remote_root

    if is_local(path) or hasattr(path, "fs"):
        return path
    return remote_root(str(path)) if is_remote_url(path) else Path(path)


def _atomic_save(obj: Any, path: str | os.PathLike) -> Path:
    path = _as_path(path)
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


def read_file(path: str | os.PathLike, device: str | torch.device = "cpu") -> dict:
    """The plain content of a checkpoint file, local or on object storage, loaded with
    ``weights_only=True`` (:func:`models.torch_files.read_plain`).

    Raises
    ------
    CheckpointError
        When the file is missing, cut short, not a torch file, or holds anything but tensors
        and plain data (a pickled object or function is refused, never run).
    """
    path = _as_path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    return read_plain(path if isinstance(path, Path) else io.BytesIO(path.read_bytes()), path, device)


# ---------------------------------------------------------------------------- networks
def save_model(path: str | os.PathLike, model: nn.Module, *, builder: str, num_classes: int, in_channels: int,
               options: dict | None = None, meta: dict | None = None) -> Path:
    """A self-describing inference checkpoint: weights plus how to rebuild the network.

    ``builder`` is a name of the model registry (:func:`models.available`)."""
    import models

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
    import models

    path = _as_path(path)
    state = read_file(path, device)
    if "builder" not in state or "model" not in state:
        raise CheckpointError(f"{path}: not a wsseg model checkpoint (no 'builder' entry); pass a file "
                              "written by `wsseg train`, `wsseg bench highres` or an MLflow run's model.pt")
    name = LEGACY_BUILDERS.get(state["builder"], state["builder"])
    if not isinstance(name, str) or name not in models.available():
        raise CheckpointError(f"{path}: refused: its builder {state['builder']!r} is not a registered model "
                              f"({', '.join(models.available())}); wsseg builds networks by name only")
    try:
        model = models.build_model(name, int(state["num_classes"]), in_channels=int(state["in_channels"]),
                                   **dict(state.get("options") or {}))
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
    path = _as_path(path)
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
        self.path = _as_path(path)

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
