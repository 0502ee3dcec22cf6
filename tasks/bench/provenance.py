"""Where a benchmark's figures come from: the ``"provenance"`` of every benchmark JSON.

A figure means little without the command that printed it, its date and the machine it ran on;
and on a machine shared with other work the same command is slower. :func:`provenance` records
these when a benchmark command starts, :func:`finished` adds the end (the load then), and
:func:`stamp` writes them into the result JSON the benchmark wrote, leaving every other key as
it was. ``wsseg bench report`` (:mod:`tasks.bench.report`) prints them under each table.
"""
from __future__ import annotations

import os
import platform
import shlex
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

__all__ = ["provenance", "finished", "stamp", "machine", "source_commit", "busy", "PROVENANCE"]

#: the key of the result JSON that holds it
PROVENANCE = "provenance"


def _now() -> str:
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _load() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # no load average on this platform
        return None


def _cpu_model() -> str:
    """The CPU's model as /proc/cpuinfo names it (``platform.processor()`` elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.split(":", 1)[0].strip() in ("model name", "Model", "Hardware"):
                return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _memory_gb() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2 ** 20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _gpu() -> str | None:
    """The first CUDA device's name where torch sees one; None without torch or a GPU."""
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # no torch, or a broken driver: the figures still get their machine
        return None


def machine() -> dict:
    """The machine in figures and in words (``words``: what the report prints)."""
    cpu, cores, mem, gpu = _cpu_model(), os.cpu_count(), _memory_gb(), _gpu()
    words = f"{cpu}, {cores} cores, " + (f"{mem:g} GB memory" if mem is not None else "memory unknown")
    words += f", GPU {gpu}" if gpu else ", no GPU"
    return {"words": words, "cpu": cpu, "cores": cores, "memory_gb": mem, "gpu": gpu}


def source_commit(folder: str | os.PathLike | None = None) -> dict | None:
    """``{"commit": short hash, "local_changes": bool}`` of the source checkout wsseg runs from;
    None when it is installed (no checkout around it), or git is absent or fails. Only a
    checkout whose root holds this package's own ``pyproject.toml`` counts, so that a package
    installed inside some other repository is not given that repository's commit."""
    root = Path(folder) if folder is not None else Path(__file__).resolve().parents[2]
    if not ((root / ".git").exists() and (root / "pyproject.toml").is_file()):
        return None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0 or not head.stdout.strip():
        return None
    return {"commit": head.stdout.strip(), "local_changes": dirty.returncode == 0 and bool(dirty.stdout.strip())}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("wsseg")
    except PackageNotFoundError:
        return "unknown (not installed)"


def provenance(argv: Sequence[str] | None) -> dict:
    """What a benchmark records when it starts: ``command`` (``argv``, the arguments after
    ``wsseg``, as the user would type them; None where the command was not given, e.g. a flow
    called from Python), ``argv``, ``date`` (UTC, ISO 8601), ``machine`` (:func:`machine`),
    ``load_average`` (1-minute, ``start``; ``end`` is added by :func:`finished`), ``wsseg``
    (version) and ``source`` (:func:`source_commit`)."""
    args = None if argv is None else [str(a) for a in argv]
    return {"command": None if args is None else shlex.join(["wsseg", *args]), "argv": args, "date": _now(),
            "machine": machine(), "load_average": {"start": _load(), "end": None}, "wsseg": _version(),
            "source": source_commit()}


def finished(p: dict) -> dict:
    """``p`` with the end: ``finished`` (UTC) and the load average then."""
    return {**p, "finished": _now(), "load_average": {**p.get("load_average", {}), "end": _load()}}


def stamp(path: str | os.PathLike, p: dict, indent: int = 2) -> dict:
    """Add ``p`` (finished now) to the result JSON at ``path`` under :data:`PROVENANCE`, every
    other key as the benchmark wrote it (``indent``: the benchmark's own); returns it."""
    from wsseg.tasks.store import files

    p = finished(p)
    files.write_json(path, {**files.read_json(path), PROVENANCE: p}, indent=indent)
    return p


def busy(p: dict) -> bool:
    """Whether other work ran beside the benchmark: a 1-minute load average of at least half a
    core when it started (the benchmark itself had not run long enough to weigh in it)."""
    start = (p.get("load_average") or {}).get("start")
    return start is not None and start >= 0.5
