"""The flow a schedule runs: re-ingest a source folder and train, in a fresh run directory.

Each scheduled run gets ``RUNS_ROOT/<UTC timestamp>/``; the per-image feature cache is shared
through ``RUNS_ROOT/cache`` (it is content-addressed, so only new or changed images cost
anything) and ``RUNS_ROOT/latest`` points at the newest finished run.
"""
from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

from prefect import flow

from tasks.config import WSSSConfig
from flows.runtime import dask_cluster, on_cluster
from flows.wsss import ingest, train_wsss


@flow(name="scheduled_refresh")
def scheduled_refresh(source: str, runs_root: str, config: WSSSConfig = WSSSConfig(), workers: int = 2,
                      dask_address: str | None = None, model_name: str | None = None) -> dict:
    """Ingest ``source`` again and train in a new ``runs_root/<UTC timestamp>/``; the final model
    is registered as a new version of the MLflow registered model ``model_name`` when given."""
    root = Path(runs_root).resolve()
    run_dir = root / dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    run_dir.mkdir(parents=True)
    (root / "cache").mkdir(exist_ok=True)
    (run_dir / "cache").symlink_to(root / "cache", target_is_directory=True)
    with dask_cluster(dask_address, workers, run_dir) as address:
        on_cluster(ingest, address)(source, str(run_dir))
        summary = on_cluster(train_wsss, address)(str(run_dir), config, address, model_name=model_name)
    latest = root / "latest"
    tmp = root / ".latest.tmp"
    if tmp.is_symlink():
        tmp.unlink()
    tmp.symlink_to(run_dir.name, target_is_directory=True)
    os.replace(tmp, latest)
    return summary
