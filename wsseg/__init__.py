"""wsseg: pixel-accurate segmentation labels and models from image-level tags, in refresh rounds.

The Python API: each function does what the ``wsseg`` command of the same name does and returns
the summary its ``--json`` prints, as plain data (:mod:`wsseg.flows.api`)::

    import wsseg

    wsseg.ingest(wsseg.SAMPLE, run_dir="runs/api")           # images/ + labels.csv (+ masks, to measure)
    summary = wsseg.train(run_dir="runs/api", rounds=1)       # the refresh rounds
    labels = wsseg.segment([image_array], model="runs/api")   # [(H, W) uint8 class indices]

The project's code lives in three packages, mapped under this one by the packaging
(pyproject.toml): ``wsseg.flows`` (the Prefect flows, the CLI and the API), ``wsseg.tasks`` (the
work: corpus, methods A, B and C, labels out, the store) and ``wsseg.models`` (the networks).
"""
from __future__ import annotations

from pathlib import Path as _Path

# In a source checkout this folder holds only the package's own files and flows/, tasks/ and models/
# lie beside it: look for the subpackages there too, so that a checkout (a git worktree, CI's clone)
# imports its own code rather than the one an editable install maps (installed, they lie in here).
_here = _Path(__file__).resolve().parent
if not (_here / "flows").is_dir() and (_here.parent / "flows" / "api.py").is_file():
    __path__.append(str(_here.parent))

from wsseg.flows.api import (DEFAULT_RUN_DIR, SAMPLE, check, evaluate, export, ingest, refresh, review, segment,
                             segment_files, status, train, version)

__version__ = version()
__all__ = ["ingest", "train", "refresh", "evaluate", "segment", "segment_files", "export", "review", "status",
           "check", "version", "SAMPLE", "DEFAULT_RUN_DIR", "__version__"]
