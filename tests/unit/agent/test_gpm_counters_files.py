"""NVIDIA's own counters files (tests/fixtures/dcgm-exporter/, unchanged) on simulated GPUs.

On H100s every field they enable is served. The fields that stay unsupported, without GPM
or when every commented-out line is enabled, are exactly the ones docs/metrics.md lists
with the reason, so the page cannot drift from the agent.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from edge_agent.catalog import load_counters, parse_counters
from edge_agent.config import load
from edge_agent.sim.nvml import SimulatedNvml
from gpurelay.model import Snapshot
from harness.pipeline import FakeClock, make_pipeline
from tests.unit.agent.test_gpm import Node

ROOT = Path(__file__).resolve().parents[3]
FIXTURES = ROOT / "tests" / "fixtures" / "dcgm-exporter"
CSV_FILES = ["default-counters.csv", "dcp-metrics-included.csv"]
DOCS = ROOT / "docs" / "metrics.md"


def documented(heading: str) -> dict[str, str]:
    """Field -> reason from the table under ``heading`` in docs/metrics.md."""
    text = DOCS.read_text()
    start = text.index(heading)
    rows: dict[str, str] = {}
    for line in text[start:].splitlines()[1:]:
        if line.startswith("#"):
            break
        m = re.fullmatch(r"\| `(\w+)` \| (.+) \|", line)
        if m:
            rows[m.group(1)] = m.group(2)
    assert rows, f"no table under {heading!r} in {DOCS}"
    return rows


def served(snap: Snapshot) -> dict[str, set[str]]:
    """Field -> the GPUs (and GPU instances, as gpu/GI) it has a sample for."""
    out: dict[str, set[str]] = {}
    for s in snap.samples:
        labels = dict(s.labels)
        if "gpu" in labels:
            key = labels["gpu"] + (f"/{labels['GPU_I_ID']}" if "GPU_I_ID" in labels else "")
            out.setdefault(s.name, set()).add(key)
    return out


def uncommented(text: str) -> str:
    """Every field line of ``text`` enabled; a field listed twice keeps its first line."""
    lines, seen = [], set()
    for line in text.splitlines():
        m = re.match(r"#?\s*(DCGM_\w+)\s*,", line)
        if m and m.group(1) not in seen:
            seen.add(m.group(1))
            lines.append(line.lstrip("# "))
    return "\n".join(lines) + "\n"


def two_collections(
    tmp_path: Path, counters: Path, *, mig: bool = False
) -> tuple[Snapshot, dict[str, str]]:
    cfg = dataclasses.replace(load(None, {}), counters_file=counters)
    pipeline, _sim, clock = make_pipeline(tmp_path / str(mig), gpus=2, mig=mig, cfg=cfg)
    try:
        pipeline.collection.collect()
        clock.advance(10)
        snap = pipeline.collection.collect()
    finally:
        pipeline.close()
    return snap, pipeline.collection.unsupported


@pytest.mark.parametrize("name", CSV_FILES)
def test_nvidias_file_is_served_completely_on_h100(name: str, tmp_path: Path) -> None:
    path = FIXTURES / name
    specs = load_counters(path)
    snap, unsupported = two_collections(tmp_path, path)
    assert unsupported == {}
    got = served(snap)
    for spec in specs:
        if spec.kind == "label":
            device = [s for s in snap.samples if s.name.startswith("DCGM_FI_")]
            assert device and all(dict(s.labels).get(spec.field) for s in device)
            continue
        assert got.get(spec.field) == {"0", "1"}, spec.field
    assert "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE" in got  # NVIDIA's dashboard's Tensor Core panel
    # GPU 0 in MIG mode: the activity fields per GPU instance too. (NVML itself answers
    # NOT_SUPPORTED for a few fields of a GPU in MIG mode, utilisation among them.)
    snap, unsupported = two_collections(tmp_path, path, mig=True)
    assert unsupported == {}
    got = served(snap)
    for field in ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"):
        assert got[field] == {"0", "0/1", "0/5", "0/13", "1"}, field


@pytest.mark.parametrize("name", CSV_FILES)
def test_without_gpm_the_documented_fields_stay_unsupported(name: str) -> None:
    clock = FakeClock()
    sim = SimulatedNvml(2, seed=3, clock=clock, model="NVIDIA A100-SXM4-80GB")
    sim.nvmlInit()
    specs = load_counters(FIXTURES / name)
    node = Node(sim, clock, counters=(FIXTURES / name).read_text())
    node.collect()
    clock.advance(10)
    snap = node.collect()
    node.close()
    without_gpm = documented("| Field | Why, without GPM |")
    asked = {s.field for s in specs}
    assert set(node.collector.unsupported) == asked & set(without_gpm)
    assert set(node.collector.unsupported) == {
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
        "DCGM_FI_PROF_DRAM_ACTIVE",
    }
    got = served(snap)
    for field in asked - set(without_gpm):
        if field != "DCGM_FI_DRIVER_VERSION":
            assert {"0", "1"} <= got.get(field, set()), field


@pytest.mark.parametrize("name", CSV_FILES)
def test_every_line_uncommented_leaves_the_documented_fields(name: str, tmp_path: Path) -> None:
    text = uncommented((FIXTURES / name).read_text())
    path = tmp_path / name
    path.write_text(text)
    specs = parse_counters(text)
    snap, unsupported = two_collections(tmp_path, path)
    listed = documented("| Field | Why it is not served |")
    assert set(unsupported) == set(listed) & {s.field for s in specs}
    got = served(snap)
    # A GPU with no clock-event reason set in the window has no DCGM_EXP_CLOCK_EVENTS_COUNT
    # series, as in dcgm-exporter (tests/unit/agent/test_health_series.py)
    quiet = {"DCGM_EXP_CLOCK_EVENTS_COUNT"}
    for spec in specs:
        if spec.kind != "label" and spec.field not in {*listed, *quiet}:
            assert {"0", "1"} <= got.get(spec.field, set()), spec.field
