"""Resuming resumes, on a small real run (four sample photos, networks trained from scratch, one round).

* A plain `wsseg train` after `train --config ... --set ...` resumes with the configuration the run
  recorded (config.json), not wsseg's defaults: nothing is computed again.
* Options that would compute finished results again are refused with one line naming them and the
  options, before anything starts, and change nothing; with --recompute they are taken.
* Where the work runs is not part of the configuration: `--device cuda` on a machine without CUDA
  is one line before Prefect starts (exit 2) and leaves the run's records as they were.
* A run directory moved elsewhere names its own files, resumes without computing anything again,
  and no record in it names where it was.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import KILL_IDS, TINY, copy_sample

ROOT = Path(__file__).resolve().parents[1]
IDS = KILL_IDS[:4]
#: conftest's TINY with networks trained from scratch (no ImageNet encoder to run): seconds a training
SMALL = TINY | {"classifier": TINY["classifier"] | {"encoder": "small"}, "features": {"deep_features": "none"},
                "segmentation": TINY["segmentation"] | {"model": "small", "options": {"width": 8}}}


def _args(run: Path, *argv: str):
    from wsseg.flows import cli

    return cli.parser().parse_args(["train", "--run-dir", str(run), *argv])


def _config(run: Path, *argv: str):
    """The configuration `wsseg train --run-dir RUN ARGV` runs with, after the command's own checks
    (flows.cli.precheck: a refusal is its ValueError)."""
    from wsseg.flows import cli
    from wsseg.flows.cli_common import build_config

    args = _args(run, *argv)
    cli.precheck(args)
    return build_config(args)


def _train(run: Path, config, cluster) -> dict:
    from wsseg.flows.runtime import on_cluster
    from wsseg.flows.wsss import train_wsss

    return on_cluster(train_wsss, cluster)(str(run), config, cluster)


def _stamps(run: Path) -> dict[str, int]:
    """The modification time of every result: the classifier, the feature cache and every file of the
    rounds (shard markers, packs, checkpoints, records)."""
    files = [run / "classifier.pt", *(run / "cache").rglob("*"), *(run / "rounds").rglob("*")]
    return {str(p.relative_to(run)): p.stat().st_mtime_ns for p in files if p.is_file()}


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, prefect_harness, cluster) -> Path:
    """A finished run of `wsseg train --config SMALL --set classifier.epochs=3` (far from the
    defaults). Tests copy it before they change it."""
    from wsseg.flows.runtime import on_cluster
    from wsseg.flows.wsss import ingest

    base = tmp_path_factory.mktemp("resume")
    src = copy_sample(base / "src", IDS)
    run = base / "run"
    on_cluster(ingest, cluster)(str(src), str(run), shard_size=4)
    (base / "small.json").write_text(json.dumps(SMALL))
    config = _config(run, "--config", str(base / "small.json"), "--set", "classifier.epochs=3")
    assert config.classifier.epochs == 3 and config.segmentation.model == "small"
    _train(run, config, cluster)
    return run


def _copy(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest, symlinks=True)  # modification times kept
    return dest


def test_a_plain_train_resumes_with_the_runs_configuration(first_run, tmp_path, cluster):
    from wsseg.tasks.config import recorded_config
    from wsseg.tasks.store import Store

    run = _copy(first_run, tmp_path / "run")
    recorded = json.loads((run / "config.json").read_text())
    assert "device" not in recorded and recorded["classifier"]["epochs"] == 3
    before, rows = _stamps(run), Store(run).read_summary()["rounds"]
    config = _config(run)  # no option: the run's configuration, not the defaults
    assert recorded_config(config) == recorded
    again = _train(run, config, cluster)
    assert _stamps(run) == before  # not one shard, checkpoint or record computed again
    assert [r["pseudo_label_miou"] for r in again["rounds"]] == [r["pseudo_label_miou"] for r in rows]
    assert json.loads((run / "config.json").read_text()) == recorded
    # --set applies over the run's configuration, not over the defaults: only what it names differs
    assert _config(run, "--set", "max_rounds=1").classifier.epochs == 3


def test_options_that_discard_finished_results_are_refused_unless_recompute(first_run, tmp_path, cluster):
    run = _copy(first_run, tmp_path / "run")
    before, record = _stamps(run), (run / "config.json").read_bytes()

    def refused(*argv: str) -> str:
        with pytest.raises(ValueError) as e:
            _config(run, *argv)
        msg = str(e.value)
        assert "\n" not in msg and "nothing was changed: add --recompute" in msg, msg
        return msg

    assert "the image classifier and round(s) 0 (classifier.epochs 3 -> 4)" in refused("--set", "classifier.epochs=4")
    assert "round 0's model (segmentation.epochs 2 -> 3)" in refused("--set", "segmentation.epochs=3")
    assert "the image classifier and round(s) 0 (" in refused("--defaults")  # back to wsseg's defaults
    assert _stamps(run) == before and (run / "config.json").read_bytes() == record
    # where the work runs is not part of what a result depends on: no refusal
    assert _config(run, "--device", "cpu").device == "cpu"

    # with --recompute the option is taken: the round's model is trained again, its labels kept
    markers = {k: v for k, v in before.items() if "/done/" in k}
    config = _config(run, "--set", "segmentation.epochs=3", "--recompute")
    _train(run, config, cluster)
    after = _stamps(run)
    assert {k: v for k, v in after.items() if "/done/" in k} == markers and markers
    assert after["classifier.pt"] == before["classifier.pt"]
    assert after["rounds/r000/model.pt"] != before["rounds/r000/model.pt"]
    assert json.loads((run / "config.json").read_text())["segmentation"]["epochs"] == 3
    assert _config(run).segmentation.epochs == 3  # and is what a plain train resumes with


def test_a_device_that_is_not_there_is_one_line_and_changes_nothing(first_run, tmp_path):
    run = _copy(first_run, tmp_path / "run")
    before = {str(p.relative_to(run)): (p.stat().st_mtime_ns, p.stat().st_size) for p in run.rglob("*")}
    record = (run / "config.json").read_bytes()
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", CUDA_VISIBLE_DEVICES="")  # no CUDA, on a GPU machine too
    env.pop("PREFECT_API_URL", None)
    for argv, said in ((["--device", "cuda"], "device 'cuda': CUDA is not available on this machine; use --device "
                                              "cpu or auto"),
                       (["--set", "device=gpu"], "device 'gpu': not a device wsseg trains on (auto, cpu, cuda, "
                                                 "cuda:N, mps)")):
        out = subprocess.run([sys.executable, "-m", "wsseg", "train", "--run-dir", str(run), *argv], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=300)
        lines = out.stderr.splitlines()  # the command's first line (what it is about to do), then the error
        assert out.returncode == 2 and len(lines) == 2 and lines[1] == f"wsseg: error: {said}", out.stderr
    # nothing written: no Prefect home, no error record, config.json byte for byte
    assert (run / "config.json").read_bytes() == record
    assert {str(p.relative_to(run)): (p.stat().st_mtime_ns, p.stat().st_size) for p in run.rglob("*")} == before


def test_a_moved_run_directory_names_its_own_files_and_resumes(first_run, tmp_path, cluster):
    old = _copy(first_run, tmp_path / "here" / "run")
    new = tmp_path / "there" / "run"
    new.parent.mkdir()
    shutil.move(old, new)
    before = _stamps(new)
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    out = subprocess.run([sys.executable, "-m", "wsseg", "status", str(new), "--json"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    st = json.loads(out.stdout)
    assert st["run_dir"] == str(new) and st["final_model"] == str(new / "rounds" / "r000" / "model.pt")
    assert Path(st["final_model"]).is_file() and not st.get("stale")

    s = _train(new, _config(new), cluster)
    assert _stamps(new) == before  # nothing computed again
    assert s["final_model"] == str(new / "rounds" / "r000" / "model.pt")
    assert not old.exists()  # nothing written where it was (MLflow's artifacts neither)
    # no record names where the run directory was; MLflow's SQLite database is left out of the
    # search (its pages may keep the old strings it rewrote), and Prefect's (RUN/.prefect, the flow
    # runs' parameters) is not in the run directory here (the tests' Prefect lives elsewhere)
    named = [str(p.relative_to(new)) for p in new.rglob("*")
             if p.is_file() and not p.name.startswith("mlflow.db") and ".prefect" not in p.parts
             and str(old).encode() in p.read_bytes()]
    assert named == []
    assert json.loads((new / "summary.json").read_text())["final_model"] == "rounds/r000/model.pt"


def test_a_run_stopped_before_its_config_was_recorded_resumes_with_its_rounds_configuration(tiny_run, tmp_path):
    """config.json is written when a train finishes: a first train stopped before (a SIGKILL after
    round 0) has none, and a plain `train` then resumes with what the finished rounds recorded (the
    round budget from the budget's decision), refusing nothing, rather than with the defaults."""
    from wsseg.flows import cli
    from wsseg.flows.cli_common import build_config, refuse_discarding, run_configuration
    from wsseg.tasks.config import WSSSConfig

    run = shutil.copytree(tiny_run, tmp_path / "run", symlinks=True, ignore=shutil.ignore_patterns(
        ".prefect", "mlflow.db", "mlartifacts", "dask-scratch", ".wsseg.lock", "config.json", "summary.json"))
    conf = run_configuration(run)
    assert conf["classifier"]["epochs"] == TINY["classifier"]["epochs"] and conf["max_rounds"] == TINY["max_rounds"]
    ns = cli.parser().parse_args(["train", "--run-dir", str(run)])
    config = build_config(ns)
    assert config.classifier == WSSSConfig.model_validate(TINY).classifier
    refuse_discarding(ns, config)  # nothing would be computed again: no refusal
    ns = cli.parser().parse_args(["train", "--run-dir", str(run), "--defaults"])
    with pytest.raises(ValueError, match="would compute finished results again"):
        refuse_discarding(ns, build_config(ns))
