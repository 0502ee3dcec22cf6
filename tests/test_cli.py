"""CLI conventions: help on every option, --version, one meaning per flag, one default run dir."""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from wsseg.flows import cli, cli_common

ROOT = Path(__file__).resolve().parents[1]


def _parsers(p: argparse.ArgumentParser, path=("wsseg",)):
    yield path, p
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                yield from _parsers(sub, path + (name,))


def test_every_option_and_argument_has_help():
    missing = [f"{' '.join(path)} {a.option_strings or a.dest}"
               for path, p in _parsers(cli.parser()) for a in p._actions
               if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and not a.help]
    assert not missing, missing


def test_one_default_run_directory():
    defaults = {(" ".join(path)): a.default for path, p in _parsers(cli.parser()) for a in p._actions
                if "--run-dir" in a.option_strings}
    user_facing = {k: v for k, v in defaults.items() if not k.startswith("wsseg bench")}
    assert set(user_facing.values()) == {cli_common.DEFAULT_RUN_DIR}, defaults


def test_network_flag_and_model_alias_of_train():
    ns = cli.parser().parse_args(["train", "--network", "fusion"])
    assert ns.network == "fusion" and cli_common.build_config(ns).segmentation.model == "fusion"
    assert cli.parser().parse_args(["train", "--model", "small"]).network == "small"
    assert cli.parser().parse_args(["segment", "a.jpg", "--model", "m.pt", "--out", "o"]).model == "m.pt"


def test_version_and_plain_top_level_help():
    out = subprocess.run([sys.executable, "-m", "wsseg", "--version"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("wsseg ")
    text = cli.parser().format_help()
    assert "``" not in text and "wsseg segment" in text


def test_options_of_another_network_are_one_line_before_anything_runs(tmp_path):
    """``segmentation.options`` are checked against the builder when the config loads: a leftover
    ``{"width": 16}`` (small's option) under the default lite network is refused at once."""
    import pytest

    ns = cli.parser().parse_args(["train", "--run-dir", str(tmp_path / "run"), "--set", 'segmentation.options={"width": 16}'])
    with pytest.raises(ValueError) as e:
        cli_common.build_config(ns)
    msg = str(e.value)
    assert "\n" not in msg and "model 'lite' takes no option 'width'" in msg and "variant" in msg
    ns = cli.parser().parse_args(["train", "--network", "small", "--set", 'segmentation.options={"width": 16}'])
    assert cli_common.build_config(ns).segmentation.options == {"width": 16}
    out = subprocess.run([sys.executable, "-m", "wsseg", "train", "--run-dir", str(tmp_path / "run"),
                          "--set", 'segmentation.options={"width": 16}'], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode != 0 and "takes no option 'width'" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "run").exists()
