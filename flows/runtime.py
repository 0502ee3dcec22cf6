"""Process set-up shared by every command: offline hygiene and the Dask cluster.

``prepare(run_dir)`` must run before prefect is imported: it points PREFECT_HOME, Dask's
scratch space and MLflow at the run directory, switches analytics and telemetry off, and keeps
Prefect's console logging quiet (our own progress lines are the terminal's view) while the flow
and task runs' INFO records (those progress lines too) reach the Prefect API. The libraries' own
log lines (Prefect's, MLflow's "Creating initial MLflow database tables...", alembic's, Dask's,
urllib3's) reach the terminal only with ``--verbose`` (but for Dask's and MLflow's errors): in this
process (:func:`quiet_libraries`) and in the worker processes, which inherit the environment it sets.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Callable, Iterator


def prepare(run_dir: str | os.PathLike, *, verbose: bool = False) -> Path:
    from wsseg.tasks.store.remote import state_dir_for

    run = state_dir_for(run_dir)  # the run directory itself, or a URL's local state folder (tasks.store)
    run.mkdir(parents=True, exist_ok=True)
    env = {
        "PREFECT_HOME": str(run / ".prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        # Flow and task run loggers pass INFO on, so that the API handler sends each run's log
        # records (our progress lines among them) to Prefect, where the dashboard shows them;
        # the console handler (overriding logging.yml's handlers.console.level) keeps them off
        # the terminal unless --verbose, so the terminal shows only our own lines
        "PREFECT_LOGGING_LEVEL": "INFO",
        # (also the console handler of the root logger, where the records of the libraries without a
        # handler of their own end: alembic's, urllib3's, httpx's). Its errors too: what fails reaches
        # the terminal as wsseg's own error line, or as the traceback wsseg raises for a bug.
        "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "INFO" if verbose else "CRITICAL",
        "PREFECT_SERVER_LOGGING_LEVEL": "WARNING",
        # the commands' own local API servers need no dashboard (`wsseg ui` starts one with it)
        "PREFECT_UI_ENABLED": "false",
        "DASK_TEMPORARY_DIRECTORY": str(run / "dask-scratch"),
        "DASK_DISTRIBUTED__WORKER__DAEMON": "false",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        # MLflow's own handler (its INFO lines on a new mlflow.db, its warnings when it logs a model)
        # and alembic's level, which MLflow sets from it; read when mlflow is imported
        "MLFLOW_LOGGING_LEVEL": "INFO" if verbose else "ERROR",
        "DO_NOT_TRACK": "1",
        "DASK_LOGGING__DISTRIBUTED": "warning" if verbose else "error",
        # the embedded Prefect API server runs its migrations on first start: give it time on
        # a busy two-core machine (a user's own setting wins)
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": os.environ.get(
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180"),
    }
    os.environ.update(env)
    quiet_libraries(verbose)
    system_arrow_pool()
    # MLflow: tasks.runtime.tracking uses RUN/mlflow.db unless the user points MLFLOW_TRACKING_URI at a server
    return run


def system_arrow_pool() -> None:
    """pyarrow's buffers from the C library's allocator in this process and the processes it starts
    (a local cluster's workers, the Prefect server), unless the user chose one in
    ``ARROW_DEFAULT_MEMORY_POOL``. pyarrow's default, mimalloc, keeps what a read freed: a command
    streaming the manifest of 2 x 10^4 images (`wsseg export`) peaked 18 MB higher than at 10^3
    images with it and 10 MB higher with the system's (docs/large-corpora.md#the-manifest-read)."""
    if os.environ.get("ARROW_DEFAULT_MEMORY_POOL"):
        return
    os.environ["ARROW_DEFAULT_MEMORY_POOL"] = "system"  # read when pyarrow is imported: here later, the children
    pa = sys.modules.get("pyarrow")
    if pa is not None:  # imported already: its default pool is set (nothing imported for a command without it)
        pa.set_memory_pool(pa.system_memory_pool())


#: the loggers of the libraries under the commands, by the level they print at without --verbose
#: (errors only) and with it (their own defaults: MLflow's INFO; WARNING for alembic, as MLflow sets
#: it; the others pass their records to the root logger, whose handler Prefect's settings level)
LIBRARY_LOGGERS = {"mlflow": logging.INFO, "alembic": logging.WARNING, "huey": logging.WARNING,
                   "distributed": logging.WARNING, "urllib3": logging.NOTSET, "httpx": logging.NOTSET,
                   "httpcore": logging.NOTSET, "uvicorn": logging.NOTSET, "sqlalchemy": logging.NOTSET}


def quiet_libraries(verbose: bool = False) -> None:
    """The libraries' loggers in this process at ERROR, or with ``verbose`` at their defaults
    (:data:`LIBRARY_LOGGERS`): for those set up before :func:`prepare` set the environment they read
    (MLflow configures its loggers when imported). Prefect's own loggers keep passing INFO on (to
    the Prefect API); its console handler's level, from the environment, keeps them off the terminal."""
    for name, default in LIBRARY_LOGGERS.items():
        logging.getLogger(name).setLevel(default if verbose else logging.ERROR)


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
        if not errors:  # send this process's queued logs and events while the server still answers:
            _drain_prefect_services()  # left to the interpreter's exit, they retried a stopped server for minutes
        os.environ.pop("PREFECT_API_URL", None)
        server.stop()


def _drain_prefect_services(timeout: float = 30.0) -> None:
    """Flush Prefect's API log and event workers of this process (they send in the background)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for service in (APILogWorker, EventsWorker):
        try:
            service.drain_all(timeout=timeout)
        except Exception:  # a flush that fails must not hide the command's own result or error
            pass


#: How many of its recent messages a Dask process keeps for debugging
#: (``distributed.admin.low-level-log-length``, 1000 by default). A scheduler keeps them per worker
#: stream, and each shard task's message carries the task's arguments (its shard's rows) and the
#: flow run's context: the scheduler held every task's arguments up to about 500 tasks a worker
#: (`wsseg bench scale`, 2 x 10^4 images: 944 messages for 938 task runs; with 128 workers that is
#: every task of a run's first stages). wsseg's own clusters keep none; an existing cluster's
#: scheduler is started with :data:`DASK_ENVIRON` (docs/large-corpora.md#existing-dask-cluster).
DASK_LOG_LENGTH = 0
#: the environment variable that sets :data:`DASK_LOG_LENGTH` in a ``dask scheduler`` or ``dask worker``
DASK_ENVIRON = {"DASK_DISTRIBUTED__ADMIN__LOW_LEVEL_LOG_LENGTH": str(DASK_LOG_LENGTH)}
#: Compiled oneDNN kernels a worker keeps (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, 1024 by default).
#: torch's CPU convolutions compile one per layer and input shape, and a corpus of photos has
#: almost as many shapes as images: a process running round 0's CAM pass over msrc21 images at
#: 300 sizes rose from 1.1 to 2.2 GB, at 40 sizes it stayed at 0.7 GB, and at 300 sizes with 64
#: kernels kept at 0.72 GB in the same CPU time (54.8 against 57.4 core-s; 2026-12-07,
#: docs/large-corpora.md#memory). The trainers, which see few shapes, run in the command's process
#: and keep the default.
ONEDNN_KERNELS = 64


@contextlib.contextmanager
def dask_cluster(address: str | None, n_workers: int, run_dir: Path) -> Iterator[str]:
    """The scheduler address to run shard tasks on: ``address`` if given (an existing cluster,
    checked first: :func:`check_cluster`), else a LocalCluster
    of one single-threaded worker process per core, closed on exit; both under one Prefect API
    (started while the cluster starts, ready when this yields)."""
    if address:  # before the Prefect API starts: a wrong address is refused in seconds
        check_cluster(address, run_dir)
    with prefect_api() as ready:
        if address:
            with api_in_task_context(ready()):
                yield address
            return
        import dask
        from distributed import LocalCluster

        with dask.config.set({"distributed.nanny.pre-spawn-environ": worker_environ(),
                              "distributed.admin.low-level-log-length": DASK_LOG_LENGTH}), \
                LocalCluster(n_workers=n_workers, threads_per_worker=1, processes=True,
                             dashboard_address="127.0.0.1:0", local_directory=str(state_dir(run_dir) / "dask-scratch"),
                             silence_logs=40) as cluster:
            ready()
            yield cluster.scheduler_address


@contextlib.contextmanager
def api_in_task_context(url: str) -> Iterator[None]:
    """Prefect's settings context with the API ``url``, for the workers of an existing cluster.

    They do not inherit this process's environment: each runs a task in the settings context
    that comes with it (prefect_dask), which was made when prefect was imported, before the URL
    was known; without it every worker started a temporary Prefect server of its own (2 to 5
    minutes each on 2 busy cores) and the task runs went there, not to the command's API. With
    the URL set, this process's events go to that server too, so they are sent (drained) here,
    while it still answers: left to the interpreter's exit they waited on it for minutes."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    try:
        with temporary_settings(updates={PREFECT_API_URL: url}):
            yield
    finally:
        _drain_prefect_services(60)


def _refused(address: str, timeout: float = 5.0) -> str | None:
    """Why a TCP connection to the scheduler ``address`` (``tcp://`` or ``tls://``) fails at once
    (refused, unknown host), or None when it connects or the address is of another kind. A
    listening scheduler that is slow to answer is left to the client's own timeout."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(address if "://" in address else f"tcp://{address}")
    if parts.scheme not in ("tcp", "tls") or not parts.hostname or parts.port is None:
        return None
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=timeout):
            return None
    except socket.timeout:
        return None
    except OSError as e:
        return e.strerror or str(e)


#: above how many kept messages a worker stream (:data:`DASK_LOG_LENGTH`) an existing scheduler gets a note
LOG_LENGTH_NOTE = 100


def check_cluster(address: str, run_dir, timeout: float = 30.0) -> None:
    """Refuse, with one line, an existing Dask cluster the shard tasks cannot run on: no scheduler
    answering at ``address`` within ``timeout`` seconds, or a scheduler or worker without this
    version of wsseg (both unpickle the tasks, which name its functions) or, for a local run
    directory, without it at the same path. A cluster with no worker yet passes, with a line on
    the terminal (an adaptive one starts them on demand); so does a scheduler that keeps more
    than :data:`LOG_LENGTH_NOTE` messages a worker (:data:`DASK_LOG_LENGTH`), with how to start it."""
    from importlib.metadata import PackageNotFoundError, version

    from distributed import Client

    def probe(path: str | None) -> dict:  # runs on the scheduler and each worker: by value, stdlib only
        import os as _os
        from importlib.metadata import PackageNotFoundError as _Missing, version as _version

        try:
            v = _version("wsseg")
        except _Missing:
            v = None
        try:
            import dask as _dask

            kept = _dask.config.get("distributed.admin.low-level-log-length")
        except Exception:
            kept = None
        return {"wsseg": v, "run_dir": path is None or _os.path.isdir(path), "log_length": kept}

    try:
        mine = version("wsseg")
    except PackageNotFoundError:
        mine = None
    # a run directory on object storage (a URL) is reached by its URL; a local one must be shared
    path = None if ":/" in str(run_dir) else str(Path(run_dir).resolve())
    hint = ("the scheduler and every worker need the same wsseg installed and the run directory at the same path "
            "(docs/large-corpora.md#existing-dask-cluster)")
    refused = _refused(address)
    if refused:  # nothing listens there: say so at once (the client would retry for ``timeout`` seconds)
        raise ValueError(f"--dask-address {address}: no Dask scheduler answers there ({refused})")
    try:
        client = Client(address, timeout=timeout, set_as_default=False)
    except (OSError, TimeoutError) as e:
        raise ValueError(f"--dask-address {address}: no Dask scheduler answers there ({e})") from None
    with client:
        try:
            found = {"the scheduler": client.run_on_scheduler(probe, path)}
            found |= {f"worker {w}": info for w, info in client.run(probe, path).items()}
        except Exception as e:  # e.g. a worker whose Python cannot unpickle the probe
            raise ValueError(f"--dask-address {address}: could not run a check there ({type(e).__name__}: "
                             f"{str(e)[:200]}); {hint}") from None
        problems = [f"{who} has wsseg {info['wsseg'] or 'not installed'} (this command: {mine})"
                    for who, info in found.items() if info["wsseg"] != mine]
        problems += [f"{who} does not see {path}" for who, info in found.items()
                     if not info["run_dir"] and who != "the scheduler"]
        if problems:
            raise ValueError(f"--dask-address {address}: {'; '.join(problems)}; {hint}")
        if len(found) == 1:
            print(f"the Dask scheduler at {address} has no worker yet: the shard tasks wait for one", file=sys.stderr,
                  flush=True)
        kept = found["the scheduler"].get("log_length")
        if isinstance(kept, int) and kept > LOG_LENGTH_NOTE:
            var, value = next(iter(DASK_ENVIRON.items()))
            print(f"the Dask scheduler at {address} keeps its last {kept} messages to each worker, and with them each "
                  f"shard task's arguments (its memory grows with the workers); start it with {var}={value} "
                  f"(docs/large-corpora.md#existing-dask-cluster)", file=sys.stderr, flush=True)
        try:  # a failure here costs the dashboard's task runs, not the work: say so and go on
            client.register_plugin(fresh_prefect_services(), name="wsseg-prefect-services")
        except Exception as e:
            print(f"--dask-address {address}: could not reset the workers' Prefect event senders ({type(e).__name__}: "
                  f"{str(e)[:200]}); task runs may be missing from this command's Prefect API", file=sys.stderr,
                  flush=True)


def fresh_prefect_services():
    """A Dask worker plugin: a worker's Prefect event and log senders start afresh for each command.

    A long-lived worker keeps the senders it made for the first command it served, bound to that
    command's Prefect API; when each command runs its own server the next command's task runs
    would go to a server that is gone. Setting the plugin up (again, by name, at each command's
    start) drains them, so the next ones are made in the settings context of the command's tasks.
    (A class made here, pickled by value: importing distributed at this module's import would
    read Dask's settings before :func:`prepare` sets them.)"""
    from distributed.diagnostics.plugin import WorkerPlugin

    class FreshPrefectServices(WorkerPlugin):
        async def setup(self, worker) -> None:
            from prefect.events.worker import EventsWorker
            from prefect.logging.handlers import APILogWorker

            for service in (APILogWorker, EventsWorker):
                await service.drain_all(timeout=10)

    return FreshPrefectServices()


def state_dir(run_dir) -> Path:
    """The local state folder of a run directory (itself when local; see tasks.store.remote)."""
    from wsseg.tasks.store.remote import state_dir_for

    return state_dir_for(run_dir)


def worker_environ() -> dict:
    """The environment Dask's nanny gives our worker processes: its defaults (one BLAS/OpenMP
    thread), :data:`DASK_ENVIRON` and at most :data:`ONEDNN_KERNELS` compiled oneDNN kernels (a value of
    the user's own ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` is kept), without ``MALLOC_TRIM_THRESHOLD_``. Setting that variable at all switches off
    glibc's adaptive mmap threshold, so every array above 128 KiB (a class-probability map of
    one photo is megabytes) is mapped and unmapped afresh and its pages faulted in again: the
    round-1 preliminary stage of msrc21 (276 images, 2 workers) took 41.8 s with it and 22.4 s
    without, with system time 40 s against 7 s (``tools/bench_workers.py`` measures it). The
    cost: a worker keeps freed memory for reuse instead of returning it at once."""
    import dask
    import distributed  # noqa: F401  (loads the distributed.* defaults into dask.config)

    env = dict(dask.config.get("distributed.nanny.pre-spawn-environ")) | DASK_ENVIRON
    kernels = os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_KERNELS))  # a user's own value kept
    env.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", kernels)
    dask_value = env.pop("MALLOC_TRIM_THRESHOLD_", None)
    # a nanny also writes these variables into this process's environment, which later workers
    # inherit: drop Dask's value there too (a value of the user's own is kept)
    if dask_value is not None and os.environ.get("MALLOC_TRIM_THRESHOLD_") == str(dask_value):
        del os.environ["MALLOC_TRIM_THRESHOLD_"]
    return env


def by_reference(flow_fn):
    """``flow_fn`` (a module-level Prefect flow) with its function pickled by reference (module and
    name) instead of by value. Every task a flow submits to Dask carries the flow run's context,
    the flow among it; the flow's function is not its module's attribute of that name (the Flow
    object is), so cloudpickle copied it by value with every global it names (the stage's tasks,
    the store's classes...), and each shard task's payload rebuilt them on the Dask scheduler and
    the worker (measured in `wsseg bench scale`: the scheduler's memory grew with the task runs;
    docs/large-corpora.md). Named ``<name>.fn`` it is found where it lives: ``module.<name>.fn``.
    Use above ``@flow`` on a top-level flow that submits shard tasks (tests/test_flow_stream.py
    checks each); not on a flow deployed from its imported object, whose deployment entrypoint
    Prefect writes from the function's qualname (deployments/serve.py loads its flow from source)."""
    fn = flow_fn.fn
    if "." not in fn.__qualname__:  # at the top level (a nested function cannot be found by name)
        fn.__qualname__ = f"{fn.__qualname__}.fn"
    return flow_fn


def on_cluster(flow_fn, address: str | None):
    """``flow_fn`` with its shard tasks on the Dask scheduler at ``address`` (unchanged when None:
    it keeps the task runner it was called with, or Prefect's default)."""
    if not address:
        return flow_fn
    from prefect_dask import DaskTaskRunner

    return flow_fn.with_options(task_runner=DaskTaskRunner(address=address))


# The watchdog of start_reaper(): it records the command's descendants while the command lives and
# ends those still running once it is gone (SIGTERM, then SIGKILL after 5 s). Polling alone misses a
# process started in the last half second (or all of them, when the command is killed before the
# watchdog's first look), and once the command is gone its orphans are no longer its children: so
# every descendant started by exec also carries the token WSSEG_REAPER_TOKEN in its environment
# (inherited from the command), and after the command ends the watchdog also ends every process of
# this user that carries it, scanning again until none is left. A fork without exec (a data loader's
# worker) shows the kernel the environment its parent was started with, without the token (which the
# command sets later): each fork writes its pid to a pipe the watchdog reads (an at-fork hook in the
# command, inherited by the forks' own forks), so it is known the moment it exists.
_REAPER = """
import os, sys, time
import psutil
token, me, seen, pipe, pending = sys.argv[2], os.getpid(), {}, int(sys.argv[3]), b""
os.set_blocking(pipe, False)

def reported():
    global pending
    while True:
        try:
            chunk = os.read(pipe, 65536)
        except BlockingIOError:
            break
        if not chunk:  # no writer left
            break
        pending += chunk
    *lines, pending = pending.split(b"\\n")
    out = []
    for line in lines:
        try:
            out.append(psutil.Process(int(line)))
        except (ValueError, psutil.NoSuchProcess):
            pass
    return out

try:
    parent = psutil.Process(int(sys.argv[1]))
except psutil.NoSuchProcess:
    parent = None
while parent is not None:
    try:
        if not parent.is_running() or parent.status() == psutil.STATUS_ZOMBIE:
            break
        for c in parent.children(recursive=True) + reported():
            if c.pid != me:
                seen[c.pid] = c.create_time()
    except psutil.NoSuchProcess:
        break
    time.sleep(0.5)

def tagged():
    out = []
    for p in psutil.process_iter():
        if p.pid == me:
            continue
        try:
            if p.environ().get("WSSEG_REAPER_TOKEN") == token:
                out.append(p)
        except (psutil.Error, OSError):
            pass
    return out

def end(procs):
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

for p in reported():
    seen[p.pid] = p.create_time()
procs = []
for pid, started in seen.items():
    try:
        p = psutil.Process(pid)
        if p.create_time() == started:
            procs.append(p)
    except psutil.NoSuchProcess:
        pass
end(procs)
for _ in range(10):  # a process ended above may have started others meanwhile
    left = tagged() + reported()
    if not left:
        break
    end(left)
"""


def start_reaper() -> None:
    """Start a watchdog process that ends this command's child processes (Dask workers and their
    nannies, the local Prefect API server, data-loader workers) when this process ends, however
    it ends: a SIGKILL gives the command itself no chance to stop them. The watchdog runs in a
    session of its own, so a Ctrl-C to the terminal's job reaches the command, not it."""
    import secrets
    import subprocess
    import sys

    token = f"{os.getpid()}-{secrets.token_hex(8)}"
    os.environ["WSSEG_REAPER_TOKEN"] = token  # every process this command starts from now on inherits it
    env = {k: v for k, v in os.environ.items() if k != "WSSEG_REAPER_TOKEN"}  # the watchdog must not carry it
    read, write = os.pipe()  # forks report on it (see _REAPER); not inherited by exec, kept by fork
    os.set_blocking(write, False)  # a fork never waits on it (a full pipe, a watchdog gone: the report is dropped)
    subprocess.Popen([sys.executable, "-c", _REAPER, str(os.getpid()), token, str(read)], start_new_session=True,
                     env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     pass_fds=(read,))
    os.close(read)
    os.register_at_fork(after_in_child=lambda: _report_fork(write))


def _report_fork(pipe: int) -> None:
    """In a fork of a command (see start_reaper): its pid to the watchdog."""
    try:
        os.write(pipe, f"{os.getpid()}\n".encode())
    except OSError:
        pass
