"""In CI, tools that some tests need must be present: their absence fails here, loudly,
instead of silently skipping the tests that use them."""

from __future__ import annotations

import os
import shutil

import pytest

REQUIRED = [
    ("EDGE_GPU_RELAY_REQUIRE_PROMTOOL", "promtool", "prometheus"),
    ("EDGE_GPU_RELAY_REQUIRE_SSH_KEYGEN", "ssh-keygen", "openssh-client"),
    ("EDGE_GPU_RELAY_REQUIRE_PROMETHEUS", "prometheus", "prometheus"),
    ("EDGE_GPU_RELAY_REQUIRE_SHELLCHECK", "shellcheck", "shellcheck"),
    ("EDGE_GPU_RELAY_REQUIRE_SYSTEMD", "systemd-analyze", "systemd"),
]


@pytest.mark.parametrize(("variable", "tool", "package"), REQUIRED)
def test_required_tool_is_installed(variable: str, tool: str, package: str) -> None:
    if os.environ.get(variable) != "1":
        pytest.skip(f"{variable} is not set (only CI requires {tool})")
    assert shutil.which(tool), f"{tool} missing: install the Debian package {package}"


def test_postgresql_is_installed_when_ci_requires_it() -> None:
    """Debian keeps initdb off PATH (/usr/lib/postgresql/<version>/bin): found the harness's way."""
    from harness.postgres import find_bindir

    if os.environ.get("EDGE_GPU_RELAY_REQUIRE_POSTGRES") != "1":
        pytest.skip("EDGE_GPU_RELAY_REQUIRE_POSTGRES is not set (only CI requires PostgreSQL)")
    assert find_bindir() is not None, "initdb missing: install the Debian package postgresql"
