"""The final model as an MLflow model: pytorch flavour with a tensor signature and pinned
requirements, registered under a name; `mlflow.pyfunc.load_model(...).predict` labels an image.
MLflow runs opened inside a Prefect flow run carry its id and URL; run URLs point at the UI."""
from __future__ import annotations

import mlflow
import numpy as np
import yaml
from PIL import Image

from conftest import SAMPLE
from wsseg.tasks.runtime import tracking


def test_logged_model_is_registered_and_labels_an_image(tmp_path):
    from wsseg import models
    from wsseg.tasks.common.training import to_input

    classes = (SAMPLE / "classes.txt").read_text().split()
    net = models.build_model("small", len(classes), in_channels=3, width=16)
    t = tracking.Tracker(tmp_path)
    with t.run("train_wsss") as run_id:
        logged = t.log_model(net, "model", in_channels=3, num_classes=len(classes), register="wsseg-test")
    assert t.failed is None and logged["registered_version"] == 1, (t.failed, logged)

    mlflow.set_tracking_uri(tracking.tracking_uri(tmp_path))
    client = mlflow.MlflowClient()
    registered = client.get_registered_model("wsseg-test")
    version = client.get_model_version("wsseg-test", "1")
    print("registered:", registered.name, "version", version.version, version.status, "run", version.run_id)
    assert version.run_id == run_id and version.status == "READY"

    image = np.asarray(Image.open(SAMPLE / "images" / "12_25_s.jpg").convert("RGB"))
    x = to_input(image, None)[None]
    loaded = mlflow.pyfunc.load_model("models:/wsseg-test/1")
    scores = loaded.predict(x)
    assert scores.shape == (1, len(classes), *image.shape[:2]) and scores.dtype == np.float32
    label = scores.argmax(1)[0]
    assert label.shape == image.shape[:2] and 0 <= label.min() and label.max() < len(classes)

    sig = loaded.metadata.signature
    assert sig.inputs.inputs[0].shape == (-1, 3, -1, -1) and sig.outputs.inputs[0].shape == (-1, len(classes), -1, -1)
    local = mlflow.artifacts.download_artifacts("models:/wsseg-test/1", dst_path=str(tmp_path / "dl"))
    reqs = (tmp_path / "dl" / "requirements.txt").read_text().split()
    assert "torch==2.13.0" in reqs and any(r.startswith("numpy==") for r in reqs), reqs
    assert "pytorch" in yaml.safe_load(open(f"{local}/MLmodel"))["flavors"]
    assert t.run_url(run_id) == f"http://127.0.0.1:5000/#/experiments/{t.experiment_id}/runs/{run_id}"


def test_runs_carry_the_prefect_flow_run_and_run_urls_are_overridable(tmp_path, monkeypatch):
    from prefect.settings import PREFECT_UI_URL, temporary_settings

    monkeypatch.setenv("PREFECT__FLOW_RUN_ID", "0b7c6c1e-0000-4000-8000-000000000001")
    monkeypatch.setenv("WSSEG_MLFLOW_UI_URL", "http://mlflow.example:8080/")
    t = tracking.Tracker(tmp_path)
    with temporary_settings({PREFECT_UI_URL: "http://127.0.0.1:4200"}):
        with t.run("r", tags={"flow": "x"}) as run_id:
            pass
    mlflow.set_tracking_uri(tracking.tracking_uri(tmp_path))
    tags = mlflow.get_run(run_id).data.tags
    assert tags["prefect.flow_run_id"] == "0b7c6c1e-0000-4000-8000-000000000001" and tags["flow"] == "x"
    assert tags["prefect.flow_run_url"] == "http://127.0.0.1:4200/runs/flow-run/0b7c6c1e-0000-4000-8000-000000000001"
    assert t.run_url(run_id).startswith("http://mlflow.example:8080/#/experiments/")
    # outside a flow run: no Prefect tags
    monkeypatch.delenv("PREFECT__FLOW_RUN_ID")
    with t.run("s") as other:
        pass
    assert not any(k.startswith("prefect.") for k in mlflow.get_run(other).data.tags)


def test_a_rerun_that_trains_nothing_logs_no_second_model(tmp_path, tiny_run, cluster, prefect_harness):
    """`wsseg train` again on a finished run computes nothing, and logs no model again: its MLflow
    run points at the one logged (26 MB and 13-21 s a rerun on msrc21's network before); a final
    model that is not the logged file is logged."""
    import json
    import shutil

    import torch

    from conftest import TINY
    from wsseg.flows.runtime import on_cluster
    from wsseg.flows.wsss import train_wsss
    from wsseg.tasks.config import WSSSConfig

    run = shutil.copytree(tiny_run, tmp_path / "run", symlinks=True)
    before = json.loads((run / "summary.json").read_text())
    assert before["mlflow_model"]["model_uri"].startswith("models:/m-") and len(before["final_model_sha256"]) == 64

    def train() -> dict:
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(2)
            return on_cluster(train_wsss, cluster)(str(run), WSSSConfig.model_validate(TINY), cluster)
        finally:
            torch.set_num_threads(threads)

    mlflow.set_tracking_uri(tracking.tracking_uri(run))
    models_before = len(mlflow.search_logged_models(output_format="list"))
    again = train()
    assert again["mlflow_model"] == before["mlflow_model"] and again["final_model_sha256"] == before["final_model_sha256"]
    mlflow.set_tracking_uri(tracking.tracking_uri(run))
    assert len(mlflow.search_logged_models(output_format="list")) == models_before
    parent = mlflow.get_run(again["mlflow_parent_run_id"])
    assert parent.data.tags["final_model_logged"] == before["mlflow_model"]["model_uri"]

    (run / "summary.json").write_text(json.dumps(before | {"final_model_sha256": "0" * 64}))
    logged = train()
    mlflow.set_tracking_uri(tracking.tracking_uri(run))
    assert logged["mlflow_model"]["model_uri"] != before["mlflow_model"]["model_uri"]
    assert len(mlflow.search_logged_models(output_format="list")) == models_before + 1
