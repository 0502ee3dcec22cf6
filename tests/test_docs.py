"""The documentation a newcomer reads: every relative Markdown link in README.md and docs/*.md
reaches a file, and a heading when it names one (#fragment, GitHub's slugs); the README stays
short (the rest lives under docs/)."""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 200

#: [text](target) and ![alt](target); the target ends at the first space (an optional "title")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _prose_lines(text: str):
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield n, line


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: markup and punctuation dropped (except '-' and '_'),
    lowercase, each space a '-'.

    >>> slug("Method C: msrc21 upscaled and HRF"), slug("Dashboards (`wsseg ui`)")
    ('method-c-msrc21-upscaled-and-hrf', 'dashboards-wsseg-ui')
    """
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # \w keeps letters, digits and '_'
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's slug in ``path``, with GitHub's -1, -2 ... for repeated headings."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if not m:
            continue
        s = slug(m.group(2))
        if s in seen:
            seen[s] += 1
            out.add(f"{s}-{seen[s]}")
        else:
            seen[s] = 0
            out.add(s)
    return out


def links(path: Path):
    """(line number, target) of every link in ``path``'s prose (inline code and fences left out)."""
    for n, line in _prose_lines(path.read_text(encoding="utf-8")):
        for m in LINK.finditer(re.sub(r"`[^`]*`", "", line)):
            yield n, m.group(1)


def _shown(path: Path) -> str:
    return os.path.relpath(path, ROOT)


def broken_links(files: list[Path]) -> list[str]:
    problems = []
    for path in files:
        for n, target in links(path):
            if re.match(r"(https?:|mailto:)", target, re.I):
                continue
            file_part, _, fragment = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            where = f"{_shown(path)}:{n}: ({target})"
            if not dest.exists():
                problems.append(f"{where} no such file {_shown(dest)}")
            elif fragment and dest.is_file() and dest.suffix == ".md" and fragment.lower() not in anchors(dest):
                problems.append(f"{where} no heading with the slug #{fragment} in {_shown(dest)}")
    return problems


def test_every_relative_link_reaches_its_file_and_heading():
    problems = broken_links(markdown_files())
    print("\n".join(problems))
    assert problems == [], f"{len(problems)} broken link(s):\n" + "\n".join(problems)


#: a pointer into the docs from code, e.g. a config description's "see docs/benchmarks.md#defaults-and-why"
CODE_POINTER = re.compile(r"\bdocs/([\w.-]+\.md)(?:#([\w-]+))?")


def test_pointers_from_the_code_into_docs_resolve():
    """tasks/config.py's option descriptions (and any module) point at docs/PAGE.md#heading."""
    problems = []
    for path in sorted(p for pkg in ("flows", "tasks", "models") for p in (ROOT / pkg).rglob("*.py")):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for page, fragment in CODE_POINTER.findall(line):
                dest = ROOT / "docs" / page
                if not dest.is_file():
                    problems.append(f"{_shown(path)}:{n}: no such file docs/{page}")
                elif fragment and fragment not in anchors(dest):
                    problems.append(f"{_shown(path)}:{n}: no heading #{fragment} in docs/{page}")
    print("\n".join(problems))
    assert problems == [], f"{len(problems)} broken pointer(s):\n" + "\n".join(problems)


def test_readme_is_short():
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; keep it to {README_MAX_LINES} (move the rest to docs/)"


def test_the_docs_index_exists_and_the_readme_links_into_docs():
    assert (ROOT / "docs" / "README.md").is_file()
    targets = {t.partition("#")[0] for _, t in links(ROOT / "README.md")}
    assert "docs/README.md" in targets and "docs/benchmarks.md" in targets


#: what `make figures` runs, from the repository root
FIGURES_COMMAND = "wsseg bench report docs/results --out docs/figures.md"


def test_the_figures_page_is_the_report_of_the_kept_results(monkeypatch):
    """docs/figures.md is what `make figures` writes from the result JSONs in docs/results: a figure
    edited by hand, or a result added or replaced without writing the page again, fails here."""
    from wsseg.tasks.bench.report import collect, render

    monkeypatch.chdir(ROOT)
    assert f"$(BIN)/{FIGURES_COMMAND}" in (ROOT / "Makefile").read_text(encoding="utf-8")
    results, skipped = collect(["docs/results"])
    assert not skipped, f"docs/results holds JSON files that are no benchmark result: {skipped}"
    page = (ROOT / "docs" / "figures.md").read_text(encoding="utf-8")
    assert render(results, FIGURES_COMMAND) == page, "docs/figures.md is not the report of docs/results: run `make figures`"


@pytest.mark.parametrize("heading, expected", [
    ("Defaults and why", "defaults-and-why"),
    ("Very large images: memory", "very-large-images-memory"),
    ("Dashboards (`wsseg ui`)", "dashboards-wsseg-ui"),
    ("Refresh-round parts", "refresh-round-parts"),
    ("The store's layout at scale", "the-stores-layout-at-scale"),
    ("msrc21 bench_quality", "msrc21-bench_quality"),
])
def test_slugs_follow_github(heading, expected):
    assert slug(heading) == expected


def test_the_checker_finds_broken_links(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "a.md").write_text("# Top\n\n## Same\n\n## Same\n\n[ok](b.md#there) [ok](#same-1) [x](#same-2)\n"
                                   "[gone](missing.md) [bad](b.md#nowhere) [web](https://example.com/x#y)\n"
                                   "`[code](not-a-link.md)`\n```\n[fenced](nope.md)\n```\n", encoding="utf-8")
    (tmp_path / "b.md").write_text("# There\n", encoding="utf-8")
    problems = broken_links([tmp_path / "a.md"])
    assert len(problems) == 3, problems
    assert any("#same-2" in p for p in problems) and any("missing.md" in p for p in problems)
    assert any("#nowhere" in p for p in problems)
