"""What a Dask scheduler keeps of the shard tasks it has run: with Dask's default debugging log of
its messages to each worker (``distributed.admin.low-level-log-length`` 1000) against wsseg's
(``flows.runtime.DASK_LOG_LENGTH``, 0), issue 54.

    python tools/bench_scheduler_memory.py --tasks 200 --waves 4

For each setting it starts ``dask scheduler`` (with ``DASK_DISTRIBUTED__ADMIN__LOW_LEVEL_LOG_LENGTH``
set, or not) and two single-threaded ``dask worker`` processes, and runs a Prefect flow that submits
``--tasks`` trivial shard tasks of 32 ids through ``flows.wsss.run_shards``, in ``--waves`` calls
(a flow's stages). After each wave it asks the scheduler for its RSS, the tasks it still knows,
the messages its worker streams keep and the Prefect task objects alive in it (each task's
message carries one, with the task's arguments and the flow run's context). Prints a Markdown
table; nothing is written.

The workers import this file by name (it puts its folder on their ``PYTHONPATH``): a task's
function is pickled by reference.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def shard_fn(ids: list[str], items: dict | None = None) -> int:
    return len(ids)


def scheduler_figures(dask_scheduler) -> dict:
    import gc
    import os as _os

    import psutil

    prefect_tasks = sum(1 for o in gc.get_objects() if type(o).__qualname__ == "Task" and
                        type(o).__module__ == "prefect.tasks")
    kept = sum(len(s.recent_message_log) for s in dask_scheduler.stream_comms.values())
    return {"rss_mb": psutil.Process(_os.getpid()).memory_info().rss / 2 ** 20, "tasks": len(dask_scheduler.tasks),
            "kept_messages": kept, "prefect_tasks": prefect_tasks}


def make_flow():
    from prefect import flow, task

    from wsseg.flows.wsss import SHARD_TASK, run_shards

    shard_task = task(name="bench-shard", **SHARD_TASK)(shard_fn)

    @flow(name="bench-scheduler-memory")
    def waves(n: int, k: int) -> list[dict]:
        from prefect.context import FlowRunContext

        client = FlowRunContext.get().task_runner.client
        ids = [f"img{i:07d}" for i in range(n * 32)]
        shards = [ids[i:i + 32] for i in range(0, len(ids), 32)]
        out = []
        for w in range(k):
            run_shards(shard_task, shards[w * n // k:(w + 1) * n // k], f"wave {w + 1}",
                       per_shard=lambda s: {"items": {i: {"tags": ["a"]} for i in s}})
            out.append(client.run_on_scheduler(scheduler_figures) | {"after": (w + 1) * n // k})
        return out

    return waves


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(log_length: int | None, n: int, k: int) -> list[dict]:
    from distributed import Client

    import bench_scheduler_memory as me  # this file by name: its functions pickle by reference
    from wsseg.flows.runtime import on_cluster, prefect_api

    dask = Path(sys.executable).with_name("dask")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    env.pop("DASK_DISTRIBUTED__ADMIN__LOW_LEVEL_LOG_LENGTH", None)
    senv = env if log_length is None else env | {"DASK_DISTRIBUTED__ADMIN__LOW_LEVEL_LOG_LENGTH": str(log_length)}
    port = _port()
    address = f"tcp://127.0.0.1:{port}"
    procs = [subprocess.Popen([str(dask), "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"],
                              env=senv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)]
    try:
        with prefect_api() as ready:
            ready()
            procs.append(subprocess.Popen([str(dask), "worker", address, "--nworkers", "2", "--nthreads", "1",
                                           "--no-dashboard"], env=env | {"PREFECT_API_URL": os.environ["PREFECT_API_URL"]},
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
            with Client(address, timeout=120, set_as_default=False) as client:
                client.wait_for_workers(2, timeout=300)
                client.run_on_scheduler(lambda dask_scheduler: __import__("wsseg.flows.wsss"))  # imported before timing
            return on_cluster(me.make_flow(), address)(n, k)
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, 15)
            except ProcessLookupError:
                pass
        for p in procs:
            p.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=200, help="shard tasks in all (default 200)")
    ap.add_argument("--waves", type=int, default=4, help="calls of run_shards, measured after each (default 4)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(HERE))
    from wsseg.flows.runtime import DASK_LOG_LENGTH, prepare, quiet_libraries

    prepare(Path(tempfile.mkdtemp(prefix="bench-scheduler-")))
    quiet_libraries()
    rows = []
    for label, length in (("Dask's default (1000)", None), (f"wsseg's ({DASK_LOG_LENGTH})", DASK_LOG_LENGTH)):
        t = time.perf_counter()
        for fig in measure(length, args.tasks, args.waves):
            rows.append((label, fig))
        print(f"{label}: {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    print("| message log | tasks run | scheduler RSS MB | messages kept | Prefect task objects | tasks known |")
    print("|---|---|---|---|---|---|")
    for label, f in rows:
        print(f"| {label} | {f['after']} | {f['rss_mb']:.0f} | {f['kept_messages']} | {f['prefect_tasks']} | {f['tasks']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
