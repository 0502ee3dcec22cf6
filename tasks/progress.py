"""Progress lines on the terminal: ``[stage] done/total unit  elapsed  eta``."""
from __future__ import annotations

import sys
import time


class Progress:
    """One-line progress messages on stderr: ``[stage] done/total unit  elapsed``."""

    def __init__(self, stage: str, total: int, unit: str = "images", stream=None):
        self.stage, self.total, self.unit = stage, total, unit
        self.done = 0
        self.t0 = time.perf_counter()
        self.stream = stream or sys.stderr

    def advance(self, n: int, note: str = "") -> None:
        self.done += n
        el = time.perf_counter() - self.t0
        eta = el / self.done * (self.total - self.done) if self.done else 0.0
        extra = f"  {note}" if note else ""
        print(f"  [{self.stage}] {self.done}/{self.total} {self.unit}  {el:5.1f}s  eta {eta:4.0f}s{extra}",
              file=self.stream, flush=True)

    def message(self, text: str) -> None:
        print(f"  [{self.stage}] {text}", file=self.stream, flush=True)
