"""One writer per run directory: an advisory lock file that names its holder.

``with RunLock(root, "wsseg train"):`` takes ``RUN/.wsseg.lock`` with ``fcntl.flock``. A second
writer is refused at once with the holder's pid, host, start time and command. The kernel
releases the lock when its process ends, however it ends, so a lock file whose process is gone
is stale: the next writer takes it over and says so.

A run directory on object storage has no ``flock``: its writer takes the ``flock`` of the local
state folder (:attr:`tasks.store.Store.state_dir`), then creates the lock object
``RUN/.wsseg.lock`` (pid, host, start, command, state folder) with an exclusive put (S3's
``If-None-Match: *``), so that a second writer from any host that shares the store is refused,
and deletes it when it ends. Its limits: the object of a writer that died on another host stays
until someone deletes it (the refusal names the object: delete it once that process is known to
be gone); one of this host whose process is gone is taken over, as a lock file is. A store that
refuses exclusive puts gets a check then a put, which two writers starting at the same instant
can both pass.
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


def _gone(h: dict) -> bool:
    """Whether the writer a lock record names is known to be gone: a damaged record, or a process
    of this host that no longer runs (one of another host cannot be checked from here)."""
    if not h.get("pid"):
        return True
    if h.get("host") != socket.gethostname():
        return False
    try:
        os.kill(int(h["pid"]), 0)
    except (ProcessLookupError, ValueError):
        return True
    except PermissionError:
        return False
    return False


def _describe(h: dict) -> str:
    return (f"pid {h.get('pid', '?')} on host {h.get('host', '?')}, started {h.get('started', '?')}"
            f" ({h.get('command', '?')})")


class RunLock:
    """Exclusive lock of a run directory for one command (a context manager).

    With ``reentrant=True``, a lock of a folder this process already holds is counted, not refused:
    the CLI holds the run directory's lock while the Python API function it calls (which a library
    user calls directly) takes it again (``flock`` would refuse the second open file of the same
    process). Without it, a second holder in the same process is refused as any other."""

    #: folders whose lock this process holds, with how many holders
    _held: dict[str, int] = {}

    def __init__(self, root: str | os.PathLike, command: str, *, stream=None, remote=None,
                 option: str = "--run-dir", reentrant: bool = False):
        self.path = Path(root) / LOCK_NAME
        self.reentrant = reentrant
        #: what the refusal tells a second writer to change (the command's option that names the folder)
        self.option = option
        #: the lock object of a run directory on object storage (a UPath), None for a local one
        self.remote = remote / LOCK_NAME if remote is not None else None
        self.command = command
        self.stream = stream or sys.stderr
        self._fd: int | None = None
        self._info: dict | None = None

    def holder(self) -> dict:
        """What the lock file (the lock object, for a run directory on object storage) says of its
        last holder ({} when there is none)."""
        try:
            return _holder((self.remote if self.remote is not None else self.path).read_text())
        except OSError:
            return {}

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        key = str(self.path.resolve())
        if self.reentrant and RunLock._held.get(key):
            RunLock._held[key] += 1
            self._fd = -1  # held by an outer holder of this process: release() only counts down
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            where = self.remote.parent if self.remote is not None else self.path.parent
            raise RunLockedError(f"{where}: in use by {_describe(self.holder())}; wait for it to "
                                 f"finish or use another {self.option}") from None
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
        RunLock._held[key] = 1
        if self.remote is not None:
            try:
                self._acquire_remote(info | {"state_dir": str(self.path.parent)})
            except BaseException:
                self.release()
                raise

    def _acquire_remote(self, info: dict) -> None:
        """Create the lock object exclusively; take over one whose writer (on this host) is gone."""
        blob = json.dumps(info).encode()
        for attempt in (0, 1):
            try:
                try:
                    with self.remote.fs.open(self.remote.path, "xb") as f:
                        f.write(blob)
                except (NotImplementedError, ValueError, TypeError):  # no exclusive puts: check, then put
                    if self.remote.exists():
                        raise FileExistsError(str(self.remote)) from None
                    self.remote.write_bytes(blob)
                self._info = info
                return
            except FileExistsError:
                h = self.holder()
                if attempt or not _gone(h):
                    raise RunLockedError(f"{self.remote.parent}: in use by {_describe(h)}; wait for it to finish "
                                         f"or use another {self.option} (if that process is gone, delete "
                                         f"{self.remote})") from None
                print(f"wsseg: taking over the stale lock object {self.remote} from {_describe(h)}: that process "
                      "is gone", file=self.stream)
                self.remote.unlink(missing_ok=True)

    def release(self) -> None:
        if self._fd is None:
            return
        key = str(self.path.resolve())
        RunLock._held[key] = RunLock._held.get(key, 1) - 1
        if self._fd == -1:
            self._fd = None
            return
        RunLock._held.pop(key, None)
        if self.remote is not None and self._info is not None:
            try:  # only our own object: a writer that took over a lock we held too long keeps its own
                if self.holder() == self._info:
                    self.remote.unlink(missing_ok=True)
            except OSError as e:
                print(f"wsseg: warning: could not delete the lock object {self.remote} ({e}); delete it before "
                      "the next command on this run directory", file=self.stream)
            self._info = None
        os.ftruncate(self._fd, 0)  # an empty file: released cleanly, not stale
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
