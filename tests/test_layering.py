"""The layering the design promises: two binaries on one shared core, never on each other.

Reads every module's imports with :mod:`ast` (nothing is imported or run), so a lazy
import inside a function counts as much as one at the top of a file."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# package -> the first-party packages it must never import
# (and no product package imports what only tests, benches and fuzzers ship with)
NOT_SHIPPED = ("harness", "tests", "bench", "fuzz")
FORBIDDEN = {
    "gpurelay": ("edge_agent", "cloud_gateway", *NOT_SHIPPED),
    "edge_agent": ("cloud_gateway", *NOT_SHIPPED),
    "cloud_gateway": ("edge_agent", *NOT_SHIPPED),
}
MAX_LINES = 500
# Over the limit on purpose; each says why in its own docstring.
LONG_ON_PURPOSE = {"edge_agent/sim/nvml.py"}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_does_not_import_its_peers(package: str) -> None:
    offences = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in sources(package)
        for line, module in imported_modules(path)
        if module.split(".")[0] in FORBIDDEN[package]
    ]
    assert not offences, "\n".join(offences)


def test_the_checker_sees_a_forbidden_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from edge_agent.config import load\n")
    assert imported_modules(bad) == [(2, "edge_agent.config")]


def test_benches_do_not_import_tests() -> None:
    """What benches and tests share lives in harness/, which must not import tests/ either."""
    offences = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for folder in ("bench", "harness")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for line, module in imported_modules(path)
        if module.split(".")[0] == "tests"
    ]
    assert not offences, "\n".join(offences)


def test_source_modules_stay_small() -> None:
    long = []
    for package in FORBIDDEN:
        for path in sources(package):
            rel = path.relative_to(ROOT).as_posix()
            lines = len(path.read_text(encoding="utf-8").splitlines())
            if lines > MAX_LINES and rel not in LONG_ON_PURPOSE:
                long.append(f"{rel}: {lines} lines")
    assert not long, "\n".join(long)
