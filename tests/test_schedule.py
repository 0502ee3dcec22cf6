"""deployments/serve.py as the README runs it: a Prefect server on 127.0.0.1, the two deployments
served against it (the full retrain weekly, the incremental refresh nightly, one run directory),
each started now with `prefect deployment run` and seen to complete: the retrain trains, the
refresh after the source grew labels only the new images and trains nothing; each deployment's
cron keeps the time zone it was given."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from conftest import copy_sample

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
IDS = ["11_21_s", "12_25_s", "12_27_s", "12_33_s", "12_6_s", "12_8_s", "14_13_s", "14_29_s"]
CONFIG = {
    "classifier": {"epochs": 12, "size": 160, "width": 16, "stride": 16, "batch_size": 8},
    "segmentation": {"epochs": 3, "min_steps": 40, "crop": 160, "batch_size": 4,
                     "num_workers": 0},
    "max_rounds": 1, "shard_size": 8}
NEW = ["15_14_s", "16_19_s"]
NAME, CRON, TZ = "test-refresh", "15 2 * * 1-5", "Europe/Berlin"
RETRAIN, RETRAIN_CRON = "test-retrain", "30 4 * * 0"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _api(base: str, path: str, body: dict | None = None):
    req = urllib.request.Request(base + path, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="GET" if body is None else "POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read() or b"null")


def _wait(what: str, fn, timeout: float, procs: dict[str, subprocess.Popen], every: float = 2.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, p in procs.items():
            assert p.poll() is None, f"{name} exited with {p.returncode} while waiting for {what}"
        try:
            value = fn()
            if value:
                return value
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def _stop(p: subprocess.Popen) -> None:
    """Ctrl-C (SIGINT) to the process group the test started, then SIGTERM, then SIGKILL."""
    t = time.monotonic()
    for sig, grace in ((signal.SIGINT, 10), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        if p.poll() is not None:
            break
        try:
            os.killpg(p.pid, sig)
            p.wait(grace)
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            break
    print(f"stopped {p.args[1] if len(p.args) > 1 else p.args[0]} in {time.monotonic() - t:.1f}s")


def _tail(path: Path, n: int = 4000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else ""


def _run_now(base: str, env: dict, dep: dict, log: Path, procs: dict, cwd: Path) -> dict:
    """`prefect deployment run` the deployment, then wait for its flow run to end; the flow run."""
    before = {r["id"] for r in _api(base, "/flow_runs/filter", {"flow_runs": {"deployment_id": {"any_": [dep["id"]]}}})}
    with open(log, "wb") as out:
        subprocess.run([str(BIN / "prefect"), "deployment", "run", f"scheduled_refresh/{dep['name']}"], env=env,
                       stdout=out, stderr=subprocess.STDOUT, check=True, timeout=180, cwd=cwd)
    runs = [r for r in _api(base, "/flow_runs/filter", {"flow_runs": {"deployment_id": {"any_": [dep["id"]]}}})
            if not r["auto_scheduled"] and r["id"] not in before]
    assert len(runs) == 1 and runs[0]["id"] in log.read_text(), runs
    run_id, t = runs[0]["id"], time.monotonic()

    def finished():
        fr = _api(base, f"/flow_runs/{run_id}")
        return fr if fr["state_type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") else None
    fr = _wait(f"the flow run of {dep['name']}", finished, 900, procs, every=3)
    print("flow run:", dep["name"], fr["name"], run_id, fr["state_type"], f"{time.monotonic() - t:.0f}s")
    assert fr["state_type"] == "COMPLETED", fr["state"]
    return fr


def test_served_retrain_and_refresh_run_now_and_keep_their_crons(tmp_path):
    port = _free_port()
    base = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / ".prefect"), "PREFECT_API_URL": base,
           "PREFECT_UI_ENABLED": "false", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_RUNNER_POLL_FREQUENCY": "2", "PREFECT_LOGGING_LEVEL": "INFO",
           "OMP_WAIT_POLICY": "PASSIVE"}
    env.pop("MLFLOW_TRACKING_URI", None)
    src = copy_sample(tmp_path / "src", IDS)
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    run = tmp_path / "prod"
    logs = {n: tmp_path / f"{n}.log" for n in ("server", "serve", "retrain", "refresh")}
    procs: dict[str, subprocess.Popen] = {}
    t0 = time.monotonic()
    try:
        with open(logs["server"], "wb") as out:
            procs["prefect server"] = subprocess.Popen(
                [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp_path)
        _wait("the Prefect server", lambda: _api(base, "/health") is True, 240, procs)
        t_server = time.monotonic() - t0
        with open(logs["serve"], "wb") as out:
            procs["serve.py"] = subprocess.Popen(
                [sys.executable, str(REPO / "deployments" / "serve.py"), "--source", str(src), "--run-dir",
                 str(run), "--refresh-cron", CRON, "--retrain-cron", RETRAIN_CRON, "--timezone", TZ, "--config",
                 str(tmp_path / "config.json"), "--workers", "1", "--name", NAME, "--retrain-name", RETRAIN,
                 "--register", "wsseg-nightly"],
                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp_path)

        def deployment(name):
            def get():
                try:
                    return _api(base, f"/deployments/name/scheduled_refresh/{name}")
                except urllib.error.HTTPError as e:
                    if e.code == 404:
                        return None
                    raise
            return get
        deps = {n: _wait(f"the served deployment {n}", deployment(n), 180, procs) for n in (NAME, RETRAIN)}
        for n, (cron, mode) in {NAME: (CRON, "refresh"), RETRAIN: (RETRAIN_CRON, "retrain")}.items():
            schedules = [(s["schedule"].get("cron"), s["schedule"].get("timezone"), s["active"])
                         for s in deps[n]["schedules"]]
            print("deployment:", n, deps[n]["id"], "schedules:", schedules, "entrypoint:", deps[n]["entrypoint"])
            assert schedules == [(cron, TZ, True)], schedules
            assert deps[n]["parameters"]["mode"] == mode and deps[n]["parameters"]["run_dir"] == str(run.resolve())

        # the weekly retrain, started now: it ingests and trains in the run directory
        _run_now(base, env, deps[RETRAIN], logs["retrain"], procs, tmp_path)
        summary = json.loads((run / "summary.json").read_text())
        assert [r["round"] for r in summary["rounds"]] == ["cam", 0]
        assert (run / "rounds" / "r000" / "model.pt").is_file()
        model_stamp = (run / "rounds" / "r000" / "model.pt").stat().st_mtime_ns

        # MLflow (RUN/mlflow.db): the runs carry the flow runs' ids and URLs, the final model is
        # registered; the Prefect artifact links to the MLflow parent run
        db = sqlite3.connect(run / "mlflow.db")
        tags = dict(db.execute("select key, value from tags where run_uuid = ?",
                               (summary["mlflow_parent_run_id"],)).fetchall())
        versions = db.execute("select name, version, status from model_versions").fetchall()
        db.close()
        print("mlflow parent run tags:", {k: v for k, v in tags.items() if k.startswith("prefect.")})
        print("registered model versions:", versions)
        sub = _api(base, f"/flow_runs/{tags['prefect.flow_run_id']}")
        assert sub["parent_task_run_id"] is not None and sub["name"]  # train_wsss is a subflow of the served run
        assert tags["prefect.flow_run_url"] == f"http://127.0.0.1:{port}/runs/flow-run/{tags['prefect.flow_run_id']}"
        assert versions == [("wsseg-nightly", 1, "READY")]
        arts = _api(base, "/artifacts/filter", {"artifacts": {"key": {"any_": ["train-wsss"]}}})
        assert arts and f"/runs/{summary['mlflow_parent_run_id']})" in arts[0]["data"]
        assert "http://127.0.0.1:5000/#/experiments/" in arts[0]["data"]

        # the source grows; the nightly refresh, started now, labels the new images only
        grown = copy_sample(tmp_path / "new", NEW)
        for f in ("images", "masks"):
            for p in (grown / f).iterdir():
                shutil.copy(p, src / f)
        with open(src / "labels.csv", "a") as f:
            f.write("".join(line + "\n" for line in (grown / "labels.csv").read_text().splitlines()[1:]))
        _run_now(base, env, deps[NAME], logs["refresh"], procs, tmp_path)
        report = json.loads((run / "corpus" / "ingest_report.json").read_text())
        assert report["changes"]["added"] == 2 and report["changes"]["unchanged"] == len(IDS)
        assert report["changes"]["decoded"] == 2  # the unchanged images are not decoded again
        done = json.loads((run / "refresh.json").read_text())
        assert done["round"] == 0 and done["labelled"] == 2 and done["images"] == len(IDS) + 2
        assert (run / "rounds" / "r000" / "model.pt").stat().st_mtime_ns == model_stamp  # nothing trained
        db = sqlite3.connect(run / "mlflow.db")
        assert db.execute("select count(*) from model_versions").fetchone() == (1,)
        db.close()
        arts = _api(base, "/artifacts/filter", {"artifacts": {"key": {"any_": ["refresh"]}}})
        assert arts, "the refresh's artifact"
        print(f"timings: server {t_server:.0f}s, total {time.monotonic() - t0:.0f}s")
    except BaseException:
        for n, p in logs.items():
            print(f"----- {n} log -----\n{_tail(p)}")
        raise
    finally:
        for name in ("serve.py", "prefect server"):
            if name in procs:
                _stop(procs[name])
