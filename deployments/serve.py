"""Serve the scheduled refresh on this machine (no work pool needed).

    export PREFECT_HOME=$PWD/runs/prod/.prefect PREFECT_API_URL=http://127.0.0.1:4200/api
    prefect server start --host 127.0.0.1 &        # cron schedules fire only with a server
    python deployments/serve.py --source DATA_DIR --runs-root runs/prod --cron "0 3 * * *"
    prefect deployment run 'scheduled_refresh/nightly-refresh'     # a run now, besides the cron

Each firing ingests SOURCE again (only new or changed images cost work) and trains in
RUNS_ROOT/<timestamp>/, with MLflow runs in RUNS_ROOT/mlflow.db (unless MLFLOW_TRACKING_URI says
otherwise). This process must keep running: it is what executes the runs the server schedules.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENTRYPOINT = "flows/schedule.py:scheduled_refresh"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", required=True, help="dataset folder (labels.csv or VOC layout)")
    ap.add_argument("--runs-root", "--run-dir", dest="runs_root", default="runs/prod",
                    help="folder of the scheduled runs: each run trains in RUNS_ROOT/<UTC timestamp>/, "
                         "RUNS_ROOT/latest points at the newest (default runs/prod)")
    ap.add_argument("--cron", default="0 3 * * *", help="cron schedule (default: daily at 03:00)")
    ap.add_argument("--timezone", default="UTC",
                    help="IANA time zone the cron schedule is read in, e.g. Europe/Berlin (default UTC)")
    ap.add_argument("--config", type=Path, default=None, help="JSON file with WSSSConfig fields")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2, help="Dask worker processes of a run")
    ap.add_argument("--register", metavar="NAME", default=None,
                    help="register each run's final model as a new version of the MLflow registered model NAME")
    ap.add_argument("--name", default="nightly-refresh",
                    help="deployment name (runs are started with: prefect deployment run 'scheduled_refresh/NAME')")
    args = ap.parse_args(argv)

    root = Path(args.runs_root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
    os.environ.setdefault("DASK_TEMPORARY_DIRECTORY", str(root / "dask-scratch"))

    from prefect import flow
    from prefect.schedules import Cron
    from prefect.settings import PREFECT_API_URL

    from tasks.config import WSSSConfig

    if not PREFECT_API_URL.value():
        print("serve.py: PREFECT_API_URL is not set: start a Prefect server (prefect server start --host "
              "127.0.0.1) and export PREFECT_API_URL=http://127.0.0.1:4200/api; schedules fire only with a "
              "server", file=sys.stderr)
        return 2
    config = WSSSConfig.model_validate(json.loads(args.config.read_text()) if args.config else {})
    schedule = Cron(args.cron, timezone=args.timezone)  # refuses an unknown time zone or a bad cron string
    # The flow is loaded from its source file, and each run executes it from there in a fresh
    # process (`python -m prefect.engine`). Serving the imported flow object instead hands it to
    # the run's process by cloudpickle *by value* (flows.schedule.scheduled_refresh is the Flow,
    # not its function, so the function is not found by name), and a function pickled by value
    # carries only the globals its bytecode uses: the names its signature mentions only as
    # postponed annotations (`from __future__ import annotations`), WSSSConfig among them, are
    # missing, and Prefect cannot build the parameter model of scheduled_refresh (nor of
    # train_wsss, which it calls). Loaded from source, each run also picks up the current code.
    refresh = flow.from_source(source=str(REPO), entrypoint=ENTRYPOINT)
    refresh.serve(
        name=args.name, schedules=[schedule],
        parameters={"source": str(Path(args.source).resolve()), "runs_root": str(root),
                    "config": config.model_dump(mode="json"), "workers": args.workers,
                    "model_name": args.register},
        tags=["wsseg", "refresh"],
        description="Re-ingest the corpus and run refresh rounds until convergence.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
