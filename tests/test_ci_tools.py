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
