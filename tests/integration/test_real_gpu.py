"""Against real NVML on a real GPU. Skipped, with the reason, where there is none."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from edge_agent.backend import Backend
from edge_agent.config import load
from edge_agent.nvml.backend import open_real
from edge_agent.pipeline import build_pipeline
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


# nvidia-smi --query-gpu property -> (our series, tolerance): what nvidia-smi prints in the
# same second as our collection. Memory and temperature move slowly (exact up to a process
# starting meanwhile); power, clocks and utilisation are sampled, so they may differ a bit.
SMI = {
    "memory.used": ("DCGM_FI_DEV_FB_USED", 64.0),
    "memory.free": ("DCGM_FI_DEV_FB_FREE", 64.0),
    "memory.reserved": ("DCGM_FI_DEV_FB_RESERVED", 0.0),
    "temperature.gpu": ("DCGM_FI_DEV_GPU_TEMP", 2.0),
    "power.draw": ("DCGM_FI_DEV_POWER_USAGE", 30.0),
    "clocks.mem": ("DCGM_FI_DEV_MEM_CLOCK", 0.0),
}


def test_device_figures_match_nvidia_smi() -> None:
    """Every figure nvidia-smi also shows, taken in the same second, per GPU (whole GPUs)."""
    query = ",".join(["uuid", *SMI])
    cfg = load(None, {})
    pipeline = build_pipeline(Backend(open_real(), "nvml", cfg))
    try:
        snap = pipeline.collection.collect()
        smi = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
    finally:
        pipeline.close()
    ours: dict[tuple[str, str], float] = {
        (dict(s.labels)["UUID"], s.name): s.value
        for s in snap.samples
        if s.name.startswith("DCGM_FI_DEV_") and not dict(s.labels).get("GPU_I_ID")
    }
    rows = []
    for line in smi.strip().splitlines():
        uuid, *values = (v.strip() for v in line.split(","))
        for (prop, (series, tolerance)), text in zip(SMI.items(), values, strict=True):
            if text in ("[N/A]", "[Not Supported]") or (uuid, series) not in ours:
                rows.append((uuid, prop, text, ours.get((uuid, series))))
                continue
            mine = ours[(uuid, series)]
            rows.append((uuid, prop, text, mine))
            assert abs(float(text) - mine) <= tolerance, f"{uuid} {prop}: smi {text}, ours {mine}"
    for uuid, prop, text, mine in rows:  # visible with -s: the comparison for docs/
        print(f"{uuid}  {prop:<16} nvidia-smi {text:<10} ours {mine}")
