"""One writer per run directory; a second is refused at once, a stale lock is taken over."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from wsseg.tasks.store import RunLock, RunLockedError

ROOT = Path(__file__).resolve().parents[1]
HOLD = ("import sys, time; sys.path.insert(0, {root!r}); from wsseg.tasks.store import RunLock; "
        "l = RunLock({run!r}, 'wsseg train'); l.acquire(); print('held', flush=True); time.sleep(60)")


def _holder(run: Path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLD.format(root=str(ROOT), run=str(run))], stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_second_writer_is_refused_with_the_holder_named(tmp_path):
    with RunLock(tmp_path, "wsseg train"):
        with pytest.raises(RunLockedError) as e:
            RunLock(tmp_path, "wsseg ingest").acquire()
    msg = str(e.value)
    assert f"pid {os.getpid()}" in msg and "wsseg train" in msg and "started" in msg and "\n" not in msg
    with RunLock(tmp_path, "wsseg ingest"):  # released on exit: the next one gets it
        pass


def test_stale_lock_of_a_killed_process_is_taken_over(tmp_path, capsys):
    p = _holder(tmp_path)
    with pytest.raises(RunLockedError, match=f"pid {p.pid}"):
        RunLock(tmp_path, "wsseg train").acquire()
    p.send_signal(signal.SIGKILL)
    p.wait()
    with RunLock(tmp_path, "wsseg train"):
        assert "stale lock" in capsys.readouterr().err


def test_cli_refuses_a_second_writer_at_once(tmp_path):
    """`wsseg ingest` on a run directory that another command writes: one line naming the holder,
    within seconds, before any Prefect or Dask start."""
    run = tmp_path / "run"
    src = tmp_path / "src"
    src.mkdir()
    p = _holder(run)
    try:
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "wsseg", "ingest", str(src), "--run-dir", str(run)],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 2, out.stderr
        lines = [line for line in out.stderr.splitlines() if line.startswith("wsseg: error")]
        assert len(lines) == 1 and f"pid {p.pid}" in lines[0] and "in use" in lines[0], out.stderr
        assert len(out.stderr.strip().splitlines()) == 2  # what starts, then the error: nothing else
        assert not (run / "corpus").exists()
        print(f"refused in {time.perf_counter() - t0:.1f} s")
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize("argv, message", [
    (["train", "--run-dir", "{tmp}/empty"], "no corpus here"),
    (["train", "--run-dir", "{tmp}/empty", "--set", "proposals.t9=0.3"], "proposals.t9"),
    (["evaluate", "--run-dir", "{tmp}/empty"], "no corpus here"),
    (["ingest", "{tmp}/missing", "--run-dir", "{tmp}/empty"], "no such source folder"),
])
def test_input_mistakes_are_one_line_and_leave_nothing(tmp_path, argv, message):
    argv = [a.format(tmp=tmp_path) for a in argv]
    out = subprocess.run([sys.executable, "-m", "wsseg", *argv], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    # the first line says what starts (within a second or two), the second is the error
    assert len(lines) == 2 and lines[0].startswith("wsseg ") and "checking the input" in lines[0], out.stderr
    assert lines[1].startswith("wsseg: error:") and message in lines[1], out.stderr
    assert "Traceback" not in out.stderr and "Error logging" not in out.stderr
    assert not (tmp_path / "empty").exists()


def test_bench_highres_refuses_a_folder_another_command_writes(tmp_path):
    """`wsseg bench highres` keeps its Prefect and MLflow state beside its --out JSON: a second
    command on that folder is refused in one line naming the holder and the option to change (two at
    once broke the Prefect API's start or MLflow's database), and writes nothing."""
    from tests.test_highres import _synthetic_hrf

    _synthetic_hrf(tmp_path / "hrf")
    folder = tmp_path / "bench"
    p = _holder(folder)
    try:
        out = subprocess.run([sys.executable, "-m", "wsseg", "bench", "highres", "--data", str(tmp_path / "hrf"),
                              "--train-n", "3", "--eval-n", "1", "--patch-size", "16", "--steps", "2",
                              "--no-memory-probe", "--out", str(folder / "highres.json")],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert out.returncode == 2, out.stderr
        lines = [line for line in out.stderr.splitlines() if "error" in line]
        assert len(lines) == 1 and f"pid {p.pid}" in lines[0] and "another --out folder" in lines[0], out.stderr
        assert "Traceback" not in out.stderr and not (folder / "highres.json").exists()
    finally:
        p.kill()
        p.wait()


def test_bench_train_refuses_a_run_directory_another_command_writes(tmp_path):
    """`wsseg bench train` ingests its data into its --run-dir (runs/bench-train unless told): two
    at once (one network against another) would share one store; the second is refused in one line."""
    run = tmp_path / "run"
    p = _holder(run)
    try:
        out = subprocess.run([sys.executable, "-m", "wsseg", "bench", "train", "--network", "small", "--steps", "2",
                              "--out", str(tmp_path / "train.json"), "--run-dir", str(run)],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert out.returncode == 2, out.stderr
        lines = [line for line in out.stderr.splitlines() if line.startswith("wsseg: error")]
        assert len(lines) == 1 and f"pid {p.pid}" in lines[0] and "another --run-dir" in lines[0], out.stderr
        assert not (run / "corpus").exists() and not (tmp_path / "train.json").exists()
    finally:
        p.kill()
        p.wait()
