"""What one Prefect shard task costs on a Dask worker: no-op shard tasks through
``flows.wsss.run_shards`` on a local cluster (the commands' own set-up: ``flows.runtime.dask_cluster``
and its local Prefect API), each batch size twice (the first warms up).

Prints, for batches of 10 and N tasks, the wall seconds of ``run_shards`` and the CPU seconds of the
whole process tree (flow process, Prefect API server, Dask scheduler, nannies, workers); the marginal
figures per task come from the difference of the two batches, so fixed costs drop out.

    python tools/bench_task_cost.py --run-dir runs/task-cost --tasks 40 --workers 2
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def tree_cpu() -> float:
    import psutil

    me = psutil.Process()
    total = 0.0
    for p in [me] + me.children(recursive=True):
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", required=True, help="scratch folder for the Prefect and Dask state")
    ap.add_argument("--tasks", type=int, default=200, help="tasks in the large batch (default 200; 40 is enough on a busy machine)")
    ap.add_argument("--workers", type=int, default=2, help="Dask worker processes (default 2)")
    args = ap.parse_args()
    from wsseg.flows.runtime import prepare

    run = prepare(args.run_dir)
    n = args.tasks
    from prefect import flow, task

    from wsseg.flows.runtime import dask_cluster, on_cluster
    from wsseg.flows.wsss import SHARD_TASK, run_shards

    @task(name="noop-shard", **SHARD_TASK)
    def noop_shard(ids: list[str], run_dir: str) -> dict:
        return {"images": len(ids)}

    @flow(name="task-cost")
    def cost(batches: list[int]) -> list[dict]:
        out = []
        for b in batches:
            shards = [[f"img{i:07d}"] for i in range(b)]
            c0, t0 = tree_cpu(), time.perf_counter()
            res = run_shards(noop_shard, shards, f"noop x{b}", run_dir=str(run))
            out.append({"tasks": b, "wall_s": time.perf_counter() - t0, "cpu_s": tree_cpu() - c0,
                        "images": sum(r["images"] for r in res)})
        return out

    with dask_cluster(None, args.workers, Path(run)) as address:
        rows = on_cluster(cost, address)([10, 10, n, n])  # each size twice: the first batch warms up
    for r in rows:
        print(f"{r['tasks']:>5} tasks: wall {r['wall_s']:.2f} s ({1000 * r['wall_s'] / r['tasks']:.1f} ms/task), "
              f"cpu {r['cpu_s']:.2f} s ({1000 * r['cpu_s'] / r['tasks']:.1f} core-ms/task)")
    a, b = rows[1], rows[3]
    dn = b["tasks"] - a["tasks"]
    print(f"marginal per task (batch of {b['tasks']} minus batch of {a['tasks']}): wall "
          f"{1000 * (b['wall_s'] - a['wall_s']) / dn:.1f} ms, cpu {1000 * (b['cpu_s'] - a['cpu_s']) / dn:.1f} core-ms "
          f"({args.workers} workers, all processes)")


if __name__ == "__main__":
    main()
