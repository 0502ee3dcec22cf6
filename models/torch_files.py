"""The one reader of torch files: ``torch.load(weights_only=True)``, whose refusals and failures
become a :class:`CheckpointError` naming the file. Checkpoints (:mod:`tasks.store.checkpoints`)
and the ImageNet weight files (:mod:`models.efficientnet_lite`) are read through it."""
from __future__ import annotations

import pickle
from pathlib import Path

import torch


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used; the message names the file and the problem."""


def read_local(path, device: str | torch.device = "cpu") -> dict:
    """:func:`read_plain` of a local file; a missing one is a :class:`CheckpointError` too."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    return read_plain(path, path, device)


def read_plain(source, name, device: str | torch.device = "cpu") -> dict:
    """The plain content of the torch file ``source`` (a local path or a file object; ``name``
    names it in errors), loaded with ``weights_only=True``: tensors and plain data only.

    Raises
    ------
    CheckpointError
        When the file is cut short, not a torch file, not a dict, or holds anything but tensors
        and plain data (a pickled object or function is refused, never run).
    """
    try:
        state = torch.load(source, map_location=device, weights_only=True)
    except pickle.UnpicklingError as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        first = next((ln for ln in lines if "GLOBAL" in ln or "Unsupported" in ln), lines[-1] if lines else
                     type(e).__name__)
        raise CheckpointError(f"{name}: refused: the file holds more than tensors and plain data, and "
                              f"wsseg never runs code from a file ({first})") from None
    except (OSError, RuntimeError, EOFError, ValueError, KeyError, IndexError) as e:
        raise CheckpointError(f"{name}: not a readable checkpoint, truncated or not written by torch "
                              f"({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''})") \
            from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{name}: not a wsseg checkpoint (a {type(state).__name__}, not a dict)")
    return state
