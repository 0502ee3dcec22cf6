"""`wsseg ui` in a real browser: a small run on 8 sample photos, then the Prefect dashboard and the
MLflow UI of its run directory, loaded in headless Chromium (Debian's package, driven by
Playwright). The rendered pages must show the round table artifact, the run's log lines (our
progress lines) and the overlay picture; screenshots are saved in the run directory. SIGTERM to
`wsseg ui` must stop both servers.

Chromium comes from the Debian package (`make test` and `.ci/run` install it when missing);
where it is missing this test fails and says so: it never passes without a browser."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from conftest import copy_sample

ROOT = Path(__file__).resolve().parents[1]
IDS = ["11_21_s", "12_25_s", "12_27_s", "12_33_s", "12_6_s", "12_8_s", "14_13_s", "14_29_s"]
# one round, tiny networks: the pages need a run, not a good one
TINY = {"classifier": {"epochs": 3, "size": 96, "width": 8, "stride": 16, "batch_size": 8, "cam_scales": [1.0]},
        "mil": {"iterations": 1, "epochs": 2},
        "proposals": {"epochs": 2},
        "segmentation": {"epochs": 1, "crop": 96, "batch_size": 4, "num_workers": 0},
        "max_rounds": 1, "shard_size": 8}
# `wsseg demo` on the small copy: ingest and train in one command (one API server, one cluster)
DEMO = ("import sys, wsseg.flows.cli as c, wsseg.flows.commands as m; m.SAMPLE = __import__('pathlib').Path(sys.argv[1]); "
        "sys.exit(c.main(['demo', *sys.argv[2:]]))")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="module")
def chromium() -> str:
    """The browser, checked before the run is made (a missing one fails at once)."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.fail("Chromium is not installed, so the dashboards cannot be checked in a browser: install the "
                    "Debian package (`apt-get install -y chromium`; `make test` and .ci/run do it when they may)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.fail("the Python package playwright is missing: pip install -r requirements.lock")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def call(url: str, body: dict | None = None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"},
                                 method="GET" if body is None else "POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)


class Lines:
    """The stdout lines of a process, read in a thread."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._read, args=(proc.stdout,), daemon=True)
        self.thread.start()

    def _read(self, stream):
        for line in stream:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, proc: subprocess.Popen, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.lines:
                if m := re.search(pattern, line):
                    return m
            if proc.poll() is not None:
                break
            time.sleep(0.3)
        raise AssertionError(f"no line matching {pattern!r} from `wsseg ui` (exit {proc.poll()}): {self.lines}")


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> Path:
    """A finished one-round run (through the CLI, so its Prefect state is its own PREFECT_HOME's)."""
    base = tmp_path_factory.mktemp("ui")
    src = copy_sample(base / "src", IDS)
    run = base / "run"
    (base / "tiny.json").write_text(json.dumps(TINY))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_TRACKING"))}
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", DEMO, str(src), "--run-dir", str(run), "--workers", "1",
                           "--config", str(base / "tiny.json")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"wsseg demo: {src} -> " in done.stdout, done.stdout  # the small copy, not the bundled sample
    print(f"demo run: {time.monotonic() - t0:.0f}s")
    # the terminal stays quiet: our own progress lines, no Prefect INFO records
    assert "  [classifier] " in done.stderr
    assert not re.search(r"\|\s*INFO\s*\|", done.stderr + done.stdout), done.stderr
    # where the demo's figures come from goes with them (`wsseg bench report` prints it)
    prov = json.loads((run / "summary.json").read_text())["provenance"]
    assert prov["command"] == f"wsseg demo --run-dir {run} --workers 1 --config {base / 'tiny.json'}", prov
    assert prov["load_average"]["end"] is not None and prov["machine"]["cores"] == os.cpu_count()
    return run


@pytest.mark.command("demo", "ui")
def test_ui_dashboards_in_chromium(chromium, demo_run):
    exe = chromium
    from playwright.sync_api import sync_playwright

    run = demo_run
    pport, mport = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_TRACKING"))}
    t0 = time.monotonic()
    ui = subprocess.Popen([sys.executable, "-m", "wsseg", "ui", "--run-dir", str(run), "--prefect-port",
                           str(pport), "--mlflow-port", str(mport)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    out = Lines(ui)
    try:
        P = out.wait_for(r"Prefect UI:\s+(http://127\.0\.0\.1:\d+)", ui, 240).group(1)
        M = out.wait_for(r"MLflow UI:\s+(http://127\.0\.0\.1:\d+)", ui, 240).group(1)
        assert (P, M) == (f"http://127.0.0.1:{pport}", f"http://127.0.0.1:{mport}")
        up = time.monotonic() - t0
        servers = psutil.Process(ui.pid).children(recursive=True)
        with urllib.request.urlopen(P + "/", timeout=30) as r:  # the dashboard, not a 404
            assert r.status == 200 and "<html" in r.read().decode().lower()

        # ---- REST: flow runs, their log records (our progress lines), artifacts, MLflow runs
        flows = {f["id"]: f["name"] for f in call(P + "/api/flows/filter", {})}
        runs = {flows[fr["flow_id"]]: fr for fr in call(P + "/api/flow_runs/filter", {})}
        assert {"ingest", "train_wsss", "refresh_round"} <= set(runs), runs
        logs = {name: [lg["message"] for lg in call(P + "/api/logs/filter", {
            "logs": {"flow_run_id": {"any_": [fr["id"]]}}, "limit": 200})] for name, fr in runs.items()}
        artifacts = call(P + "/api/artifacts/filter", {"artifacts": {"type": {"any_": ["markdown"]}}})
        report = {"flow_runs": {n: {"id": runs[n]["id"], "state": runs[n]["state_name"], "logs": len(m),
                                    "progress_lines": sum(bool(re.match(r"\[[^\]]+\] ", x)) for x in m)}
                                for n, m in logs.items()},
                  "markdown_artifacts": {a["key"]: flows[next(fr["flow_id"] for fr in runs.values()
                                                               if fr["id"] == a["flow_run_id"])]
                                         for a in artifacts}}
        assert any(x.startswith("[features] ") for x in logs["train_wsss"]), logs["train_wsss"]
        assert any(x.startswith("[classifier] ") for x in logs["train_wsss"]), logs["train_wsss"]
        assert any(x.startswith("[r0 pseudo-labels] ") for x in logs["refresh_round"]), logs["refresh_round"]
        assert report["markdown_artifacts"].get("round-0") == "refresh_round", report
        assert report["markdown_artifacts"].get("train-wsss") == "train_wsss", report
        exp = call(M + "/api/2.0/mlflow/experiments/get-by-name?experiment_name=wsseg")["experiment"]
        mruns = call(M + "/api/2.0/mlflow/runs/search", {"experiment_ids": [exp["experiment_id"]]})["runs"]
        round0 = next(r["info"]["run_id"] for r in mruns if r["info"]["run_name"] == "round-0")
        files = call(f"{M}/api/2.0/mlflow/artifacts/list?run_id={round0}&path=overlays")["files"]
        assert [f["path"] for f in files] == ["overlays/overlay.png"], files
        report["mlflow"] = {"experiment": exp["experiment_id"], "runs": [r["info"]["run_name"] for r in mruns],
                            "round-0 overlays": files}
        (run / "ui-check.json").write_text(json.dumps(report, indent=2))
        print(json.dumps(report, indent=2))

        # ---- the rendered pages
        shots = run / "screenshots"
        shots.mkdir(exist_ok=True)
        fr = runs["refresh_round"]["id"]
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(90_000)
            # Prefect: the round's flow run page opens on its logs
            page.goto(f"{P}/runs/flow-run/{fr}")
            page.get_by_text("[r0 pseudo-labels]").first.wait_for()
            assert page.get_by_text("[r0 preliminary]").count() >= 1
            assert "This run didn't generate logs" not in page.inner_text("body")
            page.screenshot(path=shots / "prefect-flow-run-logs.png", full_page=True)
            # its artifacts tab lists the round table; the artifact's page renders it as a table
            page.get_by_text("Artifacts", exact=True).first.click()
            page.get_by_text("round-0", exact=True).first.wait_for()
            page.screenshot(path=shots / "prefect-flow-run-artifacts.png", full_page=True)
            page.get_by_text("round-0", exact=True).first.click()
            page.locator("table").filter(has_text="pseudo_label_miou").first.wait_for()
            page.screenshot(path=shots / "prefect-round-table.png", full_page=True)
            # the parent flow run's logs carry the classifier's progress
            page.goto(f"{P}/runs/flow-run/{runs['train_wsss']['id']}")
            page.get_by_text("[classifier]").first.wait_for()
            page.screenshot(path=shots / "prefect-train-wsss-logs.png", full_page=True)
            # MLflow: the round's run page, its overlay picture open in the artifacts view
            page.goto(f"{M}/#/experiments/{exp['experiment_id']}/runs/{round0}/artifacts/overlays/overlay.png")
            page.get_by_text("round-0").first.wait_for()
            img = page.locator("img[src^='blob:']").first
            img.wait_for()
            page.wait_for_function("e => e.complete && e.naturalWidth > 100", arg=img.element_handle())
            size = img.evaluate("e => [e.naturalWidth, e.naturalHeight]")
            page.screenshot(path=shots / "mlflow-round-0-overlay.png", full_page=True)
            browser.close()
        from PIL import Image

        png = Image.open(run / "rounds" / "r000" / "overlay.png").size
        assert list(size) == list(png), (size, png)  # the picture shown is the round's overlay
        for s in shots.iterdir():
            assert s.stat().st_size > 10_000, s

        # ---- SIGTERM stops both servers
        ui.send_signal(signal.SIGTERM)
        assert ui.wait(timeout=60) == 0, out.lines
        gone, alive = psutil.wait_procs(servers, timeout=10)
        assert not alive, f"still running after SIGTERM: {alive}"
        assert not listening(pport) and not listening(mport)
        print(f"servers up in {up:.0f}s; test {time.monotonic() - t0:.0f}s; screenshots in {shots}")
    finally:
        if ui.poll() is None:
            ui.send_signal(signal.SIGTERM)
            try:
                ui.wait(timeout=30)
            except subprocess.TimeoutExpired:
                ui.kill()


@pytest.mark.command("evaluate", "refresh")
def test_evaluate_and_refresh_commands_on_the_demo_run(demo_run):
    """`wsseg evaluate` and `wsseg refresh` through the CLI on the finished run: evaluate reports the
    figure the round recorded for the same labels; refresh finds every image labelled already."""
    run = demo_run
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_TRACKING"))}
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    common = ["--run-dir", str(run), "--workers", "1", "--json"]
    ev = subprocess.run([sys.executable, "-m", "wsseg", "evaluate", *common], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
    assert ev.returncode == 0, ev.stderr
    res = json.loads(ev.stdout.strip().splitlines()[-1])
    final = json.loads((run / "summary.json").read_text())["final_round"]
    recorded = json.loads((run / "rounds" / f"r{final:03d}" / "round.json").read_text())
    assert (res["round"], res["source"], res["split"]) == (final, "pseudo", "train")
    assert res["miou"] == pytest.approx(recorded["pseudo_label_miou"], abs=1e-9)
    assert set(res["per_class_iou"]) and all(v is None or 0.0 <= v <= 1.0 for v in res["per_class_iou"].values())
    rf = subprocess.run([sys.executable, "-m", "wsseg", "refresh", *common], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
    assert rf.returncode == 0, rf.stderr
    s = json.loads(rf.stdout.strip().splitlines()[-1])
    assert (s["images"], s["labelled"]) == (len(IDS), 0)
    assert json.loads((run / "refresh.json").read_text())["labelled"] == 0
