"""The layout a newcomer reads: tasks/ grouped into packages by what they are for, imports going
one way (flows -> tasks -> models) with no circle between files or between tasks/'s packages
(tools/import_graph.py, which CI runs here)."""
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import load_tool

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    return load_tool("import_graph")


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


def test_the_package_graph_groups_modules_by_package_and_finds_a_circle_between_packages():
    g = _tool()
    graph = {"tasks.a.x": {"tasks.b.y"}, "tasks.b.y": {"tasks.c"}, "tasks.c": {"tasks.a.z"}, "tasks.a.z": set(),
             "flows.cli": {"tasks.a.x"}}
    packages = g.package_graph(graph)
    assert packages == {"tasks.a": {"tasks.b"}, "tasks.b": {"tasks.c"}, "tasks.c": {"tasks.a"},
                        "flows": {"tasks.a"}}
    assert g.cycles(packages) == [["tasks.a", "tasks.b", "tasks.c"]]


def test_wsseg_has_no_import_circle_and_no_import_against_the_layers():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "import_graph.py")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 circle(s), 0 circle(s) between packages, 0 import(s) against the layers" in out.stdout


def test_tasks_is_grouped_into_packages():
    """Only the configuration (read by every package) stays at the top of tasks/; each package
    says in its docstring what it is for."""
    flat = sorted(p.name for p in (ROOT / "tasks").glob("*.py") if p.name not in ("__init__.py", "config.py"))
    assert flat == [], f"modules outside a package: {flat}"
    for init in sorted((ROOT / "tasks").glob("*/__init__.py")):
        assert init.read_text().lstrip().startswith('"""'), f"{init} says nothing of its package"


def test_the_command_line_module_stays_readable():
    """flows/cli.py holds the parser and the dispatch; the commands live in flows/commands.py and
    flows/cli_bench.py, what they share in flows/cli_common.py."""
    lines = len((ROOT / "flows" / "cli.py").read_text().splitlines())
    assert lines < 600, f"flows/cli.py has {lines} lines"


def test_a_module_that_finds_the_project_from_its_own_file_finds_it():
    """``Path(__file__).resolve().parents[N]`` in tasks/, flows/, models/ and tools/ lands on the
    project's folder: two were one level short after tasks/ became packages (`bench highres`'s memory
    probe ran its child in tasks/, so a relative ``--out`` was not found; `bench train`'s default sample
    pointed at tasks/flows/sample)."""
    found = []
    for path in sorted(p for part in ("tasks", "flows", "models", "tools") for p in (ROOT / part).rglob("*.py")):
        for m in re.finditer(r"Path\(__file__\)\.resolve\(\)\.parents\[(\d+)\]", path.read_text()):
            found.append(path.relative_to(ROOT))
            assert path.parents[int(m.group(1))] == ROOT, f"{found[-1]}: parents[{m.group(1)}] is not the project"
    assert Path("tasks/highres/train.py") in found and Path("tasks/bench/train.py") in found
