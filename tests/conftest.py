"""Shared fixtures: external tools that CI installs, and the GPU marker."""

from __future__ import annotations

import os
import shutil
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


@pytest.fixture(scope="session")
def promtool() -> Path:
    return required_tool("promtool", "EDGE_GPU_RELAY_REQUIRE_PROMTOOL", "prometheus")


@pytest.fixture(scope="session")
def prometheus_bin() -> Path:
    return required_tool("prometheus", "EDGE_GPU_RELAY_REQUIRE_PROMETHEUS", "prometheus")
