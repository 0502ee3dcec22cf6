"""The import graph of wsseg's own modules (flows, tasks, models), every import counted: those at
the top of a file and those inside functions. Prints each circle (a strongly connected set of
files that import one another), each circle between the packages of tasks/ (tasks.wsss,
tasks.corpus, ...: a package's files may import another package only if that one never imports
it back, directly or not) and each import against the layers (flows -> tasks -> models: models
import neither tasks nor flows, tasks do not import flows), and exits 1 when there is one;
`--tree` also prints each file with its line count, `--packages` what each package imports.

    python tools/import_graph.py [--tree] [--packages]
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("flows", "tasks", "models")
#: the packages below each one: what it may import besides itself
LAYERS = {"flows": {"tasks", "models"}, "tasks": {"models"}, "models": set()}


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The wsseg modules ``name`` imports (``from a import b`` counts as ``a.b`` when that is a module)."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_pkg else 0)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            t = t.removeprefix("wsseg.")  # installed, the packages live under wsseg (pyproject.toml)
            while t and t not in known:  # a name inside a module: the module
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def package_of(module: str) -> str:
    """The unit of the package graph: ``tasks.<package>`` for a module of a package of tasks/,
    the module itself for tasks/'s top-level modules (``tasks.config``), else the top package."""
    parts = module.split(".")
    if parts[0] == "tasks":
        return ".".join(parts[:2])
    return parts[0]


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for a, targets in graph.items():
        pa = package_of(a)
        out.setdefault(pa, set())
        for b in targets:
            if package_of(b) != pa:
                out[pa].add(package_of(b))
                out.setdefault(package_of(b), set())
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def main(argv: list[str]) -> int:
    mods = modules()
    known = set(mods)
    # a package's __init__ re-exporting its modules is not a circle with them
    graph = {m: {t for t in imports_of(m, p, known) if not (p.name == "__init__.py" and t.startswith(m + "."))}
             for m, p in mods.items()}
    if "--tree" in argv:
        for m, p in mods.items():
            print(f"{len(p.read_text().splitlines()):6d}  {p.relative_to(ROOT)}")
    found = cycles(graph)
    for comp in found:
        edges = [f"{a} -> {b}" for a in comp for b in sorted(graph[a]) if b in comp]
        print(f"circle of {len(comp)} modules: " + "; ".join(edges))
    packages = package_graph(graph)
    if "--packages" in argv:
        for pkg in sorted(packages):
            print(f"{pkg} -> {', '.join(sorted(packages[pkg])) or '-'}")
    package_circles = cycles(packages)
    for comp in package_circles:
        edges = []
        for a in comp:
            for b in sorted(packages[a]):
                if b in comp:
                    by = sorted(m for m in graph if package_of(m) == a and any(package_of(t) == b for t in graph[m]))
                    edges.append(f"{a} -> {b} ({', '.join(by)})")
        print(f"circle of {len(comp)} packages: " + "; ".join(edges))
    upward = [f"{a} -> {b}" for a in sorted(graph) for b in sorted(graph[a])
              if b.split(".")[0] != a.split(".")[0] and b.split(".")[0] not in LAYERS[a.split(".")[0]]]
    for edge in upward:
        print(f"against the layers: {edge}")
    print(f"{len(mods)} modules, {sum(map(len, graph.values()))} imports between them, {len(found)} circle(s), "
          f"{len(package_circles)} circle(s) between packages, {len(upward)} import(s) against the layers")
    return 1 if found or package_circles or upward else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
