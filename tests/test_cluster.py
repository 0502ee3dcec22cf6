"""--dask-address against a real cluster: a `dask scheduler` and two `dask worker` processes on
127.0.0.1, started here the way a user starts them, run `wsseg ingest` and a round of `wsseg train`;
the shard tasks run on those workers, report to the command's Prefect API, and give the outputs of
the default local cluster bit for bit. Also: the bound on the number of shard tasks per stage."""
from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import KILL_IDS, TINY, copy_sample, run_outputs

from wsseg.flows.runtime import DASK_ENVIRON

ROOT = Path(__file__).resolve().parents[1]
DASK = Path(sys.executable).with_name("dask")  # the CLI of this environment's distributed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(procs: list[subprocess.Popen]) -> None:
    """End each process's whole group (the worker command, its nannies, their workers)."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        for p in procs:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        for p in procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass


@pytest.fixture(scope="module")
def external_cluster(tmp_path_factory):
    """``(address, home)``: a scheduler and two single-threaded worker processes, each in its own
    process group (ended at teardown whatever happens), run from a folder of their own with
    PREFECT_HOME ``home`` (so a worker that started a Prefect server of its own would leave its
    database there)."""
    from distributed import Client

    base = tmp_path_factory.mktemp("cluster")
    home = base / "worker-prefect"
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PREFECT_HOME=str(home))
    env.pop("PREFECT_API_URL", None)
    address = f"tcp://127.0.0.1:{_free_port()}"
    log = open(base / "cluster.log", "w")
    procs: list[subprocess.Popen] = []
    try:
        procs.append(subprocess.Popen([str(DASK), "scheduler", "--host", "127.0.0.1", "--port",
                                       address.rsplit(":", 1)[1], "--no-dashboard"], cwd=base,
                                      env=env | DASK_ENVIRON,  # as docs/large-corpora.md starts it
                                      stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        procs.append(subprocess.Popen([str(DASK), "worker", address, "--nworkers", "2", "--nthreads", "1",
                                       "--preload-nanny", "wsseg.flows.nanny", "--no-dashboard",
                                       "--local-directory", str(base / "workers")], cwd=base,
                                      env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        with Client(address, timeout=120, set_as_default=False) as client:
            client.wait_for_workers(2, timeout=300)
        yield address, home
    finally:
        _stop(procs)
        log.close()


def _wsseg(cwd: Path, *argv: str) -> None:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    env.pop("PREFECT_API_URL", None)  # each command starts its own Prefect API server, as a user's would
    res = subprocess.run([sys.executable, "-m", "wsseg", *argv], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=1200)
    assert res.returncode == 0, f"wsseg {' '.join(argv)} failed ({res.returncode}):\n{res.stderr[-3000:]}"


def _task_runs(run: Path) -> dict[str, list[str]]:
    """{stage: [state types]} of the shard task runs recorded in the run directory's Prefect
    database (the API server of the commands that ran there); a shard task run is named
    ``[round-R/]STAGE FIRST..LAST (N images)`` (flows/naming.py)."""
    with sqlite3.connect(run / ".prefect" / "prefect.db") as db:
        rows = db.execute("SELECT name, state_type FROM task_run").fetchall()
    out: dict[str, list[str]] = {}
    for name, state in rows:
        out.setdefault(name.split("/")[-1].split(" ")[0], []).append(state)
    return out


def test_ingest_and_a_round_on_an_existing_cluster_equal_the_local_cluster(tmp_path, external_cluster, tiny_reference):
    from distributed import Client

    address, worker_home = external_cluster
    src = copy_sample(tmp_path / "src", KILL_IDS)
    (tmp_path / "tiny.json").write_text(json.dumps(TINY))  # shard_size 2: 3 shards per stage
    # relative paths, from a folder that is not the workers': the command passes them on resolved
    _wsseg(tmp_path, "ingest", "src", "--run-dir", "ext", "--shard-size", "2", "--dask-address", address)
    _wsseg(tmp_path, "train", "--run-dir", "ext", "--config", "tiny.json", "--dask-address", address)
    # the reference: the same training on a local cluster, with other shards (the outputs do not depend on them)
    got, want = run_outputs(tmp_path / "ext"), tiny_reference
    assert len(got) > len(KILL_IDS) and got.keys() == want.keys()
    assert [k for k in want if got[k] != want[k]] == []

    # the shard tasks ran on the two external workers, none on a cluster of the command's own ...
    with Client(address, timeout=60, set_as_default=False) as client:
        executed = client.run(lambda dask_worker: dask_worker.state.executed_count)
        # the workers' environment came from the nanny preload flows.nanny, as the local cluster's does
        env = client.run(lambda: {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MALLOC_TRIM_THRESHOLD_",
                                                                 "ONEDNN_PRIMITIVE_CACHE_CAPACITY")})
    assert all(e == {"OMP_NUM_THREADS": "1", "MALLOC_TRIM_THRESHOLD_": None, "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"}
               for e in env.values()), env
    assert len(executed) == 2 and all(n > 0 for n in executed.values()), executed
    assert not list((tmp_path / "ext").glob("dask-scratch/**/worker-*"))
    # ... and reported to the command's Prefect API: every shard task of the run is recorded there,
    # completed, and no worker started a Prefect server of its own
    runs = _task_runs(tmp_path / "ext")
    shards = {"ingest", "features", "preliminary", "pseudo-labels", "evaluate"}
    assert shards <= set(runs), runs
    assert all(len(runs[name]) == 3 for name in shards - {"evaluate"}), runs
    assert all(s == "COMPLETED" for states in runs.values() for s in states), runs
    assert sum(executed.values()) >= sum(len(runs[name]) for name in shards)
    assert not list(worker_home.glob("**/*.db"))


def test_a_wrong_address_is_one_line(tmp_path):
    src = copy_sample(tmp_path / "src", KILL_IDS[:1])
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    address = f"tcp://127.0.0.1:{_free_port()}"  # nothing listens there
    res = subprocess.run([sys.executable, "-m", "wsseg", "ingest", str(src), "--run-dir", str(tmp_path / "run"),
                          "--dask-address", address], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1].startswith(f"wsseg: error: --dask-address {address}: no Dask scheduler")


def test_a_scheduler_that_keeps_its_messages_gets_a_note(tmp_path, capsys):
    """A scheduler started without DASK_ENVIRON keeps its last 1000 messages to each worker, each
    shard task's arguments with them: the command goes on, with one line saying how to start it;
    started as the docs say, no line."""
    from wsseg.flows.runtime import check_cluster

    bare = {k: v for k, v in os.environ.items() if k not in DASK_ENVIRON}
    for env, noted in ((bare, True), (bare | DASK_ENVIRON, False)):
        port = _free_port()
        proc = subprocess.Popen([str(DASK), "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"],
                                cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            deadline = time.monotonic() + 120
            while True:  # until it listens
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    assert time.monotonic() < deadline and proc.poll() is None, "the scheduler did not start"
                    time.sleep(0.5)
            check_cluster(f"tcp://127.0.0.1:{port}", tmp_path)
            err = capsys.readouterr().err
            assert "has no worker yet" in err
            lines = [x for x in err.splitlines() if "keeps its last" in x]
            if noted:
                assert len(lines) == 1 and "keeps its last 1000 messages to each worker" in lines[0] and \
                    "DASK_DISTRIBUTED__ADMIN__LOW_LEVEL_LOG_LENGTH=0" in lines[0], err
            else:
                assert not lines, err
        finally:
            _stop([proc])


def test_shard_tasks_per_stage_are_bounded():
    """At 10^6 images a stage has at most ``max_shards`` shard tasks, each image in exactly one,
    in order; a corpus below ``shard_size * max_shards`` keeps the configured shards."""
    from collections import namedtuple

    from wsseg.flows.wsss import shards_of
    from wsseg.tasks.config import WSSSConfig, shard_size_for

    cfg = WSSSConfig()
    n = 1_000_000
    record = namedtuple("record", "image_id")  # all shards_of reads of an ImageRecord
    records = [record(f"img{i:07d}") for i in range(n)]
    shards = shards_of(records, cfg.shard_size, cfg.max_shards)
    assert len(shards) <= cfg.max_shards == 2000
    assert len(shards) == 2000 and {len(s) for s in shards} == {500}  # 10^6 / 2000
    assert [i for s in shards for i in s] == [r.image_id for r in records]
    small = records[:cfg.shard_size * cfg.max_shards]
    assert shard_size_for(len(small), cfg.shard_size, cfg.max_shards) == cfg.shard_size
    first = [r.image_id for r in records[:100]]
    assert shards_of(records[:100], 16, 2000) == [first[i:i + 16] for i in range(0, 100, 16)]
    assert len(shards_of(records[:10_001], 1, 100)) == 100  # ceil(10001 / 101) shards of 101


def test_shard_tasks_take_their_rows_from_the_flow_not_the_manifest(tmp_path, prefect_harness, cluster):
    """A stage's shard tasks are handed their images' manifest rows by the flow, which has read them
    already: with the manifest file gone after that, the features stage on the cluster's workers
    still computes every image (a task that read the manifest would fail on the missing file). Rows
    that are not the shard's are refused, and a caller without rows reads the manifest."""
    from prefect import flow

    from wsseg.flows.runtime import on_cluster
    from wsseg.flows.wsss import compute_all_features, ingest
    from wsseg.tasks.config import WSSSConfig
    from wsseg.tasks.store import Store, shard_records
    from wsseg.tasks.wsss.feature_cache import FEATURE_STAGE

    config = WSSSConfig.model_validate({"shard_size": 2})
    run = tmp_path / "run"
    on_cluster(ingest, cluster)(str(copy_sample(tmp_path / "src", KILL_IDS)), str(run), shard_size=8)
    store = Store(run)
    records = store.manifest()
    ids = [r.image_id for r in records[:2]]
    assert shard_records(store, ids) == records[:2]  # read from the manifest
    manifest = store.corpus_dir / "manifest.parquet"
    manifest.rename(manifest.with_name("manifest.moved"))

    @flow(name="features-without-the-manifest")
    def features(run_dir: str) -> str:
        return compute_all_features(run_dir, records, config)

    key = on_cluster(features, cluster)(str(run))
    assert len(records) == len(KILL_IDS) and all(store.has_cached(FEATURE_STAGE, key, r.sha256) for r in records)
    assert shard_records(store, ids, records[:2]) == records[:2]
    with pytest.raises(ValueError, match=f"shard of {ids[0]}"):
        shard_records(store, ids, records[1:3])
    with pytest.raises(FileNotFoundError, match="manifest.parquet"):
        shard_records(store, ids)
