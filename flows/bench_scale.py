"""``wsseg bench scale``: a measured run of the user's whole path at corpus sizes N (issue 54);
the measuring pieces are :mod:`tasks.bench.scale`'s.

For each size N of ``--replicate``, in the benchmark folder ``ROOT`` (``--run-dir``):

1. **The source.** ``ROOT/n<N>/source`` holds N distinct copies of the ``--data`` images: each is
   flipped or not, cropped, rescaled and colour-jittered, with its tags kept. They are written by
   :func:`flows.bench_pipeline.replicate_source`, on the replica plan of
   :mod:`tasks.bench.pipeline`, as ``wsseg bench pipeline`` writes them, on a local Dask cluster
   that is closed before anything is measured. Copies left by a run with ``--keep`` are reused.
2. **The cluster.** A Dask cluster is started as a user starts one (docs/large-corpora.md,
   "Existing Dask cluster"): ``dask scheduler`` and ``dask worker --nworkers K --nthreads 1
   --preload-nanny wsseg.flows.nanny``, fresh for the size. It carries the worker plugin
   :class:`tasks.bench.scale.TaskClock`, which records the CPU time of each task.
3. **The commands.** Six ``wsseg`` commands run as subprocesses, each measured by
   :class:`tasks.bench.scale.Monitor`:
   * ``ingest SOURCE --dask-address ADDR``;
   * ``train --rounds R --dask-address ADDR`` (with ``--set``/``--config`` passed through);
   * ``export --format png`` (to ``ROOT/n<N>/export``);
   * ``review --top 100``;
   * ``status --json``;
   * ``train`` again: the rerun, which must recompute nothing.

   Each command's figures, with the Prefect task runs it created (the run directory's Prefect
   database) and the store's files and bytes after it (:func:`tasks.report.status.run_status`,
   what ``wsseg status --json`` prints).
4. **The checks.**
   * The rerun: no shard task run, no result file added, changed or removed (tracking state
     and the summary aside), the same rounds in the summary.
   * A walk of the run directory against the files ``status`` counts.
   * Unless ``--keep``, the source is removed. The run directory is kept, so ``wsseg ui``
     shows its runs.

:func:`bench_scale` runs the sizes, compares the largest with the smallest on the issue's
targets (:func:`tasks.bench.scale.compare`, :func:`tasks.bench.scale.targets`) and writes the
JSON. Import this module only after :func:`flows.runtime.prepare` has run.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from wsseg.flows.runtime import DASK_ENVIRON
from wsseg.tasks.bench import pipeline as tb
from wsseg.tasks.bench import scale as ts
from wsseg.tasks.store import Store, files

__all__ = ["bench_scale", "measure_size", "Cluster", "replicate", "commands"]

DASK = Path(sys.executable).with_name("dask")  # the CLI of this environment's distributed


def _say(line: str) -> None:
    print(f"  [bench scale] {line}", file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ============================================================================ the cluster
class Cluster:
    """``dask scheduler`` and ``dask worker --nworkers K --nthreads 1 --preload-nanny
    wsseg.flows.nanny`` on 127.0.0.1, each in a process group of its own, logging to
    ``folder/cluster.log``. The workers' Prefect home is ``folder/prefect``, so that a worker
    starting a Prefect server of its own would show. Use it with ``with``. Its
    :class:`tasks.bench.scale.TaskClock` plugin records the CPU time of each task."""

    def __init__(self, folder: Path, workers: int):
        self.folder, self.n = Path(folder), workers
        self.procs: list[subprocess.Popen] = []
        self.client = None

    def __enter__(self) -> "Cluster":
        from distributed import Client

        self.folder.mkdir(parents=True, exist_ok=True)
        # started as docs/large-corpora.md#existing-dask-cluster says: keeping no debugging log of messages
        env = dict(os.environ, PREFECT_HOME=str(self.folder / "prefect")) | DASK_ENVIRON
        env.pop("PREFECT_API_URL", None)
        self.address = f"tcp://127.0.0.1:{_free_port()}"
        self.log = open(self.folder / "cluster.log", "w")
        try:
            self.scheduler = subprocess.Popen(
                [str(DASK), "scheduler", "--host", "127.0.0.1", "--port", self.address.rsplit(":", 1)[1],
                 "--no-dashboard"], cwd=self.folder, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                start_new_session=True)
            self.procs.append(self.scheduler)
            self.workers = subprocess.Popen(
                [str(DASK), "worker", self.address, "--nworkers", str(self.n), "--nthreads", "1",
                 "--preload-nanny", "wsseg.flows.nanny", "--no-dashboard",
                 "--local-directory", str(self.folder / "workers")], cwd=self.folder, env=env, stdout=self.log,
                stderr=subprocess.STDOUT, start_new_session=True)
            self.procs.append(self.workers)
            self.client = Client(self.address, timeout=120, set_as_default=False)
            self.client.wait_for_workers(self.n, timeout=600)
            self.client.register_plugin(ts.TaskClock(), name=ts.TaskClock.name)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def worker_pids(self) -> dict[str, int]:
        """{pid as text: pid} of the worker processes now (a worker restarted by its nanny has a new one)."""
        return {str(pid): pid for pid in self.client.run(os.getpid).values()}

    def take_clock(self) -> list[dict]:
        """The :class:`tasks.bench.scale.TaskClock` records of every worker since the last call."""
        return [r for recs in self.client.run(ts.take_clock_records).values() for r in recs]

    @property
    def cpu_roots(self) -> list[int]:
        """The processes whose trees' CPU time is the cluster's: the scheduler, the workers' command."""
        return [self.scheduler.pid, self.workers.pid]

    def __exit__(self, *exc) -> None:
        if self.client is not None:
            try:
                self.client.close(timeout=30)
            except Exception:
                pass
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):  # each group: command, nannies, workers
            for p in self.procs:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait
            for p in self.procs:
                try:
                    p.wait(timeout=max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    pass
        self.log.close()


# ============================================================================ the steps
def replicate(data: str, out: Path, n: int, split: str, workers: int, root: Path) -> dict:
    """The source folder ``out`` of ``n`` copies of ``data``'s images: those a run with ``--keep``
    left there, else written by :func:`flows.bench_pipeline.replicate_source` on a local cluster."""
    from wsseg.flows.bench_pipeline import replicate_source
    from wsseg.flows.runtime import dask_cluster, on_cluster

    # replicate_source's own settings: the same check it makes, without starting Prefect and Dask
    settings = {"source": str(Path(data).resolve()), "n": n, "start": 0, "seed": 0, "split": split,
                "source_split": None}
    if tb.read_source_index(out, settings) is not None:
        _say(f"N={n}: the copies in {out} are reused (a run with --keep left them)")
        return {"folder": str(out), "reused": True, "seconds": 0.0}
    _say(f"N={n}: writing {n} copies of {data} to {out} (local Dask cluster of {workers})")
    t = time.perf_counter()
    with dask_cluster(None, workers, root) as address:
        res = on_cluster(replicate_source, address)(str(data), str(out), n, 0, 0, split)
    return {"folder": str(out), "reused": False, "seconds": time.perf_counter() - t,
            "distinct_sha256": len(set(res["sha256"].values()))}


def commands(source: Path, run: Path, export: Path, address: str, rounds: int, overrides: list[str],
             config: str | None) -> dict[str, list[str]]:
    """The argv of each step of :data:`tasks.bench.scale.STEPS` (``python -m wsseg ...``)."""
    wsseg = [sys.executable, "-m", "wsseg"]
    train = wsseg + ["train", "--run-dir", str(run), "--rounds", str(rounds), "--dask-address", address]
    train += [x for item in overrides for x in ("--set", item)] + (["--config", str(config)] if config else [])
    return {"ingest": wsseg + ["ingest", str(source), "--run-dir", str(run), "--dask-address", address],
            "train": train,
            "export": wsseg + ["export", "--run-dir", str(run), "--format", "png", "--out", str(export)],
            "review": wsseg + ["review", "--run-dir", str(run), "--top", "100"],
            "status": wsseg + ["status", str(run), "--json"],
            "rerun": list(train)}


def store_figures(run: Path) -> dict:
    """What ``wsseg status --json`` says of the store (files, size_mb, usage by part), read in this
    process, with the seconds it took."""
    from wsseg.tasks.report.status import run_status

    t = time.perf_counter()
    st = run_status(Store(run))
    return {"files": st["files"], "size_mb": st["size_mb"], "bytes": sum(v["bytes"] for v in st["usage"].values()),
            "usage": st["usage"], "seconds": time.perf_counter() - t}


def run_step(name: str, argv: list[str], cluster: Cluster, run: Path, n: int, interval: float) -> dict:
    """One command run and measured (:class:`tasks.bench.scale.Monitor`), with the Prefect task runs
    it created, its shard stages (:func:`tasks.bench.scale.train_breakdown`) and the store after it."""
    env = dict(os.environ)
    env.pop("PREFECT_API_URL", None)  # each command starts its own Prefect API, as a user's does
    _say(f"N={n}: {name}: wsseg {' '.join(argv[3:])}")
    before = ts.prefect_runs(run)
    cluster.take_clock()  # what the workers did before this step is not its
    mon = ts.Monitor(argv, env, run.parent, workers=cluster.worker_pids(), scheduler=cluster.scheduler.pid,
                     cluster=cluster.cpu_roots, interval=interval, echo=ts.echo_to(sys.stderr))
    res = mon.run()
    tasks, flows = ts.new_runs(before, ts.prefect_runs(run))
    clock = cluster.take_clock()
    series = res.pop("flow_cpu_series")
    stdout = res.pop("stdout")
    cpu = res["cpu_seconds"]
    res["core_ms_per_image"] = 1000.0 * (cpu["command"] + cpu["workers"] + cpu["scheduler"]) / n
    res["task_runs"] = ts.task_run_figures(tasks)
    res["clocked_tasks"] = len(clock)
    if name in ("ingest", "train", "rerun"):
        res["breakdown"] = ts.train_breakdown(tasks, flows, clock, series, res["started"],
                                              res["started"] + res["wall_seconds"])
    if name == "status" and res["rc"] == 0:
        st = json.loads(stdout)
        res["printed"] = {"files": st.get("files"), "size_mb": st.get("size_mb")}
    if res["rc"] != 0:
        res["stdout_tail"] = stdout[-2000:]
    else:
        res.pop("stderr_tail")
    res["store"] = store_figures(run) if (run / "corpus").exists() else None
    _say(f"N={n}: {name}: exit {res['rc']}, {res['wall_seconds']:.1f} s, {res['core_ms_per_image']:.0f} core-ms "
         f"an image, flow peak {res['peak_rss_mb']['flow'] or 0:.0f} MB, {res['task_runs']['created']} task runs")
    return res


def _rounds_of(run: Path) -> list | None:
    summary = Store(run).read_summary()
    return None if summary is None else summary.get("rounds")


def measure_size(data: str, root: Path, n: int, workers: int, rounds: int, overrides: list[str],
                 config: str | None, split: str, keep: bool, interval: float) -> dict:
    """Steps 1-4 of the module docstring for corpus size ``n``."""
    base = root / f"n{n}"
    source, run, export = base / "source", base / "run", base / "export"
    for old in (run, export, base / "cluster"):  # a run of this benchmark before: measured afresh
        shutil.rmtree(old, ignore_errors=True)
    load = [os.getloadavg()[0]]
    rep = replicate(data, source, n, split, workers, root)
    out: dict = {"images": n, "workers": workers, "run_dir": str(run), "source": rep, "steps": {}, "failed": []}
    with Cluster(base / "cluster", workers) as cluster:
        _say(f"N={n}: Dask cluster at {cluster.address} ({workers} single-threaded worker(s))")
        argv_of = commands(source, run, export, cluster.address, rounds, overrides, config)
        for name in ts.STEPS:
            if name == "rerun":
                snap, rows = ts.snapshot(run), _rounds_of(run)
            st = run_step(name, argv_of[name], cluster, run, n, interval)
            out["steps"][name] = st
            out["peak_method"] = st.pop("peak_method")
            if st["rc"] != 0:
                out["failed"].append(f"{name}: exit {st['rc']}")
                _say(f"N={n}: {name} failed (exit {st['rc']}); the size's remaining steps are left out")
                break
            if st["task_runs"]["failed"]:
                out["failed"].append(f"{name}: {st['task_runs']['failed']} task run(s) not completed")
            if name == "rerun":
                ch = ts.changes(snap, ts.snapshot(run))
                same = _rounds_of(run) == rows
                shard_tasks = st["task_runs"]["shard_tasks"]
                out["rerun_check"] = {"shard_tasks": shard_tasks, "files": ch, "rounds_identical": same,
                                      "recomputed": bool(shard_tasks or ch["added"] or ch["changed"] or ch["removed"]
                                                         or not same)}
    load.append(os.getloadavg()[0])
    out["load_average"] = load
    if (run / "corpus").exists():  # the check: a walk of the whole run directory against status's count
        st = store_figures(run)
        out["walk"] = ts.walk(run) | {"status_files": st["files"], "status_mb": st["size_mb"],
                                      "status_bytes": st["bytes"]}
        out["export"] = ts.walk(export) if export.is_dir() else None
    if not keep and not rep["reused"]:
        shutil.rmtree(source, ignore_errors=True)
    return out


# ============================================================================ the benchmark
def bench_scale(data: str, root: str, sizes: list[int], workers: int, rounds: int, out: str,
                overrides: list[str] | None = None, config: str | None = None, split: str = "train",
                keep: bool = False, interval: float = 0.3, source_images: int | None = None) -> dict:
    """Every size of ``sizes`` measured (:func:`measure_size`), the largest compared with the
    smallest; writes ``out`` (JSON) and returns the result. ``source_images``: how many images
    ``data`` lists (a size that is not a whole multiple of it holds another mix of them)."""
    t0 = time.perf_counter()
    root_p = Path(root).resolve()
    per_size = {}
    for n in sizes:
        _say(f"corpus size N = {n}")
        per_size[str(n)] = measure_size(data, root_p, n, workers, rounds, list(overrides or []), config, split,
                                        keep, interval)
        files.write_json(out, {"partial": True, "per_size": per_size})  # what is measured so far
    small, large = str(min(sizes)), str(max(sizes))
    ratios = ts.compare(per_size[small], per_size[large]) if small != large else []
    res = {"data": str(Path(data).resolve()), "run_dir": str(root_p), "sizes": sizes, "workers": workers,
           "rounds": rounds, "overrides": list(overrides or []), "config": config, "interval_s": interval,
           "source_images": source_images,
           "per_size": per_size, "compared": [int(small), int(large)] if ratios else None, "ratios": ratios,
           "load_average": {n: s["load_average"] for n, s in per_size.items()},
           "cpu_count": os.cpu_count(), "wall_seconds": time.perf_counter() - t0,
           "definitions": DEFINITIONS}
    res["targets"] = ts.targets(per_size, ratios)
    files.write_json(out, res)
    return res


DEFINITIONS = {
    "wall_seconds": "the command's wall time, from its start to its exit (interpreter start and imports included)",
    "core_ms_per_image": "CPU time over the step of the command's process tree (its own and every descendant it "
                         "reaped: the Prefect API server, data loaders), of the Dask workers' command with its "
                         "nannies and workers and of the scheduler, divided by N",
    "cpu_seconds": "command / workers / scheduler: the parts of core_ms_per_image, in seconds",
    "peak_rss_mb": "flow: the command's own process (VmHWM, a fresh process per step); workers, scheduler: each "
                   "process's VmHWM after a reset at the step's start (or its VmRSS sampled, see peak_method), read "
                   "every interval_s; worker: the largest; command_children: the largest sum of the command's "
                   "other processes' resident sets",
    "task_runs": "task runs the step added to the run directory's Prefect database (RUN/.prefect/prefect.db), by "
                 "stage; failed: those not COMPLETED",
    "breakdown": "stages: the shard stages by round; tasks and images from the task runs' names, core_seconds "
                 "from the workers' CPU time inside each task (a worker plugin), wall_seconds from the first "
                 "start to the last end, worker_rss_mb the largest worker resident set at the end of one of "
                 "the stage's tasks; totals: summed over rounds. windows: the stretches in which the flow "
                 "process works alone, with the command tree's CPU over them (sampled): classifier (features' end "
                 "to round 0's start), mil+proposals (preliminary's end to pseudo-labels' start), segmenter "
                 "(pseudo-labels' end to evaluate's start), after the rounds (the final model logged to MLflow), "
                 "before and after the flow (imports, the command's Prefect API, the cluster check)",
    "store": "files and size_mb as `wsseg status --json` gives them after the step; seconds: the same read in "
             "the benchmark's process (tasks.report.status.run_status), without the command's start",
    "rerun_check": "the second `wsseg train`: shard task runs it created, files under the run directory added, "
                   "changed or removed (Prefect, MLflow, the lock and summary.json aside), and whether the "
                   "summary's rounds are the same; recomputed is true if any",
    "walk": "every file under the run directory at the end, against status's count",
    "ratios": "the figure at the largest N over the smallest, same command",
}
