"""`wsseg status`: where a run directory stands, from its files alone."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from wsseg.tasks.report.status import format_status, run_status
from wsseg.tasks.store import ClassSpec, ImageRecord, Store

ROOT = Path(__file__).resolve().parents[1]


def _store(tmp_path) -> Store:
    store = Store(tmp_path / "run")
    recs = [ImageRecord(f"im{i}", 4, 4, ("a",), f"{i:064x}", "train" if i < 3 else "val", "x.jpg", False)
            for i in range(4)]
    store.write_corpus(recs, ClassSpec(("a", "b")))
    store.write_config({"split": "train", "shard_size": 2})
    store.write_round(0, {"round": 0, "pseudo_label_miou": 0.5, "changed_share": 1.0, "ignore_share": 0.0})
    store.write_pseudo(1, "im0", np.zeros((4, 4), np.uint8))  # round 1 started: one shard of two done
    store.mark_shard_done(1, "prelim", "im0", {"images": 2})
    return store


def test_status_of_a_run_in_progress(tmp_path):
    store = _store(tmp_path)
    st = run_status(store)
    assert st["corpus"] == {"images": 4, "classes": 2, "splits": {"train": 3, "val": 1}, "implicit_background": None,
                            "corrected": 0}
    assert [r["round"] for r in st["rounds"]] == [0] and st["rounds"][0]["pseudo_label_miou"] == 0.5
    assert st["in_progress"] == {"round": 1, "shards": 2, "done": {"prelim": 1, "pseudo": 0},
                                 "pending": {"prelim": 1, "pseudo": 2}, "model_trained": False}
    assert st["size_mb"] >= 0 and st["writer"] is None and st["last_error"] is None
    store.write_last_error("wsseg train", "ValueError: something")
    with store.lock("wsseg train"):
        st = run_status(store)
        assert st["writer"]["pid"] == os.getpid() and st["writer"]["command"] == "wsseg train"
    assert st["last_error"]["error"] == "ValueError: something"
    text = format_status(st)
    assert "round 1 in progress: preliminary 1/2 shards" in text and "last error" in text
    # a finished run: each round's tag coverage as the share it stands for, and which round's labels
    # are final and why
    store.write_round(0, {"round": 0, "pseudo_label_miou": 0.5, "changed_share": 1.0, "ignore_share": 0.0,
                          "tag_coverage": math.log(0.25)})
    store.write_summary({"final_round": 0, "stop_reason": "tag coverage fell: ...; round 0 is final",
                         "final_model": "m.pt", "converged": False})
    text = format_status(run_status(store))
    assert "tag share 0.250" in text and "final labels: round 0 (tag coverage fell: ...; round 0 is final)" in text


@pytest.mark.command("status")
def test_status_command_json(tmp_path):
    store = _store(tmp_path)
    out = subprocess.run([sys.executable, "-m", "wsseg", "status", str(store.root), "--json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    st = json.loads(out.stdout)
    assert st["in_progress"]["round"] == 1 and st["corpus"]["images"] == 4
    assert not (store.root / ".prefect").exists()  # status starts nothing


#: what `wsseg status` must not load: torch alone took 1.3 of its 1.8 s (issue 54: status under 1 s)
HEAVY = ("torch", "cv2", "prefect", "mlflow", "dask", "distributed", "zarr", "scipy")


def test_status_of_a_finished_run_loads_no_heavy_library(tiny_run):
    """`wsseg status` of a finished run (its rounds, checkpoints, summary read) imports none of
    :data:`HEAVY`: the command's time is then Python's start and its file reads."""
    code = ("import json, sys\nfrom wsseg.flows.cli import main\ntry:\n    rc = main(['status', sys.argv[1], '--json'])\n"
            "except SystemExit as e:\n    rc = e.code\n"
            f"print(json.dumps({{'rc': rc, 'loaded': [m for m in {HEAVY!r} if m in sys.modules]}}))")
    out = subprocess.run([sys.executable, "-c", code, str(tiny_run)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    *status, last = out.stdout.strip().splitlines()
    assert json.loads("\n".join(status))["rounds"]  # it read the finished rounds
    assert json.loads(last) == {"rc": 0, "loaded": []}
