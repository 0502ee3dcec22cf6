"""wsseg bench scale (flows.bench_scale, tasks.bench.scale): the bookkeeping on runs and records
whose answers are known by construction, and the command end to end as a user runs it (a real
`dask scheduler` and worker, real `wsseg` subprocesses and Prefect) on copies of the bundled
sample at two tiny sizes. No timing assertion: the benchmark prints figures, it does not judge
them here."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SAMPLE
from wsseg.tasks.bench import scale as ts

ROOT = Path(__file__).resolve().parents[1]
#: trainers small enough for a test; shards of 4 images, so that each stage has several tasks
TINY = {"classifier": {"epochs": 2, "size": 96, "width": 16, "stride": 16, "batch_size": 8},
        "mil": {"iterations": 1, "epochs": 1}, "proposals": {"epochs": 1},
        "segmentation": {"epochs": 1, "crop": 96, "batch_size": 4, "num_workers": 0}, "shard_size": 4}


def _task(name, start, end, flow="train"):
    return {"id": f"{name}@{start}", "name": name, "state": "COMPLETED", "start": start, "end": end,
            "flow_run_id": flow}


def test_train_breakdown_by_construction():
    """Stages from the task runs' names (the round from the name or from the round's flow run),
    worker CPU from the clock records by time, the flow's own stretches from its CPU series."""
    flows = [{"id": "train", "name": "run/train-wsss", "state": "COMPLETED", "start": 5.0, "end": 42.0},
             {"id": "r0", "name": "run/round-0", "state": "COMPLETED", "start": 20.0, "end": 40.0}]
    tasks = [_task("features a..d (4 images)", 10, 11), _task("features e..h (4 images)", 11, 12),
             _task("refresh_round-0", 20, 40),
             _task("round-0/preliminary a..d (4 images)", 21, 23, "r0"),
             _task("round-0/preliminary e..h (4 images)", 23, 25, "r0"),
             _task("round-0/pseudo-labels a..d (4 images)", 30, 31, "r0"),
             _task("round-0/pseudo-labels e..h (4 images)", 31, 32, "r0"),
             _task("evaluate a..h (8 images)", 35, 36, "r0")]
    clock = [{"function": f, "start": t, "cpu_seconds": c} for f, t, c in (
        ("features_shard", 10.1, 1.0), ("features_shard", 11.1, 3.0), ("preliminary_shard", 21.1, 2.0),
        ("preliminary_shard", 23.1, 2.0), ("pseudo_shard", 30.1, 0.5), ("pseudo_shard", 31.1, 0.5),
        ("evaluate_shard", 35.1, 0.1), ("replicate_shard", 36.0, 9.0))]
    series = [(0, 0), (12, 5), (20, 13), (25, 14), (30, 19), (32, 19.5), (35, 22.5), (40, 23), (45, 25)]
    b = ts.train_breakdown(tasks, flows, clock, series, started=0.0, ended=45.0)
    assert set(b["stages"]) == {"features", "r0.preliminary", "r0.pseudo_labels", "r0.evaluate"}
    ms = {k: v["core_ms_per_image"] for k, v in b["totals"].items()}
    assert ms == pytest.approx({"features": 500.0, "preliminary": 500.0, "pseudo_labels": 125.0, "evaluate": 12.5})
    assert b["stages"]["r0.preliminary"]["tasks"] == 2 and b["stages"]["r0.preliminary"]["wall_seconds"] == 4
    want = {"before the flow": (5, 5 * 5 / 12), "classifier": (8, 8), "r0.mil+proposals": (5, 5),
            "r0.segmenter": (3, 3), "after the rounds": (2, 0.8), "after the flow": (3, 1.2)}
    assert list(b["windows"]) == list(want)
    for k, (wall, core) in want.items():
        assert (b["windows"][k]["wall_seconds"], b["windows"][k]["flow_core_seconds"]) == pytest.approx((wall, core)), k
    assert b["rounds"] == {"0": 20.0} and b["flow_seconds"] == 37.0
    runs = ts.task_run_figures(tasks + [dict(_task("features i..j (2 images)", 12, 13), state="FAILED")])
    assert runs["created"] == 9 and runs["shard_tasks"] == 8 and runs["by_stage"]["subflow"] == 1
    assert runs["failed"] == 1 and runs["by_stage"]["features"] == 3


def test_ratios_and_targets_by_construction():
    def size(n, stage_ms, flow_mb, worker_mb, status_s, recomputed):
        steps = {name: {"peak_rss_mb": {"flow": flow_mb, "worker": worker_mb, "scheduler": 100.0},
                        "core_ms_per_image": 10.0, "wall_seconds": status_s if name == "status" else 1.0}
                 for name in ts.STEPS}
        steps["train"]["breakdown"] = {"totals": {s: {"core_ms_per_image": stage_ms} for s in ts.SHARD_STAGES}}
        steps["ingest"]["breakdown"] = {"totals": {"ingest": {"core_ms_per_image": stage_ms}}}
        steps["rerun"]["store"] = {"files": 3 * n}
        return {"images": n, "steps": steps, "failed": [], "rerun_check": {"recomputed": recomputed}}

    small, large = size(10, 100.0, 500.0, 400.0, 0.5, False), size(100, 105.0, 700.0, 400.0, 0.8, False)
    rows = {r["name"]: r for r in ts.compare(small, large)}
    assert rows["core-ms/img features"]["ratio"] == pytest.approx(1.05) and rows["core-ms/img features"]["met"]
    assert rows["flow peak MB train"]["ratio"] == pytest.approx(1.4) and rows["flow peak MB train"]["met"] is False
    assert rows["worker peak MB (any)"]["met"] and rows["store files/img"]["ratio"] == pytest.approx(1.0)
    judged = ts.targets({"10": small, "100": large}, list(rows.values()))
    assert judged["status wall s"]["met"] and judged["nothing failed"]["met"]
    assert judged["nothing recomputed on the rerun"]["met"] and judged["flow peak MB export"]["met"] is False
    large["rerun_check"]["recomputed"] = True
    assert not ts.targets({"10": small, "100": large}, [])["nothing recomputed on the rerun"]["met"]


def test_snapshot_and_changes(tmp_path):
    (tmp_path / "rounds").mkdir()
    (tmp_path / "rounds" / "a").write_text("1")
    (tmp_path / "summary.json").write_text("{}")
    (tmp_path / ".prefect").mkdir()
    (tmp_path / ".prefect" / "prefect.db").write_text("x")
    before = ts.snapshot(tmp_path)
    assert set(before) == {"rounds/a"}  # tracking state and the summary are not results
    (tmp_path / "rounds" / "a").write_text("22")
    (tmp_path / "rounds" / "b").write_text("3")
    (tmp_path / "summary.json").write_text('{"x": 1}')
    ch = ts.changes(before, ts.snapshot(tmp_path))
    assert (ch["added"], ch["changed"], ch["removed"]) == (1, 1, 0) and ch["files"] == ["rounds/b", "rounds/a"]
    assert ts.walk(tmp_path) == {"files": 4, "bytes": 2 + 1 + 8 + 1}


def _bench(tmp_path, *argv, timeout=600):
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    env.pop("PREFECT_API_URL", None)
    return subprocess.run([sys.executable, "-m", "wsseg", "bench", "scale", *argv], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_bad_options_are_one_line_before_anything_starts(tmp_path):
    res = _bench(tmp_path, "--data", str(SAMPLE), "--replicate", "4", "--rounds", "1", "--run-dir", "x")
    assert res.returncode == 2 and res.stderr.strip().splitlines()[-1].startswith("wsseg: error: --rounds 1:")
    res = _bench(tmp_path, "--data", str(SAMPLE), "--replicate", "4,x", "--run-dir", "x")
    assert res.returncode == 2 and "--replicate expects positive whole numbers" in res.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.command("bench scale")
def test_bench_scale_end_to_end(tmp_path):
    (tmp_path / "tiny.json").write_text(json.dumps(TINY))
    root, out = tmp_path / "root", tmp_path / "scale.json"
    res = _bench(tmp_path, "--data", str(SAMPLE), "--replicate", "8,16", "--workers", "1", "--rounds", "2",
                 "--config", "tiny.json", "--run-dir", str(root), "--out", str(out), "--keep", timeout=2400)
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["provenance"]["command"].startswith("wsseg bench scale --data ")  # as the user typed it
    assert r["sizes"] == [8, 16] and r["compared"] == [8, 16]
    for n in ("8", "16"):
        s = r["per_size"][n]
        assert list(s["steps"]) == list(ts.STEPS) and s["failed"] == []
        for name, st in s["steps"].items():
            assert st["rc"] == 0 and st["wall_seconds"] > 0 and st["core_ms_per_image"] > 0, name
            p = st["peak_rss_mb"]
            assert p["flow"] > 0 and p["worker"] > 0 and p["scheduler"] > 0 and len(p["workers"]) == 1, name
            assert st["store"]["files"] > 0 and st["store"]["size_mb"] > 0, name
        runs = {name: st["task_runs"] for name, st in s["steps"].items()}
        assert runs["ingest"]["shard_tasks"] >= 1 and runs["train"]["shard_tasks"] > 0
        assert all(runs[name]["created"] == 0 for name in ("export", "review", "status"))
        # the train's stages, every round's images counted; the workers' CPU inside them
        rounds = len([x for x in json.loads((root / f"n{n}" / "run" / "summary.json").read_text())["rounds"]
                      if x["round"] != "cam"])
        totals = s["steps"]["train"]["breakdown"]["totals"]
        assert totals["features"]["images"] == int(n) and totals["preliminary"]["images"] == rounds * int(n)
        assert all(totals[stage]["core_ms_per_image"] > 0 for stage in ts.SHARD_STAGES if stage != "ingest")
        assert s["steps"]["ingest"]["breakdown"]["totals"]["ingest"]["core_ms_per_image"] > 0
        assert s["steps"]["train"]["breakdown"]["windows"]["classifier"]["wall_seconds"] > 0
        # the rerun recomputed nothing: no shard task run, no result file written, the same rounds
        check = s["rerun_check"]
        assert check["recomputed"] is False and check["shard_tasks"] == 0 and check["rounds_identical"]
        assert runs["rerun"]["shard_tasks"] == 0 and runs["rerun"]["failed"] == 0
        # status's count of the store is a walk's, and the walk is of what lies there now
        walked = ts.walk(root / f"n{n}" / "run")
        assert s["walk"]["files"] == s["walk"]["status_files"] == walked["files"]
        assert s["steps"]["status"]["printed"]["files"] == s["steps"]["status"]["store"]["files"]
        # no worker started a Prefect server of its own
        assert not list((root / f"n{n}" / "cluster" / "prefect").glob("**/*.db"))
    # every target judged, none left unmeasured, and each named in the printed table
    assert all(t["met"] is not None for t in r["targets"].values()), r["targets"]
    assert r["targets"]["nothing failed"]["met"] and r["targets"]["nothing recomputed on the rerun"]["met"]
    assert all(row["ratio"] is not None for row in r["ratios"] if row["target"])
    for name in r["targets"]:
        assert name in res.stdout, name
    assert "ratios N=16 / N=8" in res.stdout and str(out) in res.stdout

    # --keep left the copies, which the same size reuses without starting anything
    from wsseg.flows.bench_scale import replicate

    source = root / "n8" / "source"
    assert len(list((source / "images").glob("*.jpg"))) == 8
    again = replicate(str(SAMPLE), source, 8, "train", 1, root)
    assert again["reused"] is True
