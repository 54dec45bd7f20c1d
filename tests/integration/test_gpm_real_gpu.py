"""GPM against real NVML on a real GPU (skipped, with the reason, where there is none).

On Hopper or newer the profiling fields of NVIDIA's dcp-metrics-included.csv come out in
dcgm-exporter's units from the second collection; on an older GPU they are reported
unsupported with the reason NVML gave, and never sampled. Either way no sample buffer is
left behind. Run with -s to see the values.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pynvml
import pytest

from edge_agent.backend import Backend
from edge_agent.config import load
from edge_agent.nvml.backend import open_real
from edge_agent.nvml.devices import enumerate_gpus
from edge_agent.nvml.gpm import GpmStream, unsupported_reason
from edge_agent.pipeline import build_pipeline

pytestmark = pytest.mark.gpu

COUNTERS = Path(__file__).resolve().parents[1] / "fixtures" / "dcgm-exporter"
RATIOS = ("GR_ENGINE_ACTIVE", "PIPE_TENSOR_ACTIVE", "DRAM_ACTIVE")


def test_gpm_streams_on_real_hardware() -> None:
    lib = open_real()
    try:
        devices, _ = enumerate_gpus(lib)
        assert devices, "NVML reported no GPU"
        for dev in devices:
            reason = unsupported_reason(lib, dev.handle)
            print(f"GPU {dev.index} {dev.name}: GPM {'yes' if reason is None else reason}")
            if reason is not None:
                continue
            metrics = [pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL, pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC]
            stream = GpmStream(lib, dev.handle, metrics)
            try:
                assert stream.advance() is None
                time.sleep(1.0)  # GPM wants samples at least 100 ms apart
                values = stream.advance()
            finally:
                stream.close()
            assert values is not None
            print(f"  over 1 s: {values}")
            graphics = values[pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL]
            assert isinstance(graphics, float) and 0.0 <= graphics <= 100.0
    finally:
        lib.nvmlShutdown()


def test_nvidias_dcp_file_on_real_hardware() -> None:
    cfg = dataclasses.replace(load(None, {}), counters_file=COUNTERS / "dcp-metrics-included.csv")
    pipeline = build_pipeline(Backend(open_real(), "nvml", cfg))
    try:
        pipeline.collection.collect()
        time.sleep(1.0)
        snap = pipeline.collection.collect()
        unsupported = dict(pipeline.collection.unsupported)
    finally:
        pipeline.close()
    print("unsupported:", unsupported)
    for field in RATIOS:
        name = f"DCGM_FI_PROF_{field}"
        got = [s.value for s in snap.samples if s.name == name]
        print(name, got)
        if name in unsupported:
            assert "GPM" in unsupported[name]
        else:
            assert got and all(0.0 <= v <= 1.0 for v in got), (name, got)
