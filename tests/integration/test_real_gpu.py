"""Against real NVML on a real GPU. Skipped, with the reason, where there is none."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from edge_agent.app import Backend, build_pipeline
from edge_agent.config import load
from edge_agent.nvml.backend import open_real
from gpurelay.exposition import render_text

pytestmark = pytest.mark.gpu


def test_one_collection_on_real_hardware() -> None:
    cfg = load(None, {})
    pipeline = build_pipeline(Backend(open_real(), "nvml", cfg))
    try:
        pipeline.xid.start()
        snap = pipeline.collection.collect()
    finally:
        pipeline.close()
    assert snap.gpus, "NVML reported no GPU"
    names = {s.name for s in snap.samples}
    assert {"DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE"} <= names
    for gpu in snap.gpus:
        assert gpu.healthy and gpu.memory_total_bytes > 0
        assert gpu.uuid.startswith(("GPU-", "MIG-"))
    temps = [s.value for s in snap.samples if s.name == "DCGM_FI_DEV_GPU_TEMP"]
    assert all(10 <= t <= 110 for t in temps)
    body = render_text(snap).decode()
    assert 'backend="nvml"' in body
    print(body)  # visible with -s: what a real box looked like


def test_cli_once_on_real_hardware(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "edge_agent", "once", "--format", "bie"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert '"deviceNum"' in proc.stdout
