"""The layout a newcomer reads: imports go one way (flows -> tasks -> models) with no circle
between files (tools/import_graph.py, which CI runs here)."""
import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "tools" / "import_graph.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_circle_finder_finds_known_circles():
    g = _tool()
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": set()}
    assert sorted(g.cycles(graph)) == [["a", "b", "c"], ["d", "e"]]
    assert g.cycles({"a": {"b"}, "b": set()}) == []


def test_imports_of_counts_imports_inside_functions(tmp_path):
    g = _tool()
    src = tmp_path / "m.py"
    src.write_text("import tasks.x\n\ndef f():\n    from tasks.y import thing\n    from . import z\n")
    known = {"tasks.x", "tasks.y", "tasks.z", "tasks.m"}
    assert g.imports_of("tasks.m", src, known) == {"tasks.x", "tasks.y", "tasks.z"}


def test_wsseg_has_no_import_circle_and_no_import_against_the_layers():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "import_graph.py")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 circle(s), 0 import(s) against the layers" in out.stdout


def test_the_command_line_module_stays_readable():
    """flows/cli.py holds the parser and the dispatch; the commands live in flows/commands.py and
    flows/cli_bench.py, what they share in flows/cli_common.py."""
    lines = len((ROOT / "flows" / "cli.py").read_text().splitlines())
    assert lines < 600, f"flows/cli.py has {lines} lines"
