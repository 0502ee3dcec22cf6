"""Process set-up shared by every command: offline hygiene and the Dask cluster.

``prepare(run_dir)`` must run before prefect is imported: it points PREFECT_HOME, Dask's
scratch space and MLflow at the run directory, switches analytics and telemetry off, and keeps
Prefect's console logging quiet (our own progress lines are the terminal's view) while the flow
and task runs' INFO records (those progress lines too) reach the Prefect API.
"""
from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import Callable, Iterator


def prepare(run_dir: str | os.PathLike, *, verbose: bool = False) -> Path:
    run = Path(run_dir).resolve()
    run.mkdir(parents=True, exist_ok=True)
    env = {
        "PREFECT_HOME": str(run / ".prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        # Flow and task run loggers pass INFO on, so that the API handler sends each run's log
        # records (our progress lines among them) to Prefect, where the dashboard shows them;
        # the console handler (overriding logging.yml's handlers.console.level) keeps the
        # terminal at warnings unless --verbose, so the terminal shows only our own lines.
        "PREFECT_LOGGING_LEVEL": "INFO",
        "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "INFO" if verbose else "WARNING",
        "PREFECT_SERVER_LOGGING_LEVEL": "WARNING",
        # the commands' own local API servers need no dashboard (`wsseg ui` starts one with it)
        "PREFECT_UI_ENABLED": "false",
        "DASK_TEMPORARY_DIRECTORY": str(run / "dask-scratch"),
        "DASK_DISTRIBUTED__WORKER__DAEMON": "false",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DO_NOT_TRACK": "1",
        "DASK_LOGGING__DISTRIBUTED": "error",
        # the embedded Prefect API server runs its migrations on first start: give it time on
        # a busy two-core machine
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    }
    os.environ.update(env)
    # MLflow: tasks.tracking uses RUN/mlflow.db unless the user points MLFLOW_TRACKING_URI at a server
    return run


@contextlib.contextmanager
def prefect_api() -> Iterator[Callable[[], str | None]]:
    """One Prefect API for this command and its Dask workers; yields ``ready()``, which blocks
    until the API answers and returns its URL.

    Without ``PREFECT_API_URL`` every process that runs a task would start its own ephemeral
    server on the same database (measured: one uvicorn per worker, each busy); this starts one
    local server and exports its URL at once, so that workers started afterwards inherit it,
    and waits for it in a background thread: the server's start (15-28 s on 2 busy cores, its
    database migrations included) overlaps the Dask cluster's (10-25 s) instead of preceding it.
    """
    from prefect.settings import PREFECT_API_URL

    configured = os.environ.get("PREFECT_API_URL") or PREFECT_API_URL.value()
    if configured:  # a server the user (or a test harness) already runs: share it with the workers
        previous = os.environ.get("PREFECT_API_URL")
        os.environ["PREFECT_API_URL"] = configured
        try:
            yield lambda: configured
        finally:
            if previous is None:
                os.environ.pop("PREFECT_API_URL", None)
        return
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    server.port = server.find_available_port()  # the URL is known (and exported) before the start
    os.environ["PREFECT_API_URL"] = url = server.api_url
    errors: list[BaseException] = []

    def start() -> None:
        try:
            server.start(timeout=int(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")))
        except BaseException as e:  # re-raised by ready() in the caller's thread
            errors.append(e)

    thread = threading.Thread(target=start, name="prefect-api-start", daemon=True)
    thread.start()

    def ready() -> str:
        thread.join()
        if errors:
            raise RuntimeError(f"the local Prefect API server did not start: {errors[0]}") from errors[0]
        if server.api_url != url:  # the server had to move to another port after a clash
            raise RuntimeError(f"the local Prefect API server moved from {url} to {server.api_url} while "
                               "starting; run the command again")
        return url

    try:
        yield ready
    finally:
        thread.join()
        os.environ.pop("PREFECT_API_URL", None)
        server.stop()


@contextlib.contextmanager
def dask_cluster(address: str | None, n_workers: int, run_dir: Path) -> Iterator[str]:
    """The scheduler address to run shard tasks on: ``address`` if given, else a LocalCluster
    of one single-threaded worker process per core, closed on exit; both under one Prefect API
    (started while the cluster starts, ready when this yields)."""
    with prefect_api() as ready:
        if address:
            ready()
            yield address
            return
        import dask
        from distributed import LocalCluster

        with dask.config.set({"distributed.nanny.pre-spawn-environ": worker_environ()}), \
                LocalCluster(n_workers=n_workers, threads_per_worker=1, processes=True,
                             dashboard_address="127.0.0.1:0", local_directory=str(run_dir / "dask-scratch"),
                             silence_logs=40) as cluster:
            ready()
            yield cluster.scheduler_address


def worker_environ() -> dict:
    """The environment Dask's nanny gives our worker processes: its defaults (one BLAS/OpenMP
    thread) without ``MALLOC_TRIM_THRESHOLD_``. Setting that variable at all switches off
    glibc's adaptive mmap threshold, so every array above 128 KiB (a class-probability map of
    one photo is megabytes) is mapped and unmapped afresh and its pages faulted in again: the
    round-1 preliminary stage of msrc21 (276 images, 2 workers) took 41.8 s with it and 22.4 s
    without, with system time 40 s against 7 s (``tools/bench_workers.py`` measures it). The
    cost: a worker keeps freed memory for reuse instead of returning it at once."""
    import dask
    import distributed  # noqa: F401  (loads the distributed.* defaults into dask.config)

    env = dict(dask.config.get("distributed.nanny.pre-spawn-environ"))
    dask_value = env.pop("MALLOC_TRIM_THRESHOLD_", None)
    # a nanny also writes these variables into this process's environment, which later workers
    # inherit: drop Dask's value there too (a value of the user's own is kept)
    if dask_value is not None and os.environ.get("MALLOC_TRIM_THRESHOLD_") == str(dask_value):
        del os.environ["MALLOC_TRIM_THRESHOLD_"]
    return env


def on_cluster(flow_fn, address: str | None):
    """``flow_fn`` with its shard tasks on the Dask scheduler at ``address`` (unchanged when None:
    it keeps the task runner it was called with, or Prefect's default)."""
    if not address:
        return flow_fn
    from prefect_dask import DaskTaskRunner

    return flow_fn.with_options(task_runner=DaskTaskRunner(address=address))


# The watchdog of start_reaper(): it records the command's descendants while the command lives and
# ends those still running once it is gone (SIGTERM, then SIGKILL after 5 s).
_REAPER = """
import os, sys, time
import psutil
parent, me, seen = psutil.Process(int(sys.argv[1])), os.getpid(), {}
while True:
    try:
        if not parent.is_running() or parent.status() == psutil.STATUS_ZOMBIE:
            break
        for c in parent.children(recursive=True):
            if c.pid != me:
                seen[c.pid] = c.create_time()
    except psutil.NoSuchProcess:
        break
    time.sleep(0.5)
procs = []
for pid, started in seen.items():
    try:
        p = psutil.Process(pid)
        if p.create_time() == started:
            procs.append(p)
    except psutil.NoSuchProcess:
        pass
for p in procs:
    try:
        p.terminate()
    except psutil.NoSuchProcess:
        pass
gone, alive = psutil.wait_procs(procs, timeout=5)
for p in alive:
    try:
        p.kill()
    except psutil.NoSuchProcess:
        pass
"""


def start_reaper() -> None:
    """Start a watchdog process that ends this command's child processes (Dask workers and their
    nannies, the local Prefect API server, data-loader workers) when this process ends, however
    it ends: a SIGKILL gives the command itself no chance to stop them. The watchdog runs in a
    session of its own, so a Ctrl-C to the terminal's job reaches the command, not it."""
    import subprocess
    import sys

    subprocess.Popen([sys.executable, "-c", _REAPER, str(os.getpid())], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True)
