"""MLflow that cannot record stops nothing: one warning line says what was not recorded."""
from __future__ import annotations

import mlflow

from wsseg.tasks.runtime import tracking


def test_unreachable_tracking_server_warns_once_and_the_work_goes_on(tmp_path, monkeypatch, capsys):
    # a port on which nothing listens: every call would fail (after the short retry budget)
    monkeypatch.setattr(tracking, "USER_TRACKING_URI", "http://127.0.0.1:9")
    t = tracking.Tracker(tmp_path)
    done = []
    with t.run("round-0", nested=True) as run_id:
        t.log_params({"a": 1})
        t.log_metrics({"loss": 0.5}, step=0)
        (tmp_path / "x.txt").write_text("x")
        t.log_artifact(tmp_path / "x.txt")
        done.append(run_id)
    assert done == [None] and t.failed is not None
    ours = [line for line in capsys.readouterr().err.splitlines() if line.startswith("wsseg:")]
    assert len(ours) == 1 and "http://127.0.0.1:9" in ours[0] and "could not record" in ours[0], ours
    assert mlflow.active_run() is None


def test_working_tracker_records(tmp_path):
    t = tracking.Tracker(tmp_path)
    with t.run("r") as run_id:
        t.log_metrics({"loss": 0.25}, step=1)
    assert t.failed is None
    mlflow.set_tracking_uri(tracking.tracking_uri(tmp_path))
    assert mlflow.get_run(run_id).data.metrics["loss"] == 0.25
    assert mlflow.get_run(run_id).info.status == "FINISHED"
