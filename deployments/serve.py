"""Serve the scheduled refresh on this machine (no work pool needed).

    export PREFECT_HOME=$PWD/runs/prod/.prefect PREFECT_API_URL=http://127.0.0.1:4200/api
    prefect server start --host 127.0.0.1 &        # cron schedules fire only with a server
    python deployments/serve.py --source DATA_DIR --runs-root runs/prod --cron "0 3 * * *"

Each firing ingests SOURCE again (only new or changed images cost work) and trains in
RUNS_ROOT/<timestamp>/, with MLflow runs in RUNS_ROOT/mlflow.db.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", required=True, help="dataset folder (labels.csv or VOC layout)")
    ap.add_argument("--runs-root", default="runs/prod")
    ap.add_argument("--cron", default="0 3 * * *", help="cron schedule (default: daily at 03:00)")
    ap.add_argument("--timezone", default="UTC")
    ap.add_argument("--config", type=Path, default=None, help="JSON file with WSSSConfig fields")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--name", default="nightly-refresh")
    args = ap.parse_args()

    root = Path(args.runs_root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
    os.environ.setdefault("DASK_TEMPORARY_DIRECTORY", str(root / "dask-scratch"))

    from tasks.config import WSSSConfig
    from flows.schedule import scheduled_refresh

    config = WSSSConfig.model_validate(json.loads(args.config.read_text()) if args.config else {})
    scheduled_refresh.serve(
        name=args.name, cron=args.cron,
        parameters={"source": str(Path(args.source).resolve()), "runs_root": str(root),
                    "config": config.model_dump(mode="json"), "workers": args.workers},
        tags=["wsseg", "refresh"],
        description="Re-ingest the corpus and run refresh rounds until convergence.")


if __name__ == "__main__":
    main()
