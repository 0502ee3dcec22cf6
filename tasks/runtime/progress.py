"""Progress lines on the terminal: ``[stage] done/total unit  elapsed  eta``; each line is also an
INFO log record of the current Prefect flow or task run, when there is one (the dashboard's logs)."""
from __future__ import annotations

import sys
import time


def run_log(line: str) -> None:
    """``line`` as an INFO record of the current Prefect flow or task run; nothing outside a run.
    Cheap and never raising: Prefect is not imported here unless the process already has it."""
    if "prefect" not in sys.modules:
        return
    try:
        from prefect.context import FlowRunContext, TaskRunContext

        if TaskRunContext.get() is None and FlowRunContext.get() is None:
            return
        from prefect.logging import get_run_logger

        get_run_logger().info(line)
    except Exception:  # logging must never fail the work
        pass


class Progress:
    """One-line progress messages on stderr: ``[stage] done/total unit  elapsed``."""

    def __init__(self, stage: str, total: int, unit: str = "images", stream=None):
        self.stage, self.total, self.unit = stage, total, unit
        self.done = 0
        self.t0 = time.perf_counter()
        self.stream = stream or sys.stderr

    def _emit(self, line: str) -> None:
        print(f"  {line}", file=self.stream, flush=True)
        run_log(line)

    def advance(self, n: int, note: str = "") -> None:
        self.done += n
        el = time.perf_counter() - self.t0
        eta = el / self.done * (self.total - self.done) if self.done else 0.0
        extra = f"  {note}" if note else ""
        self._emit(f"[{self.stage}] {self.done}/{self.total} {self.unit}  {el:5.1f}s  eta {eta:4.0f}s{extra}")

    def message(self, text: str) -> None:
        self._emit(f"[{self.stage}] {text}")
