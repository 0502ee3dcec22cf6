"""``wsseg bench train``: the ``bench-train`` flow (training throughput of a registry network on
real store batches; the work is :mod:`tasks.bench.train`). Prints nothing itself: the CLI prints
:func:`tasks.bench.train.format_summary` of the returned figures, which are also written to
``out`` (JSON) and recorded in the run directory's MLflow.

Import this module only after :func:`flows.runtime.prepare` has set the environment.
"""
from __future__ import annotations

from pathlib import Path

from prefect import flow

from wsseg.flows.naming import FlowRunName
from wsseg.tasks.bench import train as bt
from wsseg.tasks.runtime.tracking import Tracker

__all__ = ["bench_train"]


@flow(name="bench-train", flow_run_name=FlowRunName("bench-train-{model}"))
def bench_train(model: str, out: str | None = None, size: int = 256, batch: int = 8, steps: int = 24,
                warmup: int = 3, workers: int = 1, threads: int | None = 1, options: dict | None = None,
                run_dir: str = "runs/bench-train", device: str = "auto", data: str = str(bt.SAMPLE),
                seed: int = 0, lr: float = 2e-3) -> dict:
    """Measure training throughput of registry network ``model``; see :mod:`tasks.bench.train`."""
    r = bt.run_bench(model, out, size=size, batch=batch, steps=steps, warmup=warmup, workers=workers,
                     threads=threads, options=options, run_dir=run_dir, device=device, data=data, seed=seed, lr=lr)
    tracker = Tracker(Path(run_dir))
    with tracker.run("bench-train"):
        tracker.log_params({"model": model, "options": r["options"], "size": size, "batch": batch, "steps": steps,
                            "warmup": warmup, "workers": workers, "threads": r["torch_threads"], "device": r["device"],
                            "data": str(data), "seed": seed, "lr": lr})
        tracker.log_metrics({k: r[k] for k in ("images_per_second", "compute_images_per_second", "data_wait_share",
                                               "median_step_seconds", "parameters", "wall_seconds")}
                            | {"peak_rss_mb_main": r["peak_rss_mb"]["main"], "peak_rss_mb_sum": r["peak_rss_mb"]["sum"]})
        if out is not None:
            tracker.log_artifact(Path(out))
    return r
