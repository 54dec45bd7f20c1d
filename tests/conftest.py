"""Shared fixtures: external tools that CI installs, and the GPU marker."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


def _nvml_reason() -> str | None:
    """None when a real GPU is usable through NVML, else why not."""
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return f"no usable NVIDIA GPU here (NVML: {exc})"
    try:
        if pynvml.nvmlDeviceGetCount() == 0:
            return "NVML works but reports no GPU"
    finally:
        pynvml.nvmlShutdown()
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [i for i in items if "gpu" in i.keywords]
    if not gpu_items:
        return
    reason = _nvml_reason()
    if reason is None:
        return
    for item in gpu_items:
        item.add_marker(pytest.mark.skip(reason=reason))


def required_tool(tool: str, variable: str, package: str) -> Path:
    """The tool's path; skips when it is missing, or fails when CI sets ``variable=1``."""
    path = shutil.which(tool)
    if path is None:
        msg = f"{tool} not found (Debian package `{package}`)"
        if os.environ.get(variable) == "1":
            pytest.fail(f"{msg}; {variable}=1 makes this a failure")
        pytest.skip(msg)
    return Path(path)


def assert_shellcheck_clean(script: Path) -> None:
    """``shellcheck --shell=bash`` finds nothing in ``script`` (skips without shellcheck,
    fails instead when CI sets EDGE_GPU_RELAY_REQUIRE_SHELLCHECK=1)."""
    shellcheck = required_tool("shellcheck", "EDGE_GPU_RELAY_REQUIRE_SHELLCHECK", "shellcheck")
    proc = subprocess.run(
        [str(shellcheck), "--shell=bash", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.fixture(scope="session")
def promtool() -> Path:
    return required_tool("promtool", "EDGE_GPU_RELAY_REQUIRE_PROMTOOL", "prometheus")


@pytest.fixture(scope="session")
def prometheus_bin() -> Path:
    return required_tool("prometheus", "EDGE_GPU_RELAY_REQUIRE_PROMETHEUS", "prometheus")


@pytest.fixture(scope="session")
def tinyproxy_bin() -> Path:
    """A real HTTP CONNECT forward proxy for the agent's [gateway] proxy tests."""
    return required_tool("tinyproxy", "EDGE_GPU_RELAY_REQUIRE_TINYPROXY", "tinyproxy")


@pytest.fixture(scope="session")
def buildah_bin() -> Path:
    """buildah, with debootstrap and root, which deploy/images/build.sh needs; skips without
    them, fails instead when CI sets EDGE_GPU_RELAY_REQUIRE_BUILDAH=1."""
    variable = "EDGE_GPU_RELAY_REQUIRE_BUILDAH"
    if os.geteuid() != 0:
        msg = "building images needs root (debootstrap, chroot)"
        if os.environ.get(variable) == "1":
            pytest.fail(f"{msg}; {variable}=1 makes this a failure")
        pytest.skip(msg)
    required_tool("debootstrap", variable, "debootstrap")
    return required_tool("buildah", variable, "buildah")


@contextlib.contextmanager
def small_tmpfs(mnt: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` at ``mnt`` (root only) for full-disk tests; skips without the
    privilege, fails instead when CI sets EDGE_GPU_RELAY_REQUIRE_MOUNT=1."""
    mnt.mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        reason = proc.stderr.strip() or f"exit {proc.returncode}"
        ok = proc.returncode == 0
    except (OSError, subprocess.TimeoutExpired) as exc:
        ok, reason = False, str(exc)
    if not ok:
        message = f"cannot mount a small tmpfs here ({reason}); needs root with CAP_SYS_ADMIN"
        if os.environ.get("EDGE_GPU_RELAY_REQUIRE_MOUNT") == "1":
            pytest.fail(message)
        pytest.skip(message)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=10, check=False)


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs."""
    with small_tmpfs(tmp_path / "tiny", "256k") as mnt:
        yield mnt


def _require_postgres() -> None:
    """Skips without Debian's `postgresql`, fails instead when CI sets
    EDGE_GPU_RELAY_REQUIRE_POSTGRES=1."""
    from harness.postgres import find_bindir

    if find_bindir() is None:
        msg = "PostgreSQL's initdb not found (Debian package `postgresql`)"
        if os.environ.get("EDGE_GPU_RELAY_REQUIRE_POSTGRES") == "1":
            pytest.fail(f"{msg}; EDGE_GPU_RELAY_REQUIRE_POSTGRES=1 makes this a failure")
        pytest.skip(msg)


@pytest.fixture(scope="session")
def postgres_bin() -> None:
    """PostgreSQL is installed (tests that start their own server, harness.cluster)."""
    _require_postgres()


@pytest.fixture(scope="session")
def postgres_dsn() -> Iterator[str]:
    """A throwaway PostgreSQL server (harness.postgres) for the session."""
    from harness.postgres import PostgresServer

    _require_postgres()
    with PostgresServer.find().running() as dsn:
        yield dsn


_databases = itertools.count()


@pytest.fixture
async def pg_database(postgres_dsn: str) -> str:
    """A fresh database on the session's PostgreSQL server: its DSN."""
    from harness.postgres import create_database

    return await create_database(postgres_dsn, f"test_{next(_databases)}")


def _required_binary(found: Path | None, what: str, variable: str) -> Path:
    if found is None:
        if os.environ.get(variable) == "1":
            pytest.fail(f"{what} not found; {variable}=1 makes this a failure")
        pytest.skip(f"{what} not found")
    return found


@pytest.fixture(scope="session")
def haproxy_bin() -> Path:
    from harness.haproxy import find_haproxy

    return _required_binary(
        find_haproxy(), "haproxy (Debian package `haproxy`)", "EDGE_GPU_RELAY_REQUIRE_HAPROXY"
    )


@pytest.fixture(scope="session")
def chromium_bin() -> Path:
    """Debian's Chromium, which the browser tests drive through Playwright (never a
    browser Playwright downloads)."""
    path = Path("/usr/bin/chromium")
    return _required_binary(
        path if path.exists() else None,
        "chromium (Debian package `chromium`)",
        "EDGE_GPU_RELAY_REQUIRE_CHROMIUM",
    )


@pytest.fixture(scope="session")
def victoria_bin() -> Path:
    from harness.victoria import find_victoria

    return _required_binary(
        find_victoria(),
        "victoria-metrics (Debian package `victoria-metrics`)",
        "EDGE_GPU_RELAY_REQUIRE_VICTORIA",
    )


def _own_handlers(root: logging.Logger) -> list[logging.Handler]:
    """The root logger's handlers less pytest's own (it adds and removes those per phase)."""
    return [h for h in root.handlers if not type(h).__module__.startswith("_pytest")]


@pytest.fixture(autouse=True)
def _root_logging_restored() -> Iterator[None]:
    """A test that runs a CLI in-process installs its handler on the root logger, on the
    sys.stderr of that test's capture; put back what was there so that the next test's
    threads do not log to a closed stream ("--- Logging error ---" in CI's output)."""
    root = logging.getLogger()
    handlers, level = _own_handlers(root), root.level
    yield
    for handler in _own_handlers(root):
        if handler not in handlers:
            root.removeHandler(handler)
    for handler in handlers:
        if handler not in root.handlers:
            root.addHandler(handler)
    root.setLevel(level)
