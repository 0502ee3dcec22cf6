"""What a process holds in memory, read from Linux's /proc (None or NaN where unreadable)."""
from __future__ import annotations

from pathlib import Path


def status_kb(pid: int | str, field: str) -> int | None:
    """A ``kB`` field (``VmHWM``: peak resident set, ``VmRSS``: resident set) of /proc/PID/status."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def pss_kb(pid: int | str) -> int | None:
    """Proportional set size (shared pages split between their users) of a process."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def rss_mb(field: str = "VmRSS") -> float:
    """This process's resident set size (``VmRSS``) or its peak (``VmHWM``), in MB."""
    kb = status_kb("self", field)
    return float("nan") if kb is None else kb / 1024


def reset_peak_rss() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux >= 4.0); False when not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False
