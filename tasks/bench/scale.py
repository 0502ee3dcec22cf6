"""``wsseg bench scale``: the measuring pieces of the scale benchmark (the orchestration is
:mod:`flows.bench_scale`). Nothing here starts a flow; everything reads processes, files and the
run directory's Prefect database from outside, as a user's commands leave them.

* :class:`Monitor`: one command (a ``wsseg`` subprocess) run and measured: wall time, the CPU
  time of its process tree (``wait4``), of the Dask workers and of the scheduler over the step,
  and the peak resident set of the command's process, of each worker and of the scheduler
  (``VmHWM`` after a reset of the long-lived processes' peak, read every ``interval`` seconds in a
  background thread; the command's own tree CPU is sampled too, so that the time between two
  stages, which the flow spends training, can be given its CPU);
* :class:`TaskClock`: a Dask worker plugin that records the process CPU time of every task the
  worker runs (single-threaded workers: the task's own), by shard function;
* :func:`prefect_runs`: the task and flow runs of a run directory's Prefect database;
  :func:`train_breakdown`: a ``wsseg train``'s shard stages per round (Prefect task runs: tasks,
  images, wall window; :class:`TaskClock`: worker core-ms per image) and the stretches between
  the stages, where the flow process works alone (the trainers, the final model's logging);
* :func:`snapshot`, :func:`changes`, :func:`walk`: what a step wrote, and a walk of the run directory;
* :func:`compare`, :func:`targets`, :func:`format_summary`: the issue's ratios, judged, and the tables.
"""
from __future__ import annotations

import datetime as dt
import os
import re
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from distributed.diagnostics.plugin import WorkerPlugin

from wsseg.tasks.runtime.memory import status_kb

__all__ = ["STEPS", "SHARD_STAGES", "Monitor", "TaskClock", "take_clock_records", "prefect_runs", "task_stage",
           "train_breakdown", "snapshot", "changes", "walk", "compare", "targets", "format_summary"]

#: the user's path, in order: the steps each size runs (``rerun``: ``wsseg train`` again)
STEPS = ("ingest", "train", "export", "review", "status", "rerun")
#: the shard stages whose core-ms per image the ratios compare (ingest's from ``wsseg ingest``, the
#: others from ``wsseg train``, summed over its rounds)
SHARD_STAGES = ("ingest", "features", "preliminary", "pseudo_labels", "evaluate")
#: a Dask task's key starts with its function's name (prefect_dask wraps the Prefect task, whose
#: ``__name__`` is the shard function's): the shard function -> its stage
FUNCTION_STAGE = {"ingest_shard": "ingest", "features_shard": "features", "preliminary_shard": "preliminary",
                  "pseudo_shard": "pseudo_labels", "evaluate_shard": "evaluate", "refresh_shard": "refresh"}
#: a shard task run's name (flows/naming.py: ``[round-R/]STAGE FIRST..LAST (N images)``): its stage word -> stage
RUN_STAGE = {"ingest": "ingest", "features": "features", "preliminary": "preliminary",
             "pseudo-labels": "pseudo_labels", "evaluate": "evaluate", "refresh": "refresh"}
#: what a rerun may write without recomputing anything: tracking state and the run's own records
#: of the command (the summary is written again by every `wsseg train`)
NOT_RESULTS = (".prefect", "mlflow.db", "mlflow.db-journal", "mlartifacts", "dask-scratch", ".wsseg.lock",
               "summary.json", "last_error.json")


# ============================================================================ processes
def _mb(pid: int, field: str) -> float | None:
    kb = status_kb(pid, field)
    return None if kb is None else kb / 1024


def own_cpu(p) -> float:
    """CPU seconds (user + system) of process ``p`` (psutil) and of its children it has reaped."""
    t = p.cpu_times()
    return t.user + t.system + t.children_user + t.children_system


def tree_cpu(pid: int) -> float:
    """CPU seconds of process ``pid`` and of every descendant alive now (each with its reaped
    children); 0.0 when the process is gone."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            total += own_cpu(p)
        except psutil.Error:
            pass
    return total


def reset_peak(pid: int) -> bool:
    """Reset process ``pid``'s peak resident set (``VmHWM``) to its current one (Linux >= 4.0,
    same user); False where that is not possible."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class Monitor:
    """One command run as a subprocess and measured (see the module docstring).

    Parameters
    ----------
    argv, env, cwd
        The command (``subprocess.Popen``'s).
    workers : dict
        {name: pid} of the Dask worker processes (their peak resident set is reset at the start).
    scheduler : int or None
        The Dask scheduler's pid.
    cluster : sequence of int
        Root pids whose process trees' CPU counts as the cluster's (the ``dask worker`` command
        with its nannies and workers, the scheduler).
    interval : float
        Seconds between two readings.
    echo : callable
        Called with each chunk of the command's stderr (its progress lines pass through).
    """

    def __init__(self, argv: Sequence[str], env: dict, cwd: str | Path, *, workers: dict[str, int],
                 scheduler: int | None, cluster: Sequence[int], interval: float = 0.3,
                 echo: Callable[[bytes], None] | None = None):
        self.argv, self.env, self.cwd = list(argv), env, str(cwd)
        self.workers, self.scheduler, self.cluster = dict(workers), scheduler, list(cluster)
        self.interval, self.echo = interval, echo
        self.peaks: dict[str, float] = {}
        self.flow_cpu: list[tuple[float, float]] = []  # (epoch seconds, the command tree's CPU seconds)
        self.children_peak = 0.0
        self._stop = threading.Event()

    def _peak(self, key: str, value: float | None) -> None:
        if value is not None:
            self.peaks[key] = max(self.peaks.get(key, 0.0), value)

    def _sample(self, pid: int) -> None:
        import psutil

        # the command's own process: its peak so far (a fresh process: VmHWM is this step's)
        self._peak("flow", _mb(pid, "VmHWM"))
        try:
            kids = psutil.Process(pid).children(recursive=True)
            self.children_peak = max(self.children_peak, sum(k.memory_info().rss for k in kids) / 2 ** 20)
            self.flow_cpu.append((time.time(), tree_cpu(pid)))
        except psutil.Error:
            pass
        for name, wpid in self.workers.items():
            self._peak(f"worker {name}", _mb(wpid, "VmHWM" if self.reset.get(wpid) else "VmRSS"))
        if self.scheduler is not None:
            self._peak("scheduler", _mb(self.scheduler, "VmHWM" if self.reset.get(self.scheduler) else "VmRSS"))

    def _loop(self, pid: int) -> None:
        while True:
            self._sample(pid)
            if self._stop.wait(self.interval):
                return

    def run(self, timeout: float | None = None) -> dict:
        """Run the command to its end (killed after ``timeout`` seconds); returns ``argv``, ``rc``,
        ``started`` (epoch seconds), ``wall_seconds``, ``stdout``, ``stderr_tail``, ``cpu_seconds``
        {command, workers, scheduler}, ``peak_rss_mb`` {flow, command_children (the sum over the
        command's other processes), workers {name: MB}, worker (their largest), scheduler},
        ``peak_method`` and ``flow_cpu_series``."""
        self.reset = {p: reset_peak(p) for p in [*self.workers.values(), *([self.scheduler] if self.scheduler else [])]}
        cluster0 = {pid: tree_cpu(pid) for pid in self.cluster}
        t0, w0 = time.time(), time.perf_counter()
        proc = subprocess.Popen(self.argv, env=self.env, cwd=self.cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, tail = [], bytearray()

        def read_out() -> None:
            out.append(proc.stdout.read())

        def read_err() -> None:
            for chunk in iter(lambda: os.read(proc.stderr.fileno(), 65536), b""):
                tail.extend(chunk)
                del tail[:-20000]
                if self.echo:
                    self.echo(chunk)

        readers = [threading.Thread(target=f, daemon=True) for f in (read_out, read_err)]
        sampler = threading.Thread(target=self._loop, args=(proc.pid,), daemon=True)
        for t in (*readers, sampler):
            t.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        status = usage = None
        while status is None:  # wait4: the command's own CPU and that of every descendant it reaped
            done, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if done == 0:
                status = None
                if deadline is not None and time.monotonic() > deadline:
                    proc.kill()
                time.sleep(0.05)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - w0
        self._stop.set()
        sampler.join()
        for t in readers:
            t.join(timeout=30)
        proc.stdout.close()
        proc.stderr.close()
        # the long-lived processes once more at the end (the command's is gone)
        for name, wpid in self.workers.items():
            self._peak(f"worker {name}", _mb(wpid, "VmHWM" if self.reset.get(wpid) else "VmRSS"))
        if self.scheduler is not None:
            self._peak("scheduler", _mb(self.scheduler, "VmHWM" if self.reset.get(self.scheduler) else "VmRSS"))
        cluster_cpu = {pid: tree_cpu(pid) - c for pid, c in cluster0.items()}
        command_cpu = usage.ru_utime + usage.ru_stime
        workers = {k[len("worker "):]: v for k, v in self.peaks.items() if k.startswith("worker ")}
        return {"argv": self.argv, "rc": proc.returncode, "started": t0, "wall_seconds": wall,
                "stdout": b"".join(o for o in out if o).decode(errors="replace"),
                "stderr_tail": bytes(tail[-4000:]).decode(errors="replace"),
                "cpu_seconds": {"command": command_cpu,
                                "scheduler": cluster_cpu.get(self.scheduler, 0.0) if self.scheduler else 0.0,
                                "workers": sum(v for pid, v in cluster_cpu.items() if pid != self.scheduler)},
                "peak_rss_mb": {"flow": self.peaks.get("flow"), "command_children": self.children_peak,
                                "workers": workers, "worker": max(workers.values(), default=None),
                                "scheduler": self.peaks.get("scheduler")},
                "peak_method": ("VmHWM, reset at the step's start" if self.reset and all(self.reset.values())
                                else "VmRSS sampled every %.2f s" % self.interval),
                "flow_cpu_series": self.flow_cpu}


# ============================================================================ worker CPU per task
class TaskClock(WorkerPlugin):
    """A worker plugin that records, for every task the worker runs, its shard function (the key's
    prefix), when it started and ended (epoch seconds), and the worker process's CPU seconds
    over it: a single-threaded worker runs one task at a time, so this is the task's own CPU
    (plus what the worker's event loop did meanwhile, which is little); and the worker's resident
    set when the task ended (what it keeps from task to task). :func:`take_clock_records` collects them."""

    name = "wsseg-bench-scale-clock"

    def setup(self, worker) -> None:
        self.records: list[dict] = []
        self._open: dict[Any, tuple[float, float]] = {}

    def transition(self, key, start, finish, **kwargs) -> None:
        if finish == "executing":
            self._open[key] = (time.time(), time.process_time())
        elif start == "executing" and key in self._open:
            from dask.utils import key_split

            t0, c0 = self._open.pop(key)
            self.records.append({"function": key_split(key), "start": t0, "end": time.time(),
                                 "cpu_seconds": time.process_time() - c0, "state": str(finish), "pid": os.getpid(),
                                 "rss_mb": _mb(os.getpid(), "VmRSS")})


def take_clock_records(dask_worker) -> list[dict]:
    """The records :class:`TaskClock` made on this worker since the last call (run with ``Client.run``)."""
    plugin = dask_worker.plugins.get(TaskClock.name)
    if plugin is None:
        return []
    out, plugin.records = plugin.records, []
    return out


# ============================================================================ the run directory's Prefect database
def _epoch(text: str | None) -> float | None:
    """Prefect's SQLite timestamp (UTC, e.g. ``2026-12-06 15:46:59.160346``) as epoch seconds."""
    if not text:
        return None
    t = dt.datetime.fromisoformat(str(text))
    return (t if t.tzinfo else t.replace(tzinfo=dt.timezone.utc)).timestamp()


def prefect_runs(state_dir: str | Path) -> tuple[list[dict], list[dict]]:
    """(task runs, flow runs) of the Prefect database ``STATE/.prefect/prefect.db``, each a dict
    with ``id``, ``name``, ``state`` and ``start``/``end`` (epoch seconds or None); task runs also
    ``flow_run_id``. Empty lists when there is no database yet."""
    db = Path(state_dir) / ".prefect" / "prefect.db"
    if not db.is_file():
        return [], []
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as con:
        tasks = con.execute("SELECT id, name, state_type, start_time, end_time, flow_run_id FROM task_run").fetchall()
        flows = con.execute("SELECT id, name, state_type, start_time, end_time FROM flow_run").fetchall()
    return ([{"id": i, "name": n, "state": s, "start": _epoch(a), "end": _epoch(b), "flow_run_id": f}
             for i, n, s, a, b, f in tasks],
            [{"id": i, "name": n, "state": s, "start": _epoch(a), "end": _epoch(b)} for i, n, s, a, b in flows])


_RUN_NAME = re.compile(r"^(?:round-(\d+)/)?([A-Za-z-]+) .*\((\d+) images?\)$")


def task_stage(name: str) -> tuple[int | None, str, int] | None:
    """(round or None, stage, images) of a shard task run's name, None for another name.

    >>> task_stage("round-1/pseudo-labels a..b (64 images)")
    (1, 'pseudo_labels', 64)
    >>> task_stage("features x (1 image)")
    (None, 'features', 1)
    """
    m = _RUN_NAME.match(name or "")
    if not m or m.group(2) not in RUN_STAGE:
        return None
    return (int(m.group(1)) if m.group(1) is not None else None), RUN_STAGE[m.group(2)], int(m.group(3))


def new_runs(before: tuple[list[dict], list[dict]], after: tuple[list[dict], list[dict]]) -> tuple[list, list]:
    """The task and flow runs in ``after`` that ``before`` did not hold (what one step created)."""
    seen_t, seen_f = {t["id"] for t in before[0]}, {f["id"] for f in before[1]}
    return [t for t in after[0] if t["id"] not in seen_t], [f for f in after[1] if f["id"] not in seen_f]


def task_run_figures(tasks: list[dict]) -> dict:
    """``created`` (task runs), ``by_stage`` {stage: task runs; ``subflow``: the task run Prefect
    makes for a subflow such as ``refresh_round-0``}, ``shard_tasks``, ``failed`` (runs not COMPLETED)."""
    by_stage: dict[str, int] = {}
    for t in tasks:
        s = task_stage(t["name"])
        key = s[1] if s else ("subflow" if re.fullmatch(r"[\w-]+-\d+", t["name"] or "") else "other")
        by_stage[key] = by_stage.get(key, 0) + 1
    return {"created": len(tasks), "by_stage": dict(sorted(by_stage.items())),
            "shard_tasks": sum(v for k, v in by_stage.items() if k not in ("other", "subflow")),
            "failed": sum(1 for t in tasks if t["state"] != "COMPLETED"),
            "states": sorted({t["state"] for t in tasks if t["state"]})}


def _round_name(name: str | None) -> int | None:
    """R of a ``refresh_round`` flow run's name (``<run>/round-R``), None for another flow."""
    m = re.search(r"(?:^|/)round-(\d+)$", name or "")
    return int(m.group(1)) if m else None


def _rounds(flows: list[dict]) -> dict[int, tuple[float, float]]:
    """{round: (start, end)} of the ``.../round-R`` flow runs (``refresh_round``)."""
    out = {}
    for f in flows:
        r = _round_name(f["name"])
        if r is not None and f["start"] is not None:
            out[r] = (f["start"], f["end"] if f["end"] is not None else float("inf"))
    return out


def _cpu_at(series: list[tuple[float, float]], t: float) -> float | None:
    """The sampled cumulative CPU at time ``t`` (linear between readings, clamped at the ends)."""
    if not series:
        return None
    if t <= series[0][0]:
        return series[0][1]
    for (ta, ca), (tb, cb) in zip(series, series[1:]):
        if ta <= t <= tb:
            return ca + (cb - ca) * (t - ta) / (tb - ta) if tb > ta else cb
    return series[-1][1]


def _window(series, start: float | None, end: float | None) -> dict | None:
    if start is None or end is None or end < start:
        return None
    a, b = _cpu_at(series, start), _cpu_at(series, end)
    return {"wall_seconds": end - start, "flow_core_seconds": None if a is None or b is None else max(b - a, 0.0)}


def train_breakdown(tasks: list[dict], flows: list[dict], clock: list[dict], flow_cpu: list[tuple[float, float]],
                    started: float | None = None, ended: float | None = None) -> dict:
    """A command's work by shard stage and round, from the task and flow runs it created, the
    workers' :class:`TaskClock` records over it and its process tree's CPU series (``started``,
    ``ended``: the command's start and exit, epoch seconds).

    Returns
    -------
    dict
        ``stages`` {``features`` | ``r<R>.<stage>``: tasks, images, core_seconds (the workers' CPU
        inside the stage's tasks), core_ms_per_image, wall_seconds (first start to last end of its
        task runs), worker_rss_mb (the largest resident set of a worker at the end of one of its
        tasks)}; ``totals`` {stage: the same summed over rounds}; ``windows`` {name: wall seconds
        and the command tree's core seconds of a stretch between two stages, in which
        the flow process works alone: ``classifier`` (features' end, or the flow's start, to round
        0's start: the image classifier), ``r<R>.mil+proposals`` (the preliminary stage's end to
        the pseudo-labels' start), ``r<R>.segmenter`` (the pseudo-labels' end to the evaluation's
        start), ``after the rounds`` (the last round's end to the flow's: the final model logged
        to MLflow), ``before the flow`` and ``after the flow`` (the command's start to its flow
        run's, its flow run's end to its exit: imports, the Prefect API, the cluster check)};
        ``rounds`` {R: wall seconds of the round's flow run}; ``flow_seconds`` (the command's
        top flow run).
    """
    rounds = _rounds(flows)
    round_of_flow = {f["id"]: r for f in flows for r in [_round_name(f["name"])] if r is not None}
    stages: dict[str, dict] = {}
    for t in tasks:
        s = task_stage(t["name"])
        if s is None:
            continue
        r, stage, images = s
        r = r if r is not None else round_of_flow.get(t["flow_run_id"])
        e = stages.setdefault(stage if r is None else f"r{r}.{stage}",
                              {"tasks": 0, "images": 0, "core_seconds": 0.0, "start": None, "end": None,
                               "clocked_tasks": 0})
        e["tasks"] += 1
        e["images"] += images
        if t["start"] is not None:
            e["start"] = t["start"] if e["start"] is None else min(e["start"], t["start"])
        if t["end"] is not None:
            e["end"] = t["end"] if e["end"] is None else max(e["end"], t["end"])
    for rec in clock:
        stage = FUNCTION_STAGE.get(rec["function"])
        if stage is None:
            continue
        r = next((k for k, (a, b) in rounds.items() if a <= rec["start"] <= b), None)
        key = f"r{r}.{stage}" if r is not None and f"r{r}.{stage}" in stages else stage
        if key in stages:  # a clocked task belongs to a stage whose runs Prefect recorded
            stages[key]["core_seconds"] += rec["cpu_seconds"]
            stages[key]["clocked_tasks"] += 1
            if rec.get("rss_mb") is not None:
                stages[key]["worker_rss_mb"] = max(stages[key].get("worker_rss_mb") or 0.0, rec["rss_mb"])
    totals: dict[str, dict] = {}
    for key, e in stages.items():
        e["wall_seconds"] = (e["end"] - e["start"]) if e["start"] is not None and e["end"] is not None else None
        clocked = e["images"] and e["clocked_tasks"]
        e["core_ms_per_image"] = 1000.0 * e["core_seconds"] / e["images"] if clocked else None
        tot = totals.setdefault(key.split(".", 1)[-1], {"tasks": 0, "images": 0, "core_seconds": 0.0,
                                                        "clocked_tasks": 0})
        for k in ("tasks", "images", "core_seconds", "clocked_tasks"):
            tot[k] += e[k]
    for tot in totals.values():
        tot["core_ms_per_image"] = (1000.0 * tot["core_seconds"] / tot["images"]
                                    if tot["images"] and tot["clocked_tasks"] else None)
    top = [f for f in flows if _round_name(f["name"]) is None and f["start"] is not None]
    top = min(top, key=lambda f: f["start"]) if top else None
    windows: dict[str, dict | None] = {}
    if top is not None:
        windows["before the flow"] = _window(flow_cpu, started, top["start"])
    if 0 in rounds and top is not None:
        feats = stages.get("features")
        windows["classifier"] = _window(flow_cpu, feats["end"] if feats and feats["end"] else top["start"],
                                        rounds[0][0])
    for r in sorted(rounds):
        pre, pseudo, ev = (stages.get(f"r{r}.{s}") for s in ("preliminary", "pseudo_labels", "evaluate"))
        if pre and pseudo:
            windows[f"r{r}.mil+proposals"] = _window(flow_cpu, pre["end"], pseudo["start"])
        if pseudo and ev:
            windows[f"r{r}.segmenter"] = _window(flow_cpu, pseudo["end"], ev["start"])
    if rounds and top is not None:
        windows["after the rounds"] = _window(flow_cpu, max(b for _, b in rounds.values()), top["end"])
    if top is not None:
        windows["after the flow"] = _window(flow_cpu, top["end"], ended)
    return {"stages": {k: {x: v for x, v in e.items() if x not in ("start", "end")} for k, e in stages.items()},
            "totals": totals, "windows": {k: v for k, v in windows.items() if v is not None},
            "rounds": {str(r): (b - a if b != float("inf") else None) for r, (a, b) in sorted(rounds.items())},
            "flow_seconds": (top["end"] - top["start"]) if top is not None and top["end"] is not None else None}


# ============================================================================ the run directory's files
def snapshot(root: str | Path, skip: Sequence[str] = NOT_RESULTS) -> dict[str, tuple[int, int]]:
    """{relative path: (bytes, mtime_ns)} of every file under ``root`` except the top-level
    entries named in ``skip`` (tracking state and per-command records)."""
    root = Path(root)
    out: dict[str, tuple[int, int]] = {}

    def scan(folder: str, rel: str) -> None:
        with os.scandir(folder) as it:
            for e in it:
                if not rel and e.name in skip:
                    continue
                r = f"{rel}/{e.name}" if rel else e.name
                if e.is_dir(follow_symlinks=False):
                    scan(e.path, r)
                else:
                    st = e.stat(follow_symlinks=False)
                    out[r] = (st.st_size, st.st_mtime_ns)

    if root.is_dir():
        scan(str(root), "")
    return out


def changes(before: dict, after: dict, limit: int = 20) -> dict:
    """Files added, changed (size or modification time) and removed between two :func:`snapshot`\\ s:
    counts and the first ``limit`` names of each."""
    added = sorted(set(after) - set(before))
    removed = sorted(set(before) - set(after))
    changed = sorted(k for k in set(before) & set(after) if before[k] != after[k])
    return {"added": len(added), "changed": len(changed), "removed": len(removed),
            "files": (added + changed + removed)[:limit]}


def walk(root: str | Path) -> dict:
    """Files and bytes under ``root``, every one (links not followed)."""
    files = size = 0
    for dirpath, _, names in os.walk(root):
        for n in names:
            try:
                size += os.lstat(os.path.join(dirpath, n)).st_size
                files += 1
            except OSError:
                pass
    return {"files": files, "bytes": size}


# ============================================================================ ratios, targets, tables
#: the issue's targets on the ratio large N / small N, same command: name -> (where, bound, words)
RATIO_TARGETS = {
    **{f"core-ms/img {s}": (("stage", s), 1.1, "<= 1.1x") for s in SHARD_STAGES},
    **{f"flow peak MB {s}": (("flow", s), 1.3, "<= 1.3x") for s in ("ingest", "train", "rerun")},
    **{f"flow peak MB {s}": (("flow", s), 1.1, "flat (<= 1.1x)") for s in ("export", "review")},
    "worker peak MB (any)": (("worker", None), 1.3, "<= 1.3x"),
    "scheduler peak MB": (("scheduler", None), 1.3, "<= 1.3x"),
}
#: the ratios shown without a target (what else grows)
RATIO_INFO = {**{f"core-ms/img step {s}": ("step_core", s) for s in STEPS},
              **{f"wall ms/img step {s}": ("step_wall", s) for s in ("ingest", "train", "export", "review")},
              "store files/img": ("files", None)}


def _value(size: dict, where: tuple[str, str | None]) -> float | None:
    kind, name = where
    steps = size.get("steps", {})
    if kind == "stage":  # ingest's stage from `wsseg ingest`, the others from the first `wsseg train`
        step = steps.get("ingest" if name == "ingest" else "train") or {}
        return ((step.get("breakdown") or {}).get("totals") or {}).get(name, {}).get("core_ms_per_image")
    if kind == "flow":
        return ((steps.get(name) or {}).get("peak_rss_mb") or {}).get("flow")
    if kind in ("worker", "scheduler"):
        vals = [(s.get("peak_rss_mb") or {}).get(kind) for s in steps.values()]
        vals = [v for v in vals if v is not None]
        return max(vals) if vals else None
    if kind == "step_core":
        return (steps.get(name) or {}).get("core_ms_per_image")
    if kind == "step_wall":
        s = steps.get(name) or {}
        return 1000.0 * s["wall_seconds"] / size["images"] if s.get("wall_seconds") is not None else None
    if kind == "files":
        st = (steps.get("rerun") or {}).get("store") or {}
        return st.get("files") / size["images"] if st.get("files") is not None else None
    raise ValueError(kind)


def compare(small: dict, large: dict) -> list[dict]:
    """The ratios large / small of the issue's figures: rows ``name``, ``small``, ``large``,
    ``ratio``, ``target`` (words, or None for a figure shown without one) and ``met``."""
    rows = []
    for name, (where, bound, words) in RATIO_TARGETS.items():
        a, b = _value(small, where), _value(large, where)
        ratio = b / a if a and b is not None else None
        rows.append({"name": name, "small": a, "large": b, "ratio": ratio, "target": words,
                     "met": None if ratio is None else ratio <= bound})
    for name, where in RATIO_INFO.items():
        a, b = _value(small, where), _value(large, where)
        rows.append({"name": name, "small": a, "large": b, "ratio": b / a if a and b is not None else None,
                     "target": None, "met": None})
    return rows


def targets(per_size: dict[str, dict], ratios: list[dict]) -> dict[str, dict]:
    """Every target of the issue, judged: the ratio rows that have one, and at each size
    ``status wall s`` (< 1 s), ``nothing failed`` and ``nothing recomputed on the rerun``."""
    out = {r["name"]: {"value": r["ratio"], "target": r["target"], "met": r["met"]} for r in ratios if r["target"]}
    status = {n: (s["steps"].get("status") or {}).get("wall_seconds") for n, s in per_size.items()}
    out["status wall s"] = {"value": max((v for v in status.values() if v is not None), default=None),
                            "by_size": status, "target": "< 1 s at every size",
                            "met": bool(status) and all(v is not None and v < 1.0 for v in status.values())}
    failed = {n: s.get("failed") for n, s in per_size.items()}
    out["nothing failed"] = {"value": failed, "target": "every step exit 0, no task run failed",
                             "met": all(not v for v in failed.values())}
    rec = {n: (s.get("rerun_check") or {}).get("recomputed") for n, s in per_size.items()}
    out["nothing recomputed on the rerun"] = {"value": rec, "target": "no shard task run, no result file written",
                                              "met": all(v is False for v in rec.values())}
    return out


def _f(v, p: int = 1) -> str:
    if v is None:
        return "-"
    return f"{v:.{p}f}" if isinstance(v, float) else str(v)


def _verdict(met: bool | None) -> str:
    return "not measured" if met is None else ("met" if met else "MISSED")


def format_size(n: str, s: dict) -> list[str]:
    """The table of one corpus size: a row per step, then the train's stages and the flow's own stretches."""
    lines = [f"N = {n} images ({s['workers']} worker(s); peaks: {s.get('peak_method', '-')})",
             f"{'step':<8} {'rc':>3} {'wall s':>8} {'core-ms/img':>12} {'cmd/wrk/sch core-s':>20} {'flow MB':>8} "
             f"{'worker MB':>10} {'sched MB':>9} {'task runs':>10} {'files':>8} {'store MB':>9}"]
    for name in STEPS:
        st = s["steps"].get(name)
        if st is None:
            lines.append(f"{name:<8} not run")
            continue
        c, p, t, store = st["cpu_seconds"], st["peak_rss_mb"], st["task_runs"], st.get("store") or {}
        cpu = f"{c['command']:.0f}/{c['workers']:.0f}/{c['scheduler']:.0f}"
        lines.append(f"{name:<8} {st['rc']:>3} {st['wall_seconds']:>8.1f} {_f(st['core_ms_per_image']):>12} "
                     f"{cpu:>20} {_f(p['flow'], 0):>8} {_f(p['worker'], 0):>10} {_f(p['scheduler'], 0):>9} "
                     f"{t['created']:>10} {_f(store.get('files')):>8} {_f(store.get('size_mb')):>9}")
    b = ((s["steps"].get("train") or {}).get("breakdown")) or {}
    if b.get("stages"):
        lines.append(f"  train's shard stages: {'stage':<22} {'tasks':>6} {'images':>7} {'core-ms/img':>12} "
                     f"{'wall s':>8} {'worker MB':>10}")
        for key, e in b["stages"].items():
            lines.append(f"  {'':<20} {key:<22} {e['tasks']:>6} {e['images']:>7} {_f(e['core_ms_per_image']):>12} "
                         f"{_f(e['wall_seconds']):>8} {_f(e.get('worker_rss_mb'), 0):>10}")
        lines.append(f"  train's flow process alone (between stages): {'':<9} {'wall s':>8} {'core-s':>8}")
        for key, w in b["windows"].items():
            lines.append(f"  {'':<20} {key:<30} {_f(w['wall_seconds']):>8} {_f(w['flow_core_seconds']):>8}")
    status = s["steps"].get("status") or {}
    if status.get("store"):
        lines.append(f"  status: the command {status['wall_seconds']:.2f} s; its reading of the run directory alone "
                     f"(run_status in this process) {status['store']['seconds']:.3f} s")
    rc = s.get("rerun_check") or {}
    if rc:
        ch = rc.get("files") or {}
        lines.append(f"  rerun: {rc.get('shard_tasks')} shard task run(s), result files added/changed/removed "
                     f"{ch.get('added')}/{ch.get('changed')}/{ch.get('removed')}, rounds "
                     f"{'the same' if rc.get('rounds_identical') else 'DIFFERENT'}: "
                     f"{'nothing recomputed' if rc.get('recomputed') is False else 'RECOMPUTED'}")
    w = s.get("walk")
    if w:
        lines.append(f"  walk of the run directory at the end: {w['files']} files, {w['bytes'] / 2 ** 20:.1f} MB "
                     f"(status: {w.get('status_files')} files, {w.get('status_mb')} MB)")
    if s.get("failed"):
        lines.append(f"  FAILED: {s['failed']}")
    return lines


def format_summary(res: dict) -> str:
    """The tables printed at the end of ``wsseg bench scale``: one per size, the ratios, the targets."""
    lines = [f"scale benchmark: {res['data']} -> sizes {', '.join(str(n) for n in res['sizes'])}, "
             f"{res['workers']} worker(s), train --rounds {res['rounds']}"
             + (f" {' '.join('--set ' + x for x in res['overrides'])}" if res.get("overrides") else "")
             + (f" --config {res['config']}" if res.get("config") else "")]
    for n, s in res["per_size"].items():
        lines += [""] + format_size(n, s)
    if res.get("ratios"):
        a, b = res["compared"]
        m = res.get("source_images")
        if m and any(n % m for n in (a, b)):
            lines += ["", f"note: the source lists {m} images and N={a} and N={b} are not both whole multiples of "
                          f"{m}: the two corpora hold other mixes of them, and a per-image cost that depends on "
                          "the image moves with the mix, not only with N"]
        lines += ["", f"ratios N={b} / N={a} (same command)",
                  f"{'figure':<28} {'N=' + str(a):>10} {'N=' + str(b):>10} {'ratio':>7}  target"]
        for r in res["ratios"]:
            verdict = "" if r["target"] is None else f"{r['target']}  {_verdict(r['met'])}"
            lines.append(f"{r['name']:<28} {_f(r['small'], 2):>10} {_f(r['large'], 2):>10} {_f(r['ratio'], 2):>7}  "
                         f"{verdict}")
    lines += ["", "targets:"]
    for name, t in res["targets"].items():
        value = t["value"] if not isinstance(t["value"], float) else round(t["value"], 3)
        if isinstance(value, dict):
            value = ", ".join(f"N={k}: {v}" for k, v in value.items())
        lines.append(f"  {name:<34} {_verdict(t['met'])}"
                     f"  ({t['target']}; {value})")
    load = res.get("load_average")
    if load:
        lines.append("machine load (1-min average) at each size's start and end: " +
                     ", ".join(f"N={n}: {v[0]:.1f} -> {v[1]:.1f}" for n, v in load.items()) +
                     f" on {os.cpu_count()} cores")
    return "\n".join(lines)


def echo_to(stream=None) -> Callable[[bytes], None]:
    """A :class:`Monitor` ``echo`` that passes the command's stderr through to ``stream``."""
    out = stream or sys.stderr

    def echo(chunk: bytes) -> None:
        try:
            out.buffer.write(chunk)
            out.flush()
        except (AttributeError, ValueError):
            out.write(chunk.decode(errors="replace"))
    return echo
