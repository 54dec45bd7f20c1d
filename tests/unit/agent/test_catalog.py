from __future__ import annotations

from pathlib import Path

import pytest

from edge_agent.catalog import load_counters, parse_counters
from edge_agent.errors import CountersFileError

# dcgm-exporter's own format: spaces, comments, a stray space before the comma.
DCGM_STYLE = """\
# Format
# DCGM FIELD, Prometheus metric type, help message
DCGM_FI_DEV_SM_CLOCK,  gauge, SM clock frequency (in MHz).
DCGM_FI_DEV_DEC_UTIL ,     gauge, Decoder utilization (in %).
DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION, counter, Total energy consumption since boot (in mJ).
DCGM_FI_DRIVER_VERSION,        label, Driver Version
"""


def test_parses_a_dcgm_exporter_file_unchanged() -> None:
    specs = parse_counters(DCGM_STYLE)
    assert [(s.field, s.kind) for s in specs] == [
        ("DCGM_FI_DEV_SM_CLOCK", "gauge"),
        ("DCGM_FI_DEV_DEC_UTIL", "gauge"),
        ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "counter"),
        ("DCGM_FI_DRIVER_VERSION", "label"),
    ]
    assert specs[1].help == "Decoder utilization (in %)."


def test_default_file_covers_dcgm_exporter_defaults() -> None:
    fields = {s.field for s in load_counters(None)}
    dcgm_default = {
        "DCGM_FI_DEV_SM_CLOCK",
        "DCGM_FI_DEV_MEM_CLOCK",
        "DCGM_FI_DEV_MEMORY_TEMP",
        "DCGM_FI_DEV_GPU_TEMP",
        "DCGM_FI_DEV_POWER_USAGE",
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
        "DCGM_FI_DEV_GPU_UTIL",
        "DCGM_FI_DEV_MEM_COPY_UTIL",
        "DCGM_FI_DEV_ENC_UTIL",
        "DCGM_FI_DEV_DEC_UTIL",
        "DCGM_FI_DEV_XID_ERRORS",
        "DCGM_FI_DEV_FB_FREE",
        "DCGM_FI_DEV_FB_USED",
        "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
        "DCGM_FI_DEV_VGPU_LICENSE_STATUS",
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
        "DCGM_FI_DEV_ROW_REMAP_FAILURE",
        "DCGM_FI_DRIVER_VERSION",
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
        "DCGM_FI_PROF_DRAM_ACTIVE",
        "DCGM_FI_PROF_PCIE_TX_BYTES",
        "DCGM_FI_PROF_PCIE_RX_BYTES",
    }
    assert dcgm_default <= fields


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("DCGM_FI_DEV_GPU_UTIL\n", r"<counters>:1: expected 'FIELD, TYPE, HELP'"),
        ("# c\nDCGM_FI_DEV_GPU_UTIL, histogramm, x\n", r":2: type 'histogramm'"),
        ("A, gauge, x\nA, gauge, y\n", r":2: field A is listed twice"),
        ("1BAD, gauge, x\n", r"not a valid field name"),
        ("DCGM_FI_DRIVER_VERSION, label, x\n", r"no gauge or counter fields"),
    ],
)
def test_bad_lines_name_file_and_line(text: str, message: str) -> None:
    with pytest.raises(CountersFileError, match=message):
        parse_counters(text)


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(CountersFileError, match="cannot be read"):
        load_counters(tmp_path / "missing.csv")
