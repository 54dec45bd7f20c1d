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
# A ceiling against runaway files, not the rule that cuts them: a module's size follows its
# job (the stage folders below decide where code goes).
MAX_LINES = 700
# Over the limit on purpose; each says why in its own docstring.
LONG_ON_PURPOSE = {"edge_agent/sim/nvml.py"}

# The gateway's stages, lowest first: a module may import its own stage and lower ones,
# never a higher one. Keys are what follows ``cloud_gateway.``: a sub-package (a stage) or
# a top-level module. The frame's way is ssh -> ingest -> registry -> exposition -> http;
# imports run the other way where a stage calls the one below it (ingest is handed its
# sessions by ssh but imports ssh's login types, so it sits above ssh).
GATEWAY_STAGES: tuple[tuple[str, ...], ...] = (
    ("__init__", "data", "errors", "names", "metrics", "self_metrics", "listener", "fd_budget"),
    ("trust",),  # certificates, policy, revocation, signing
    ("registry",),  # the pure store of nodes and series
    ("exposition",),  # /metrics from the registry
    ("remote_write",),  # the remote-write client and per-node queues
    ("relay",),  # scrapes relayed through a node's tunnel, and the peer hop
    ("cluster",),  # the node directory, membership and claims
    ("ssh",),  # the SSH port: logins, enrollment, the balancer's PROXY header
    ("ingest",),  # a session's frames: delivery verdicts, ACKs
    ("http",),  # the HTTP port: API, page, auth
    ("commands",),  # the operator's commands
    ("config",),  # assembles each stage's own section
    ("app",),  # wires the stages, lists their families once
    ("cli", "__main__"),
)
RANK = {name: rank for rank, names in enumerate(GATEWAY_STAGES) for name in names}


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


def stage_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "cloud_gateway":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def upward_imports(path: Path, importer: str) -> list[str]:
    """``importer``'s imports of a higher gateway stage (``from cloud_gateway import x``
    counts as importing ``cloud_gateway.x``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    mine = RANK[stage_of(importer) or ""]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "cloud_gateway":
                targets = [f"cloud_gateway.{alias.name}" for alias in node.names]
            else:
                targets = [node.module]
        else:
            continue
        for target in targets:
            stage = stage_of(target)
            if stage is None or stage == "__version__":
                continue
            if stage not in RANK:
                found.append((node.lineno, f"{target} is in no stage of GATEWAY_STAGES"))
            elif RANK[stage] > mine:
                above = f"{stage} is above {stage_of(importer)}"
                found.append((node.lineno, f"imports {target} ({above})"))
    return [f"{line}: {problem}" for line, problem in sorted(found)]


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def test_every_gateway_module_is_in_a_stage() -> None:
    unplaced = [
        module_name(path)
        for path in sources("cloud_gateway")
        if stage_of(module_name(path)) not in RANK
    ]
    assert not unplaced, f"add these to GATEWAY_STAGES: {unplaced}"


def test_lower_gateway_stages_import_no_higher_ones() -> None:
    offences = [
        f"{path.relative_to(ROOT)}:{problem}"
        for path in sources("cloud_gateway")
        for problem in upward_imports(path, module_name(path))
    ]
    assert not offences, "\n".join(offences)


def test_the_checker_sees_an_upward_import(tmp_path: Path) -> None:
    registry = tmp_path / "store.py"
    registry.write_text(
        "from cloud_gateway.trust.certs import load\n"
        "def f():\n    from cloud_gateway.http.api import make_app\n"
        "from cloud_gateway import app\n"
    )
    assert upward_imports(registry, "cloud_gateway.registry.store") == [
        "3: imports cloud_gateway.http.api (http is above registry)",
        "4: imports cloud_gateway.app (app is above registry)",
    ]


def test_config_assembles_sections_and_imports_no_stage() -> None:
    """``config`` reads the file; each stage owns its section type in its own ``config``
    module, which imports nothing of the gateway but shared modules and other sections."""
    allowed = {"errors", "names"}
    offences = []
    for path in [ROOT / "cloud_gateway" / "config.py", *ROOT.glob("cloud_gateway/*/config.py")]:
        for line, module in imported_modules(path):
            parts = module.split(".")
            if parts[0] != "cloud_gateway" or len(parts) < 2:
                continue
            if parts[1] in allowed or (len(parts) == 3 and parts[2] == "config"):
                continue
            offences.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not offences, "\n".join(offences)
