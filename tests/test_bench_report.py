"""The provenance every benchmark JSON carries (tasks.bench.provenance)."""
import json
import os
import shutil
import subprocess
from datetime import datetime
from pathlib import Path

import pytest

from wsseg.tasks.bench.provenance import finished, provenance, source_commit, stamp

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------- provenance
def test_provenance_gives_the_command_date_machine_load_and_the_checkout():
    p = provenance(["bench", "quality", "--data", "../shared/data/msrc 21", "--split", "train"])
    assert p["command"] == "wsseg bench quality --data '../shared/data/msrc 21' --split train"
    assert p["argv"][3] == "../shared/data/msrc 21"
    assert datetime.fromisoformat(p["date"].replace("Z", "+00:00")).tzinfo is not None
    m = p["machine"]
    assert m["cores"] == os.cpu_count() and f"{os.cpu_count()} cores" in m["words"] and m["cpu"] in m["words"]
    assert m["memory_gb"] > 0 and (m["gpu"] is None) == ("no GPU" in m["words"])
    assert p["load_average"]["start"] == pytest.approx(os.getloadavg()[0], abs=5) and p["load_average"]["end"] is None
    assert p["wsseg"]
    done = finished(p)
    assert done["load_average"]["end"] is not None and done["finished"] >= p["date"]
    # the checkout wsseg runs from: its commit, as git gives it
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    assert p["source"]["commit"] == head.stdout.strip() and isinstance(p["source"]["local_changes"], bool)


def test_no_checkout_no_commit_and_no_command_when_none_was_typed(tmp_path):
    assert source_commit(tmp_path) is None  # an installed wsseg: nothing to name, no failure
    (tmp_path / ".git").mkdir()
    (tmp_path / "pyproject.toml").write_text("")
    assert source_commit(tmp_path) is None  # git finds no repository there
    assert provenance(None)["command"] is None


def test_stamp_adds_provenance_and_keeps_every_other_key(tmp_path):
    out = tmp_path / "r.json"
    res = {"b": 1, "a": {"x": [1.5, None]}, "wall_seconds": 3.0}
    out.write_text(json.dumps(res, indent=1))
    p = stamp(out, provenance(["bench", "train", "--network", "lite"]), indent=1)
    saved = json.loads(out.read_text())
    assert {k: v for k, v in saved.items() if k != "provenance"} == res and saved["provenance"] == p
    assert list(saved) == ["b", "a", "wall_seconds", "provenance"] and out.read_text().startswith('{\n "b"')

