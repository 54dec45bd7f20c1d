"""dcgm-exporter's two naming schemes (issue 27 §1): a 4.8 and a 4.9 counters file each
load unchanged and publish that version's names, labels and units, field by field.

Each field's expected value is taken from the simulated NVML itself (the call DCGM makes,
in DCGM's unit), not from the agent's code: clocks in MHz x 10^6, energy in mJ / 1000,
utilisation in % / 100, memory in NVML's bytes, NVLink in KiB x 1024 per second.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pynvml
import pytest

from edge_agent import cli
from edge_agent.catalog import DEFAULT_COUNTERS, load_counters, parse_counters
from edge_agent.config import load
from edge_agent.errors import ConfigError
from edge_agent.fields import SOURCES
from edge_agent.sim.nvml import SimulatedNvml
from gpurelay import naming
from gpurelay.families import known
from gpurelay.model import MIB, Snapshot
from harness.pipeline import make_pipeline

ROOT = Path(__file__).resolve().parents[3]
FIXTURES = ROOT / "tests" / "fixtures" / "dcgm-exporter"
CSV_48 = FIXTURES / "default-counters.csv"  # NVIDIA's 4.8.2 file, unchanged
CSV_49 = FIXTURES / "4.9" / "default-counters.csv"

Read = Callable[[SimulatedNvml, Any], float]


def _memory(sim: SimulatedNvml, h: Any) -> Any:
    return sim.nvmlDeviceGetMemoryInfo(h, pynvml.nvmlMemory_v2)


def _field(sim: SimulatedNvml, h: Any, field_id: int) -> float:
    (fv,) = sim.nvmlDeviceGetFieldValues(h, [field_id])
    assert fv.nvmlReturn == pynvml.NVML_SUCCESS
    return float(
        fv.value.sllVal
        if fv.valueType == pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG
        else fv.value.uiVal
    )


# The value of each default field, straight from NVML, in dcgm-exporter 4.8's and 4.9's unit.
# (4.8 name, 4.9 name): (4.8 value, 4.9 value)
EXPECTED: dict[tuple[str, str], tuple[Read, Read]] = {
    ("DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_SM_CLOCK_HERTZ"): (
        lambda s, h: s.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
        lambda s, h: s.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM) * 1_000_000,
    ),
    ("DCGM_FI_DEV_MEM_CLOCK", "DCGM_FI_DEV_MEMORY_CLOCK_HERTZ"): (
        lambda s, h: s.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM),
        lambda s, h: s.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM) * 1_000_000,
    ),
    ("DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_GPU_TEMP_CELSIUS"): (
        lambda s, h: s.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
        lambda s, h: s.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
    ),
    ("DCGM_FI_DEV_MEMORY_TEMP", "DCGM_FI_DEV_MEMORY_TEMP_CELSIUS"): (
        lambda s, h: _field(s, h, pynvml.NVML_FI_DEV_MEMORY_TEMP),
        lambda s, h: _field(s, h, pynvml.NVML_FI_DEV_MEMORY_TEMP),
    ),
    ("DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_BOARD_POWER_WATTS"): (
        lambda s, h: s.nvmlDeviceGetPowerUsage(h) / 1000,
        lambda s, h: s.nvmlDeviceGetPowerUsage(h) / 1000,
    ),
    ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "DCGM_FI_DEV_GPU_ENERGY_JOULES_TOTAL"): (
        lambda s, h: s.nvmlDeviceGetTotalEnergyConsumption(h),
        lambda s, h: s.nvmlDeviceGetTotalEnergyConsumption(h) / 1000,
    ),
    ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "DCGM_FI_DEV_PCIE_REPLAY_TOTAL"): (
        lambda s, h: s.nvmlDeviceGetPcieReplayCounter(h),
        lambda s, h: s.nvmlDeviceGetPcieReplayCounter(h),
    ),
    ("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_GPU_UTIL_RATIO"): (
        lambda s, h: s.nvmlDeviceGetUtilizationRates(h).gpu,
        lambda s, h: s.nvmlDeviceGetUtilizationRates(h).gpu / 100,
    ),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "DCGM_FI_DEV_MEMORY_COPY_UTIL_RATIO"): (
        lambda s, h: s.nvmlDeviceGetUtilizationRates(h).memory,
        lambda s, h: s.nvmlDeviceGetUtilizationRates(h).memory / 100,
    ),
    ("DCGM_FI_DEV_ENC_UTIL", "DCGM_FI_DEV_ENC_UTIL_RATIO"): (
        lambda s, h: s.nvmlDeviceGetEncoderUtilization(h)[0],
        lambda s, h: s.nvmlDeviceGetEncoderUtilization(h)[0] / 100,
    ),
    ("DCGM_FI_DEV_DEC_UTIL", "DCGM_FI_DEV_DEC_UTIL_RATIO"): (
        lambda s, h: s.nvmlDeviceGetDecoderUtilization(h)[0],
        lambda s, h: s.nvmlDeviceGetDecoderUtilization(h)[0] / 100,
    ),
    ("DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_XID_ERROR"): (
        lambda s, h: 0,  # no XID since the agent started
        lambda s, h: 0,
    ),
    ("DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_FREE_BYTES"): (
        lambda s, h: _memory(s, h).free // MIB,
        lambda s, h: _memory(s, h).free,
    ),
    ("DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_USED_BYTES"): (
        lambda s, h: _memory(s, h).used // MIB,
        lambda s, h: _memory(s, h).used,
    ),
    ("DCGM_FI_DEV_FB_RESERVED", "DCGM_FI_DEV_FB_RESERVED_BYTES"): (
        lambda s, h: _memory(s, h).reserved // MIB,
        lambda s, h: _memory(s, h).reserved,
    ),
    ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "DCGM_FI_DEV_ROW_REMAP_UNCORRECTABLE_TOTAL"): (
        lambda s, h: s.nvmlDeviceGetRemappedRows(h)[1],
        lambda s, h: s.nvmlDeviceGetRemappedRows(h)[1],
    ),
    ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "DCGM_FI_DEV_ROW_REMAP_CORRECTABLE_TOTAL"): (
        lambda s, h: s.nvmlDeviceGetRemappedRows(h)[0],
        lambda s, h: s.nvmlDeviceGetRemappedRows(h)[0],
    ),
    ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "DCGM_FI_DEV_ROW_REMAP_FAILED"): (
        lambda s, h: s.nvmlDeviceGetRemappedRows(h)[3],
        lambda s, h: s.nvmlDeviceGetRemappedRows(h)[3],
    ),
}
# Read over an interval (two collections); checked in their own tests below.
OVER_AN_INTERVAL = {
    ("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "DCGM_FI_DEV_NVLINK_THROUGHPUT_TOTAL"),
    ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_PROF_GR_ENGINE_UTIL_RATIO"),
    ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "DCGM_FI_PROF_TENSOR_UTIL_RATIO"),
    ("DCGM_FI_PROF_DRAM_ACTIVE", "DCGM_FI_PROF_DRAM_UTIL_RATIO"),
}


def value(snap: Snapshot, name: str, gpu: str = "0") -> float | None:
    for s in snap.samples:
        if s.name == name and dict(s.labels).get("gpu") == gpu and "GPU_I_ID" not in dict(s.labels):
            return s.value
    return None


def names(snap: Snapshot) -> set[str]:
    return {s.name for s in snap.samples}


def both_files(tmp_path: Path) -> Path:
    """One counters file with every default field under both names, so that one collection
    (one NVML answer per call) gives both."""
    rows = [
        f"{old}, {known(old).type}, h\n{new}, {known(new).type}, h\n"
        for old, new in [*EXPECTED, *OVER_AN_INTERVAL]
    ]  # type: ignore[union-attr]
    path = tmp_path / "both.csv"
    path.write_text("".join(rows))
    return path


def collect(
    tmp_path: Path, counters: Path | None, **cfg: Any
) -> tuple[Snapshot, SimulatedNvml, Any]:
    base = dataclasses.replace(load(None, {}), counters_file=counters, **cfg)
    pipeline, sim, _clock = make_pipeline(tmp_path, gpus=1, cfg=base)
    return pipeline.collection.collect(), sim, pipeline


def test_the_map_covers_the_renamed_default_fields_with_their_sources() -> None:
    default = [r for r in naming.renames() if r.default]
    assert len(default) == 22  # of the 23 dcgm-exporter 4.9 renames: docs/migration.md
    assert {(r.old, r.new) for r in default} == {*EXPECTED, *OVER_AN_INTERVAL}
    for r in naming.renames():
        assert r.old in SOURCES and r.new in SOURCES, r
        assert r.source, r
        assert known(r.new) is not None and known(r.new).type == known(r.old).type  # type: ignore[union-attr]
    rescaled = {r.new: (r.old_unit, r.new_unit) for r in default if r.rescales}
    assert len(rescaled) == 11  # "Eleven of them also change unit" (4.9.0 release notes)
    assert naming.name_in("DCGM_FI_DEV_GPU_UTIL", "4.9") == "DCGM_FI_DEV_GPU_UTIL_RATIO"
    assert naming.name_in("DCGM_FI_DEV_GPU_UTIL_RATIO", "4.8") == "DCGM_FI_DEV_GPU_UTIL"
    assert (
        naming.name_in("DCGM_FI_DEV_VGPU_LICENSE_STATUS", "4.9")
        == "DCGM_FI_DEV_VGPU_LICENSE_STATUS"
    )


@pytest.mark.parametrize(("old", "new"), sorted(EXPECTED), ids=[n for _, n in sorted(EXPECTED)])
def test_each_field_in_each_scheme_equals_nvml_in_that_schemes_unit(
    tmp_path: Path, old: str, new: str
) -> None:
    snap, sim, pipeline = collect(tmp_path, both_files(tmp_path))
    handle = sim.nvmlDeviceGetHandleByIndex(0)
    expect_old, expect_new = EXPECTED[(old, new)]
    try:
        assert value(snap, old) == float(expect_old(sim, handle))
        assert value(snap, new) == float(expect_new(sim, handle))
    finally:
        pipeline.close()


def test_nvlink_throughput_is_bytes_per_second_in_49_and_kib_over_1000_in_48(
    tmp_path: Path,
) -> None:
    base = dataclasses.replace(load(None, {}), counters_file=both_files(tmp_path))
    pipeline, sim, clock = make_pipeline(tmp_path, gpus=1, cfg=base, profile="h100-sxm")
    handle = sim.nvmlDeviceGetHandleByIndex(0)
    data = [
        (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, 0xFFFFFFFF),
        (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, 0xFFFFFFFF),
    ]

    def kib() -> int:
        return sum(int(fv.value.ullVal) for fv in sim.nvmlDeviceGetFieldValues(handle, data))

    pipeline.collection.collect()
    before = kib()
    clock.advance(10)
    snap = pipeline.collection.collect()
    after = kib()
    pipeline.close()
    assert after > before
    assert value(snap, "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL") == (after - before) / 10 / 1000
    assert value(snap, "DCGM_FI_DEV_NVLINK_THROUGHPUT_TOTAL") == (after - before) * 1024 / 10


def test_profiling_ratios_are_the_same_value_under_both_names(tmp_path: Path) -> None:
    base = dataclasses.replace(load(None, {}), counters_file=both_files(tmp_path))
    pipeline, _sim, clock = make_pipeline(tmp_path, gpus=1, cfg=base, profile="h100-sxm")
    pipeline.collection.collect()
    clock.advance(10)
    snap = pipeline.collection.collect()
    pipeline.close()
    for old, new in OVER_AN_INTERVAL:
        if old.startswith("DCGM_FI_PROF_"):
            got = value(snap, old)
            assert got is not None and 0 <= got <= 1, old
            assert value(snap, new) == got, new


def test_nvidias_48_file_loads_unchanged_and_publishes_48_names(tmp_path: Path) -> None:
    snap, _, pipeline = collect(tmp_path, CSV_48, dcgm_naming="4.9")  # the file's names win
    pipeline.close()
    published = names(snap)
    assert {"DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_GPU_UTIL"} <= published
    assert not published & {r.new for r in naming.renames()}
    labels = next(dict(s.labels) for s in snap.samples if s.name == "DCGM_FI_DEV_GPU_TEMP")
    assert "DCGM_FI_DRIVER_VERSION" in labels and "DCGM_FI_SYSTEM_DRIVER_VERSION" not in labels


def test_a_49_file_loads_unchanged_and_publishes_49_names(tmp_path: Path) -> None:
    snap, sim, pipeline = collect(tmp_path, CSV_49)  # under the default scheme (4.8) too
    published = names(snap)
    wanted = {s.field for s in parse_counters(CSV_49.read_text()) if s.kind != "label"}
    # What a single H100 without NVLink traffic in the first cycle cannot give yet:
    first_cycle = {
        "DCGM_FI_DEV_NVLINK_THROUGHPUT_TOTAL",
        "DCGM_FI_PROF_GR_ENGINE_UTIL_RATIO",
        "DCGM_FI_PROF_TENSOR_UTIL_RATIO",
        "DCGM_FI_PROF_DRAM_UTIL_RATIO",
        "DCGM_FI_DEV_VGPU_LICENSE_STATUS",
        "DCGM_FI_PROF_PCIE_TX_BYTES",
        "DCGM_FI_PROF_PCIE_RX_BYTES",
    }
    assert wanted - first_cycle <= published
    assert not published & {r.old for r in naming.renames()}
    handle = sim.nvmlDeviceGetHandleByIndex(0)
    total = _memory(sim, handle).total
    driver = sim.nvmlSystemGetDriverVersion()
    pipeline.close()
    assert value(snap, "DCGM_FI_DEV_FB_CAPACITY_BYTES") == total
    labels = next(dict(s.labels) for s in snap.samples if s.name == "DCGM_FI_DEV_GPU_TEMP_CELSIUS")
    assert labels["DCGM_FI_SYSTEM_DRIVER_VERSION"] == driver
    assert "DCGM_FI_DRIVER_VERSION" not in labels


def test_the_setting_chooses_the_built_in_file_and_the_driver_label(tmp_path: Path) -> None:
    for scheme in naming.NAMINGS:
        (tmp_path / scheme).mkdir()
        snap, _, pipeline = collect(tmp_path / scheme, None, dcgm_naming=scheme)
        pipeline.close()
        published = names(snap)
        temp = naming.name_in("DCGM_FI_DEV_GPU_TEMP", scheme)
        assert temp in published
        labels = next(dict(s.labels) for s in snap.samples if s.name == temp)
        assert naming.DRIVER_LABEL[scheme] in labels
        other = "4.8" if scheme == "4.9" else "4.9"
        assert naming.DRIVER_LABEL[other] not in labels
        renamed = {getattr(r, "old" if other == "4.8" else "new") for r in naming.renames()}
        assert not published & renamed, scheme


def test_the_two_built_in_files_list_the_same_fields() -> None:
    old = load_counters(None, "4.8")
    new = load_counters(None, "4.9")
    assert DEFAULT_COUNTERS["4.9"] != DEFAULT_COUNTERS["4.8"]
    translated = [(naming.name_in(s.field, "4.9"), s.kind) for s in old]
    translated = [
        ("DCGM_FI_SYSTEM_DRIVER_VERSION", k) if f == "DCGM_FI_DRIVER_VERSION" else (f, k)
        for f, k in translated
    ]
    assert [
        (s.field, s.kind) for s in new if s.field != "DCGM_FI_DEV_FB_CAPACITY_BYTES"
    ] == translated


def test_an_unknown_scheme_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "agent.toml"
    path.write_text('dcgm_naming = "5.0"\n')
    with pytest.raises(ConfigError, match=r"dcgm_naming must be one of '4\.8', '4\.9'"):
        load(path, {})


def test_bytes_are_nvmls_bytes_not_whole_mib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A driver's used and free memory are not whole MiB (the simulator's are): 4.9's bytes
    are NVML's figure, 4.8's MiB are it rounded down, as DCGM does."""
    real = SimulatedNvml.nvmlDeviceGetMemoryInfo
    odd = 12_345  # bytes moved from free to used

    def memory(self: SimulatedNvml, handle: Any, version: int | None = None) -> Any:
        m = real(self, handle, version)
        m.used, m.free = m.used + odd, m.free - odd
        return m

    monkeypatch.setattr(SimulatedNvml, "nvmlDeviceGetMemoryInfo", memory)
    snap, sim, pipeline = collect(tmp_path, both_files(tmp_path))
    m = _memory(sim, sim.nvmlDeviceGetHandleByIndex(0))
    pipeline.close()
    assert m.used % MIB and m.free % MIB
    assert value(snap, "DCGM_FI_DEV_FB_USED_BYTES") == m.used
    assert value(snap, "DCGM_FI_DEV_FB_FREE_BYTES") == m.free
    assert value(snap, "DCGM_FI_DEV_FB_USED") == m.used // MIB
    assert value(snap, "DCGM_FI_DEV_FB_FREE") == m.free // MIB


def test_the_migration_table_is_the_map() -> None:
    """docs/migration.md lists each rename of gpurelay/data/dcgm-names.csv, no other."""
    text = (ROOT / "docs" / "migration.md").read_text(encoding="utf-8")
    rows = set()
    for line in text.splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("DCGM_") and cells[1].startswith("DCGM_"):
            rows.add((cells[0], cells[1], cells[2]))
    want = set()
    for r in naming.renames():
        unit = f"{r.old_unit} → {r.new_unit}" if r.rescales else r.old_unit
        want.add((r.old, r.new, unit))
    assert rows == want


def test_the_setting_is_read_from_the_environment() -> None:
    assert load(None, {}).dcgm_naming == naming.DEFAULT_NAMING == "4.8"
    assert load(None, {"EDGE_AGENT_DCGM_NAMING": "4.9"}).dcgm_naming == "4.9"


def test_the_command_line_chooses_the_scheme(tmp_path: Path) -> None:
    args = cli._parser().parse_args(["once", "--dcgm-naming", "4.9"])
    assert cli._config(args).dcgm_naming == "4.9"
    assert cli._config(cli._parser().parse_args(["once"])).dcgm_naming == "4.8"
    with pytest.raises(SystemExit):
        cli._parser().parse_args(["once", "--dcgm-naming", "5.0"])
