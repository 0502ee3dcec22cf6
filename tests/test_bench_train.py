"""`wsseg bench train` end to end on the bundled sample: the fusion network (method B) trains
through the real store path and the JSON holds finite figures (it once stopped with an
AttributeError before any step)."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
@pytest.mark.command("bench train")
def test_bench_train_fusion_runs_end_to_end(tmp_path):
    out = tmp_path / "bench.json"
    res = subprocess.run([str(Path(sys.executable).parent / "wsseg"), "bench", "train", "--network", "fusion",
                          "--options", '{"width": 0.25}', "--size", "96", "--batch", "2", "--steps", "4",
                          "--warmup", "1", "--out", str(out), "--run-dir", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    d = json.loads(out.read_text())
    assert d["model"] == "fusion" and d["steps"] == 4 and d["images"] > 0 and d["parameters"] > 0
    for k in ("images_per_second", "compute_images_per_second", "data_wait_share", "median_step_seconds"):
        assert math.isfinite(d[k]) and d[k] >= 0, k
    assert d["images_per_second"] > 0
