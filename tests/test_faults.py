"""Faults: a command killed with SIGKILL takes its Dask workers and Prefect server with it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]


def test_sigkill_of_the_command_ends_its_child_processes(tmp_path):
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    env.pop("PREFECT_API_URL", None)  # the command starts its own Prefect API server, as a user's would
    cmd = subprocess.Popen([sys.executable, "-m", "flows.cli", "demo", "--run-dir", str(tmp_path / "run"),
                            "--workers", "2"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    main = psutil.Process(cmd.pid)
    children: dict[int, float] = {}
    deadline = time.monotonic() + 240
    try:
        # wait until the work runs: two Dask workers (each under a nanny) and the Prefect server
        while time.monotonic() < deadline:
            kids = [c for c in main.children(recursive=True) if "psutil" not in " ".join(c.cmdline())]
            children = {c.pid: c.create_time() for c in kids}
            if len(kids) >= 5:
                break
            assert cmd.poll() is None, "the demo ended before it could be killed"
            time.sleep(1)
        assert len(children) >= 5, f"expected workers, nannies and the Prefect server, got {children}"
        cmd.send_signal(signal.SIGKILL)
        cmd.wait()
        deadline = time.monotonic() + 30
        alive = children
        while alive and time.monotonic() < deadline:
            alive = {pid: t for pid, t in children.items() if psutil.pid_exists(pid)
                     and psutil.Process(pid).create_time() == t
                     and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE}
            time.sleep(0.5)
        assert not alive, f"still running after the command was killed: {alive}"
    finally:
        if cmd.poll() is None:
            cmd.kill()
        for pid in children:
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass
