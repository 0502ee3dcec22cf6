"""Faults: a command killed with SIGKILL takes its processes with it and resumes exactly; a worker
killed mid-stage changes nothing."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import KILL_IDS, TINY, copy_sample, run_outputs


ROOT = Path(__file__).resolve().parents[1]


def _wsseg(*argv, env=None, **kw):
    return subprocess.Popen([sys.executable, "-m", "wsseg", *argv], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **kw)


def _alive(procs: dict[int, float]) -> dict[int, float]:
    out = {}
    for pid, t in procs.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == t and p.status() != psutil.STATUS_ZOMBIE:
                out[pid] = t
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.command("train")
def test_sigkill_ends_the_child_processes_and_the_rerun_resumes_bit_identically(tmp_path, prefect_harness,
                                                                               cluster, tiny_reference):
    """`wsseg train` killed with SIGKILL mid-run: its Dask workers, nannies, Prefect API server and
    loader processes end with it (a watchdog does it), and running the same command again
    resumes and gives exactly the outputs of a run that was never killed (``tiny_reference``)."""
    import json

    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    env.pop("PREFECT_API_URL", None)  # each command starts its own Prefect API server, as a user's would
    src = copy_sample(tmp_path / "src", KILL_IDS)
    (tmp_path / "tiny.json").write_text(json.dumps(TINY))
    train = ["--config", str(tmp_path / "tiny.json"), "--workers", "2"]
    from wsseg.flows.runtime import on_cluster
    from wsseg.flows.wsss import ingest

    # the corpus (in this process: ingest is not what is tested)
    on_cluster(ingest, cluster)(str(src), str(tmp_path / "killed"), shard_size=8)

    run = tmp_path / "killed"
    cmd = _wsseg("train", "--run-dir", str(run), *train, env=env)
    main = psutil.Process(cmd.pid)
    children: dict[int, float] = {}
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # until the work runs: shard tasks have written features
            kids = [c for c in main.children(recursive=True) if "psutil" not in " ".join(c.cmdline())]
            children |= {c.pid: c.create_time() for c in kids}
            if len(kids) >= 5 and any((run / "cache").glob("*/packs/*.json")):
                break
            assert cmd.poll() is None, "the command ended before it could be killed"
            time.sleep(0.2)
        assert len(children) >= 5, f"expected workers, nannies and the Prefect server, got {children}"
        assert not (run / "summary.json").exists()
        cmd.send_signal(signal.SIGKILL)
        cmd.wait()
        deadline = time.monotonic() + 30
        while _alive(children) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _alive(children), f"still running after the command was killed: {_alive(children)}"
    finally:
        if cmd.poll() is None:
            cmd.kill()
        for pid in _alive(children):
            psutil.Process(pid).kill()
    assert _wsseg("train", "--run-dir", str(run), *train, env=env).wait(timeout=600) == 0
    got = run_outputs(run)
    assert got.keys() == tiny_reference.keys() and all(got[k] == tiny_reference[k] for k in tiny_reference)


# ---------------------------------------------------------------------------- a worker killed mid-stage

def _cached_arrays(run: Path) -> dict[str, bytes]:
    """Every cached feature array of a run, by its name under the cache (content-addressed), as
    the packs' indexes list them (a shard's pack is whole or absent)."""
    import json

    from wsseg.tasks.store import packs

    out = {}
    for group in sorted(p for p in (run / "cache").iterdir() if (p / packs.INDEX_FILE).exists()):
        ix = packs.GroupIndex(group)
        ix.refresh()
        for idx in sorted((group / "packs").glob("*.json")):
            for name in json.loads(idx.read_text())["entries"]:
                out[f"{group.name}/{name}"] = ix.read(name)[0].tobytes()
    return out


def test_a_worker_killed_mid_stage_changes_nothing(tmp_path, prefect_harness, cluster):
    """The features stage with one of two workers killed (SIGKILL) while it runs: the stage
    completes (Dask's nanny restarts the worker and the shard is run again) and every cached
    array is bit-identical to an undisturbed run's."""
    import threading

    from distributed import Client
    from prefect import flow

    from conftest import copy_sample
    from wsseg.flows.runtime import on_cluster
    from wsseg.flows.wsss import compute_all_features, ingest
    from wsseg.tasks.config import WSSSConfig
    from wsseg.tasks.store import Store

    config = WSSSConfig.model_validate({"shard_size": 1})

    @flow(name="features-under-fault")
    def features(run_dir: str) -> str:
        return compute_all_features(run_dir, Store(run_dir).manifest(), config)

    src = copy_sample(tmp_path / "src", KILL_IDS)
    runs = {}
    for name, kill in (("undisturbed", False), ("killed", True)):
        run = tmp_path / name
        on_cluster(ingest, cluster)(str(src), str(run), shard_size=8)
        killer = None
        if kill:
            with Client(cluster) as client:
                pids = sorted(client.run(os.getpid).values())

            def shoot() -> None:  # once the stage is under way: a shard's cache entry has appeared
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline and not any((run / "cache").glob("*/packs/*.json")):
                    time.sleep(0.05)
                os.kill(pids[0], signal.SIGKILL)

            killer = threading.Thread(target=shoot)
            killer.start()
        on_cluster(features, cluster)(str(run))
        if killer is not None:
            killer.join()
            assert not psutil.pid_exists(pids[0]) or psutil.Process(pids[0]).status() == psutil.STATUS_ZOMBIE
        runs[name] = _cached_arrays(run)
    assert runs["killed"] and runs["killed"].keys() == runs["undisturbed"].keys()
    assert all(runs["killed"][k] == runs["undisturbed"][k] for k in runs["undisturbed"])


def test_prefect_server_gone_mid_run_keeps_the_outputs_and_says_what_was_not_recorded(tmp_path, prefect_harness,
                                                                                      cluster):
    """The user's Prefect server dies while `wsseg train` runs: the command ends with one error
    line saying what could not be recorded and how to resume; what was computed is on disk."""
    import json
    import socket
    import urllib.request

    from conftest import copy_sample
    from wsseg.flows.runtime import on_cluster
    from wsseg.flows.wsss import ingest

    run = tmp_path / "run"
    on_cluster(ingest, cluster)(str(copy_sample(tmp_path / "src", KILL_IDS)), str(run), shard_size=8)
    (tmp_path / "tiny.json").write_text(json.dumps(TINY))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PREFECT_HOME=str(tmp_path / "server"),
               PREFECT_API_URL=f"http://127.0.0.1:{port}/api", PREFECT_CLIENT_MAX_RETRIES="1")
    server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                               str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    cmd = None
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        cmd = subprocess.Popen([sys.executable, "-m", "wsseg", "train", "--run-dir", str(run), "--config",
                                str(tmp_path / "tiny.json"), "--workers", "2"], cwd=ROOT, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not any((run / "cache").glob("*/packs/*.json")):
            assert cmd.poll() is None, cmd.stderr.read()
            time.sleep(0.2)
        os.killpg(server.pid, signal.SIGKILL)  # the server and its children
        server.wait()
        err = cmd.communicate(timeout=300)[1]
        assert cmd.returncode == 3, err[-3000:]
        ours = [line for line in err.splitlines() if line.startswith("wsseg: error:")]
        assert len(ours) == 1 and "stopped answering" in ours[0] and "could not be recorded" in ours[0], err[-3000:]
        assert str(run) in ours[0] and "resume" in ours[0]
        assert any((run / "cache").glob("*/packs/*.json"))  # what was computed stays
    finally:
        for p in (cmd, server):
            if p is not None and p.poll() is None:
                p.kill()
        try:
            os.killpg(server.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# A command that starts a grandchild which leaves its parent (an orphan, as a worker's own helper becomes
# when the worker dies) and is then SIGKILLed before the watchdog's first look: the orphan is not among the
# command's descendants any more when the watchdog notices, only the token in its environment says whose it is.
_ORPHANING = """
import os, signal, subprocess, sys, time
sys.path.insert(0, sys.argv[1])
from wsseg.flows.runtime import start_reaper
start_reaper()
r, w = os.pipe()
if os.fork() == 0:  # the child starts the grandchild and leaves at once: the grandchild is an orphan
    os.close(r)
    g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    os.write(w, str(g.pid).encode())
    os._exit(0)
os.close(w)
print(os.read(r, 64).decode(), flush=True)
os.wait()
os.kill(os.getpid(), signal.SIGKILL)
"""


def _assert_ended_within(proc: psutil.Process, seconds: float, message: str) -> None:
    """Wait up to ``seconds`` for ``proc`` to end (the watchdog's work), failing with ``message``
    otherwise; a process left running is killed either way."""
    started = proc.create_time()
    try:
        deadline = time.monotonic() + seconds
        while _alive({proc.pid: started}) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive({proc.pid: started}), message
    finally:
        if _alive({proc.pid: started}):
            proc.kill()


def test_the_watchdog_ends_an_orphan_the_command_left_before_it_was_killed():
    proc = subprocess.run([sys.executable, "-c", _ORPHANING, str(ROOT)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    orphan = psutil.Process(int(proc.stdout.strip()))
    assert orphan.ppid() != os.getpid()
    _assert_ended_within(orphan, 30, "the orphan outlived the killed command")


# A command that forks a child without exec (as a data loader's worker is started) and is SIGKILLed
# before the watchdog's first look: the fork's environment, as the kernel shows it, is the command's
# as it was started, without the token; only the fork's own report to the watchdog says whose it is.
_FORKING = """
import os, signal, sys, time
sys.path.insert(0, sys.argv[1])
from wsseg.flows.runtime import start_reaper
start_reaper()
pid = os.fork()
if pid == 0:  # the fork lets go of the captured output, so that only the fork itself is waited for
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    time.sleep(600)
    os._exit(0)
print(pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_the_watchdog_ends_a_fork_the_command_started_just_before_it_was_killed():
    proc = subprocess.run([sys.executable, "-c", _FORKING, str(ROOT)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    fork = psutil.Process(int(proc.stdout.strip()))
    assert "WSSEG_REAPER_TOKEN" not in fork.environ()  # what the watchdog's scan by token cannot see
    _assert_ended_within(fork, 30, "the fork outlived the killed command")
