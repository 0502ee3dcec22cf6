"""wsseg: pixel-accurate segmentation labels and models from image-level tags, in refresh rounds.

The project's code lives in three packages, mapped under this one by the packaging
(pyproject.toml): ``wsseg.flows`` (the Prefect flows and the CLI), ``wsseg.tasks`` (the work:
corpus, methods A, B and C, labels out, the store) and ``wsseg.models`` (the networks).
"""
from __future__ import annotations

from wsseg.flows.cli_common import version_text

__version__ = version_text()
