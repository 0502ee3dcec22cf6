"""Serve the scheduled runs on this machine (no work pool needed): the incremental refresh
nightly and the full retrain weekly, both on one run directory.

    export PREFECT_HOME=$PWD/runs/prod/.prefect PREFECT_API_URL=http://127.0.0.1:4200/api
    prefect server start --host 127.0.0.1 &        # cron schedules fire only with a server
    python deployments/serve.py --source DATA_DIR --run-dir runs/prod
    prefect deployment run 'scheduled_refresh/nightly-refresh'     # a run now, besides the cron
    prefect deployment run 'scheduled_refresh/weekly-retrain'

Each firing ingests SOURCE again into RUN_DIR (only new and changed images are decoded); the
nightly one then labels the new images with the last round's models (`wsseg refresh`: nothing is
trained), the weekly one trains (`wsseg train`: what the new images change is computed again).
MLflow runs go to RUN_DIR/mlflow.db (unless MLFLOW_TRACKING_URI says otherwise). This process
must keep running: it is what executes the runs the server schedules.
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
    ap.add_argument("--source", required=True, help="dataset folder (labels.csv or VOC layout), ingested again at "
                                                    "every run")
    ap.add_argument("--run-dir", default="runs/prod",
                    help="the run directory both schedules work on, from run to run (default runs/prod)")
    ap.add_argument("--refresh-cron", "--cron", dest="refresh_cron", default="0 3 * * *",
                    help="cron schedule of the incremental refresh (default: daily at 03:00); --cron is an alias")
    ap.add_argument("--retrain-cron", default="0 4 * * 0",
                    help="cron schedule of the full retrain (default: Sundays at 04:00)")
    ap.add_argument("--timezone", default="UTC",
                    help="IANA time zone the cron schedules are read in, e.g. Europe/Berlin (default UTC)")
    ap.add_argument("--config", type=Path, default=None, help="JSON file with WSSSConfig fields")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2, help="Dask worker processes of a run")
    ap.add_argument("--register", metavar="NAME", default=None,
                    help="register the final model of each training as a new version of the MLflow registered "
                         "model NAME")
    ap.add_argument("--name", default="nightly-refresh",
                    help="name of the refresh deployment (a run now: prefect deployment run "
                         "'scheduled_refresh/NAME'; default nightly-refresh)")
    ap.add_argument("--retrain-name", default="weekly-retrain",
                    help="name of the retrain deployment (default weekly-retrain)")
    args = ap.parse_args(argv)

    run_dir = Path(args.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{run_dir / 'mlflow.db'}")
    os.environ.setdefault("DASK_TEMPORARY_DIRECTORY", str(run_dir / "dask-scratch"))

    from prefect import flow, serve
    from prefect.schedules import Cron
    from prefect.settings import PREFECT_API_URL

    from wsseg.tasks.config import WSSSConfig

    if not PREFECT_API_URL.value():
        print("serve.py: PREFECT_API_URL is not set: start a Prefect server (prefect server start --host "
              "127.0.0.1) and export PREFECT_API_URL=http://127.0.0.1:4200/api; schedules fire only with a "
              "server", file=sys.stderr)
        return 2
    config = WSSSConfig.model_validate(json.loads(args.config.read_text()) if args.config else {})
    # Cron refuses an unknown time zone or a bad cron string, before anything is served
    schedules = {m: Cron(c, timezone=args.timezone) for m, c in (("refresh", args.refresh_cron),
                                                                 ("retrain", args.retrain_cron))}
    # The flow is loaded from its source file, and each run executes it from there in a fresh
    # process (`python -m prefect.engine`). Serving the imported flow object instead hands it to
    # the run's process by cloudpickle *by value* (flows.schedule.scheduled_refresh is the Flow,
    # not its function, so the function is not found by name), and a function pickled by value
    # carries only the globals its bytecode uses: the names its signature mentions only as
    # postponed annotations (`from __future__ import annotations`), WSSSConfig among them, are
    # missing, and Prefect cannot build the parameter model of scheduled_refresh (nor of
    # train_wsss, which it calls). Loaded from source, each run also picks up the current code.
    scheduled = flow.from_source(source=str(REPO), entrypoint=ENTRYPOINT)
    params = {"source": str(Path(args.source).resolve()), "run_dir": str(run_dir),
              "config": config.model_dump(mode="json"), "workers": args.workers, "model_name": args.register}
    serve(
        scheduled.to_deployment(
            name=args.name, schedules=[schedules["refresh"]], parameters={**params, "mode": "refresh"},
            tags=["wsseg", "refresh"],
            description="Ingest the source again and label the new images with the last round's models."),
        scheduled.to_deployment(
            name=args.retrain_name, schedules=[schedules["retrain"]], parameters={**params, "mode": "retrain"},
            tags=["wsseg", "retrain"],
            description="Ingest the source again and train: what the new images change is computed again."))
    return 0


if __name__ == "__main__":
    sys.exit(main())
