"""What a command prints is wsseg's own: its progress and results. The libraries' log lines (MLflow's
"Creating initial MLflow database tables...", alembic's, Prefect's, Dask's) reach the terminal only with
--verbose (flows.runtime.prepare), in the command's process and in the processes it starts."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IMAGE = ROOT / "flows" / "sample" / "msrc21" / "images" / "10_12_s.jpg"
#: a line of a library's logger: Prefect's console format (``12:00:00.123 | INFO    | prefect - ...``),
#: MLflow's (``2026/12/06 12:00:00 INFO mlflow.store.db.utils: ...``), alembic's and Dask's
#: (``INFO  [alembic.runtime.migration] ...``, ``distributed.worker - WARNING - ...``)
LIBRARY_LINE = re.compile(r"\b(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b|\b(mlflow|alembic|prefect|distributed)[.:\s-]")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """An untrained three-class `small` network: `wsseg segment` labels an image with it in seconds."""
    import torch

    from wsseg import models
    from wsseg.tasks.store.checkpoints import save_model

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("model") / "small.pt"
    save_model(path, models.build_model("small", 3, in_channels=3), builder="small", num_classes=3, in_channels=3)
    return path


def _segment(checkpoint: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    # its own Prefect API and a new mlflow.db in --out (what makes MLflow and alembic speak), not the tests'
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "DASK_"))}
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    res = subprocess.run([sys.executable, "-m", "wsseg", "segment", str(IMAGE), "--model", str(checkpoint), "--out",
                          str(out), "--threads", "1", *extra], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    return res


@pytest.mark.command("segment")
def test_a_command_prints_only_its_own_lines_unless_verbose(checkpoint, tmp_path):
    res = _segment(checkpoint, tmp_path / "quiet")
    assert (tmp_path / "quiet" / "mlflow.db").is_file()  # MLflow did make its tables: it said nothing of it
    assert res.stderr.splitlines() == ["wsseg segment: checking the input ..."], res.stderr
    out = res.stdout.splitlines()
    assert len(out) == 2, res.stdout
    assert out[0].startswith(f"[1/1] {IMAGE.name}: 320x213, ") and ", largest classes " in out[0]
    assert re.fullmatch(rf"1 label map in [0-9.]+ s: {re.escape(str((tmp_path / 'quiet').resolve()))}", out[1])
    assert not [line for line in out if LIBRARY_LINE.search(line)]

    loud = _segment(checkpoint, tmp_path / "verbose", "--verbose")
    said = loud.stdout + loud.stderr
    assert "INFO mlflow.store.db.utils: Creating initial MLflow database tables..." in said, said
    assert re.search(r"\| INFO +\| Flow run 'segment' - ", said), said  # Prefect's own console lines
    assert loud.stdout.splitlines()[0].startswith(f"[1/1] {IMAGE.name}: ")  # and ours, as without --verbose


def test_the_rounds_table_says_what_each_figure_is():
    """`train` and `demo`'s table: the stopping rule's tag coverage shown as the share it stands for
    (exp of the mean log share), and a legend under the table naming every column."""
    import io
    import math

    from wsseg.flows.cli_common import print_rounds

    rows = [{"round": "cam", "pseudo_label_miou": 0.5, "pseudo_label_class_accuracy": 0.6,
             "pseudo_label_chance_miou": 0.02, "changed_share": None, "ignore_share": 0.0, "tag_coverage": None,
             "wall_seconds": 10.0},
            {"round": 0, "pseudo_label_miou": 0.6, "pseudo_label_class_accuracy": 0.7,
             "pseudo_label_chance_miou": 0.03, "changed_share": 0.25, "ignore_share": 0.125,
             "tag_coverage": math.log(0.25), "wall_seconds": 20.0}]
    out = io.StringIO()
    print_rounds(rows, out)
    lines = out.getvalue().splitlines()
    assert lines[0].split() == ["round", "mIoU", "cls", "acc", "chance", "changed", "ignore", "tag", "share",
                                "wall", "s"]
    assert lines[1].split() == ["cam", "0.500", "0.600", "0.020", "-", "0.000", "-", "10.0"]
    assert lines[2].split() == ["0", "0.600", "0.700", "0.030", "0.250", "0.125", "0.250", "20.0"]
    legend = " ".join(lines[3:])
    for column in ("cam:", "mIoU", "cls acc", "chance:", "changed:", "ignore:", "tag share:", "tag_coverage"):
        assert column in legend, column
    assert all(len(line) <= 120 for line in lines)
