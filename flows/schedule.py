"""The flow the schedules run, on one run directory that persists from run to run.

* ``mode="refresh"`` (nightly): ingest the source again (only new and changed images are
  decoded; removed ones leave the corpus) and label what is new with the last round's models,
  training nothing (flow ``refresh``). When the run directory has no finished round yet, or its
  class list or configuration changed since, the models cannot label: it trains instead.
* ``mode="retrain"`` (weekly): ingest again and train: every result whose class list, corpus
  content or configuration changed is computed again (the week's new images enter the models),
  and the rest is reused.

Both hold the run directory's writer lock, as the CLI's commands do, so the two schedules never
write it at once (the later one fails at once, naming the holder).
"""
from __future__ import annotations

import sys

from prefect import flow

from wsseg.flows.naming import FlowRunName
from wsseg.flows.runtime import dask_cluster, on_cluster
from wsseg.flows.wsss import ingest, refresh, train_wsss
from wsseg.tasks.config import WSSSConfig
from wsseg.tasks.store import Store
from wsseg.tasks.wsss import refresh as rf

MODES = ("refresh", "retrain")


@flow(name="scheduled_refresh", flow_run_name=FlowRunName("scheduled-{mode}"))
def scheduled_refresh(source: str, run_dir: str, config: WSSSConfig = WSSSConfig(), mode: str = "refresh",
                      workers: int = 2, dask_address: str | None = None, model_name: str | None = None) -> dict:
    """Ingest ``source`` into ``run_dir`` again, then refresh (``mode="refresh"``) or retrain
    (``mode="retrain"``); see the module docstring. The final model of a training is registered
    as a new version of the MLflow registered model ``model_name`` when given. Returns
    ``mode``, ``did`` (``refresh`` or ``train``), ``ingest`` and the summary of what it did."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {', '.join(MODES)}")
    store = Store(run_dir)
    with store.lock(f"scheduled {mode}"), dask_cluster(dask_address, workers, store.root) as address:
        ingested = on_cluster(ingest, address)(source, run_dir)
        if mode == "refresh":
            rounds = store.finished_rounds()
            why = rf.refresh_problem(store, rounds[-1], config) if rounds else "no finished round yet"
            if why is None:
                return {"mode": mode, "did": "refresh", "ingest": ingested,
                        "refresh": on_cluster(refresh, address)(run_dir)}
            print(f"  [scheduled refresh] cannot refresh ({why}): training instead", file=sys.stderr, flush=True)
        summary = on_cluster(train_wsss, address)(run_dir, config, address, model_name=model_name)
    return {"mode": mode, "did": "train", "ingest": ingested, "train": summary}
