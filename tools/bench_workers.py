"""Time one real shard stage on a local Dask cluster with and without Dask's default
``MALLOC_TRIM_THRESHOLD_`` in the workers' environment (see ``flows.runtime.worker_environ``).

The stage is step 1 of a refresh round after round 0 (``tasks.wsss.pipeline.preliminary_shard``:
the round's model on every image, restricted to the tags), run on a finished ``wsseg train``
run directory (``make demo`` leaves one in runs/default) into a scratch round that is deleted
afterwards. The two settings alternate, ``--repeats`` times each, each on a fresh cluster;
the script prints every timing, the medians and their ratio.

    python tools/bench_workers.py --run-dir runs/default --workers 2 --repeats 2
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def time_stage(run: Path, scratch: int, shards: list[list[str]], key: str, cfg, workers: int,
               environ: dict) -> tuple[float, float]:
    """(wall seconds, system CPU seconds of the workers) of the stage on a fresh cluster."""
    import dask
    from distributed import Client, LocalCluster

    from wsseg.tasks.store import Store
    from wsseg.tasks.wsss import pipeline as pl

    def sys_seconds() -> float:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_stime

    shutil.rmtree(Store(run).round_dir(scratch), ignore_errors=True)
    os.environ.pop("MALLOC_TRIM_THRESHOLD_", None)  # a previous cluster's nanny left Dask's value here
    with dask.config.set({"distributed.nanny.pre-spawn-environ": environ}), \
            LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address="127.0.0.1:0",
                         silence_logs=40) as cluster, Client(cluster) as client:
        trim = set(client.run(lambda: os.environ.get("MALLOC_TRIM_THRESHOLD_")).values())
        assert trim == {environ.get("MALLOC_TRIM_THRESHOLD_") and str(environ["MALLOC_TRIM_THRESHOLD_"])}, trim
        s0 = sum(client.run(sys_seconds).values())
        t0 = time.perf_counter()
        client.gather([client.submit(pl.preliminary_shard, str(run), ids, scratch, key, cfg, pure=False)
                       for ids in shards])
        wall = time.perf_counter() - t0
        system = sum(client.run(sys_seconds).values()) - s0
    shutil.rmtree(Store(run).round_dir(scratch), ignore_errors=True)
    return wall, system


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", default="runs/default", help="a finished `wsseg train` run (default runs/default)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="timings per setting (default 2)")
    args = ap.parse_args(argv)

    import dask
    import distributed  # noqa: F401  (loads the distributed.* defaults into dask.config)

    from wsseg.flows.runtime import worker_environ
    from wsseg.tasks.store import Store

    from wsseg.tasks.config import WSSSConfig
    from wsseg.tasks.wsss.feature_cache import feature_key

    run = Path(args.run_dir).resolve()
    store = Store(run)
    trained = [r for r in store.rounds() if store.has_checkpoint("segmenter", r)]
    if store.read_config() is None or not trained:
        print(f"{run}: not a finished `wsseg train` run (no configuration or no round model); run `make demo` "
              "or pass --run-dir", file=sys.stderr)
        return 2
    cfg = WSSSConfig.model_validate(store.read_config())
    ids = [r.image_id for r in store.manifest(cfg.split)]
    size = cfg.shard_size
    shards = [ids[i:i + size] for i in range(0, len(ids), size)]
    key = feature_key(cfg.features)
    scratch = store.rounds()[-1] + 1  # step 1 of the round after the last: the last round's model
    if scratch - 1 != trained[-1]:
        print(f"{run}: its last round has no model yet; finish the run first", file=sys.stderr)
        return 2
    settings = {"dask default": dict(dask.config.get("distributed.nanny.pre-spawn-environ")),
                "wsseg (no trim threshold)": worker_environ()}
    print(f"preliminary stage: {len(ids)} images in {len(shards)} shards, {args.workers} workers, model of "
          f"round {trained[-1]}")
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in settings}
    for i in range(args.repeats):
        for name, environ in settings.items():
            wall, system = time_stage(run, scratch, shards, key, cfg, args.workers, environ)
            times[name].append((wall, system))
            print(f"  run {i + 1} {name:>26}: {wall:6.1f} s wall, {system:6.1f} s system CPU in the workers",
                  flush=True)
    med = {name: statistics.median(w for w, _ in v) for name, v in times.items()}
    for name, m in med.items():
        print(f"median {name:>26}: {m:6.1f} s")
    a, b = med.values()
    print(f"ratio default / wsseg: {a / b:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
