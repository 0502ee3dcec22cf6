"""Every command in `wsseg --help` and every `bench` subcommand has an end-to-end test in
`make test`: one marked ``@pytest.mark.command("name", ...)`` that runs it on the bundled sample or
a smaller corpus and asserts what it wrote and printed."""
import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def cli_commands() -> set[str]:
    """The commands the parser offers: ``ingest``, ``train``, ..., ``bench quality``, ..."""
    import argparse

    from wsseg.flows import cli

    def choices(p: argparse.ArgumentParser) -> dict:
        return next(a.choices for a in p._actions if isinstance(a, argparse._SubParsersAction))

    out = set()
    for name, sub in choices(cli.parser()).items():
        if name == "bench":
            out |= {f"bench {b}" for b in choices(sub)}
        else:
            out.add(name)
    return out


def marked_commands() -> dict[str, list[str]]:
    """Command -> the tests marked as its end-to-end test (found in the test files' source)."""
    found: dict[str, list[str]] = {}
    for path in sorted(TESTS.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef):
                continue
            for dec in node.decorator_list:
                if isinstance(dec, ast.Call) and ast.unparse(dec.func) == "pytest.mark.command":
                    for arg in dec.args:
                        found.setdefault(arg.value, []).append(f"{path.name}::{node.name}")
    return found


def test_the_parser_lists_the_documented_commands():
    assert {"demo", "ingest", "train", "refresh", "evaluate", "segment", "ui", "status", "bench quality",
            "bench train", "bench highres", "bench pipeline"} <= cli_commands()


def test_every_command_has_an_end_to_end_test():
    marked = marked_commands()
    missing = sorted(cli_commands() - set(marked))
    stale = sorted(set(marked) - cli_commands())
    assert not missing, f"commands without an end-to-end test (@pytest.mark.command): {missing}"
    assert not stale, f"tests marked for commands the CLI does not have: {stale}"
