"""One writer per run directory: an advisory lock file that names its holder.

``with RunLock(root, "wsseg train"):`` takes ``RUN/.wsseg.lock`` with ``fcntl.flock``. A second
writer is refused at once with the holder's pid, host, start time and command. The kernel
releases the lock when its process ends, however it ends, so a lock file whose process is gone
is stale: the next writer takes it over and says so.
"""
from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
import socket
import sys
from pathlib import Path

LOCK_NAME = ".wsseg.lock"


class RunLockedError(ValueError):
    """The run directory is being written by another process (the message names it)."""


def _holder(text: str) -> dict:
    try:
        d = json.loads(text)
        return d if isinstance(d, dict) else {}
    except ValueError:
        return {}


def _describe(h: dict) -> str:
    return (f"pid {h.get('pid', '?')} on host {h.get('host', '?')}, started {h.get('started', '?')}"
            f" ({h.get('command', '?')})")


class RunLock:
    """Exclusive lock of a run directory for one command (a context manager)."""

    def __init__(self, root: str | os.PathLike, command: str, *, stream=None):
        self.path = Path(root) / LOCK_NAME
        self.command = command
        self.stream = stream or sys.stderr
        self._fd: int | None = None

    def holder(self) -> dict:
        """What the lock file says of its last holder ({} when there is none)."""
        try:
            return _holder(self.path.read_text())
        except OSError:
            return {}

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunLockedError(f"{self.path.parent}: in use by {_describe(self.holder())}; wait for it to "
                                 "finish or use another --run-dir") from None
        previous = _holder(os.pread(fd, 65536, 0).decode(errors="replace"))
        if previous.get("pid"):
            print(f"wsseg: taking over the stale lock of {self.path.parent} from {_describe(previous)}: that "
                  "process is gone", file=self.stream)
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "command": self.command}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)  # an empty file: released cleanly, not stale
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
