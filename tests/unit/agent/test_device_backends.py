"""The device backend seam (issue 28): NVML's collector (on real NVML where there is a GPU,
and on the simulator) and the Jetson's (on fake board trees) behind one contract,
:class:`edge_agent.collect.DeviceSource`.

Each backend, run by the same :class:`~edge_agent.collect.Collector`, must:

- declare every family it adds samples to, each with the fleet catalogue's TYPE and HELP
  (so the exposition, spool, tunnel and gateway take it unchanged);
- put the GPU labels the rest of the product keys on (``gpu``, ``UUID``, the node label)
  on every device series, with a ``UUID`` of a GPU it returns in the inventory;
- render to a text exposition Prometheus' parser reads;
- say why for what it cannot give, and never raise for a failing source.

And the Jetson's figures are the board's files in DCGM's units.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from edge_agent.backend import Backend
from edge_agent.collect import Collector
from edge_agent.config import AgentConfig
from edge_agent.jetson.board import read_board
from edge_agent.jetson.collector import JetsonDeviceCollector, gpu_uuid
from edge_agent.nvml.backend import open_real
from edge_agent.pipeline import build_pipeline
from edge_agent.sim.jetson import BOARDS, build
from gpurelay.bie import collect_document
from gpurelay.exposition import render_text
from gpurelay.families import known
from gpurelay.model import MIB, Snapshot
from harness.pipeline import make_pipeline

NODE = "edge-node-1"
# real NVML where this machine has a GPU (the gpu mark: skipped, with the reason, elsewhere)
BACKENDS = [pytest.param("nvml", marks=pytest.mark.gpu), "nvml-simulator", *sorted(BOARDS)]


def jetson_collector(root: Path, board: str) -> Collector:
    tree = build(root, board)
    device = JetsonDeviceCollector(
        sys_root=tree.sys_root, proc_root=tree.proc_root, etc_root=tree.etc_root, node=NODE
    )
    return Collector(node=NODE, backend="jetson", device=device, process=None)


@contextmanager
def backend(name: str, tmp_path: Path) -> Iterator[Collector]:
    if name == "nvml":
        real = build_pipeline(Backend(open_real(), "nvml", AgentConfig(node_name=NODE)))
        try:
            yield real.collection
        finally:
            real.close()
    elif name == "nvml-simulator":
        pipeline, _sim, _clock = make_pipeline(tmp_path, gpus=2)
        try:
            yield pipeline.collection
        finally:
            pipeline.close()
    else:
        collector = jetson_collector(tmp_path, name)
        try:
            yield collector
        finally:
            collector.close()


@pytest.mark.parametrize("name", BACKENDS)
def test_every_backend_keeps_the_contract(name: str, tmp_path: Path) -> None:
    with backend(name, tmp_path) as collection:
        snap = collection.collect()
    declared = {f.name: f for f in snap.families}
    device_series = [s for s in snap.samples if s.name.startswith(("DCGM_FI_", "gpurelay_jetson_"))]
    assert device_series, name
    uuids = {g.uuid for g in snap.gpus}
    assert uuids and all(g.healthy for g in snap.gpus)
    for s in snap.samples:
        assert s.name in declared, f"{name}: {s.name} not declared"
    for family in declared.values():
        fixed = known(family.name)
        if fixed is not None:
            assert family.type == fixed.type, (name, family.name)
    for s in device_series:
        labels = dict(s.labels)
        assert labels["UUID"] in uuids and labels["gpu"] and labels["Hostname"] == NODE, s
    success = [s for s in snap.samples if s.name == "gpurelay_collector_success"]
    assert {dict(s.labels)["collector"]: s.value for s in success}["device"] == 1.0
    text = render_text(snap).decode()
    parsed = [x for f in text_string_to_metric_families(text) for x in f.samples]
    assert len(parsed) == len(snap.samples)  # every sample read back (counter names aside)
    names = {x.name for x in parsed}
    assert {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_GPU_TEMP"} <= names


def value(snap: Snapshot, name: str, **labels: str) -> float | None:
    for s in snap.samples:
        if s.name == name and all(dict(s.labels).get(k) == v for k, v in labels.items()):
            return s.value
    return None


@pytest.mark.parametrize("board", sorted(BOARDS))
def test_jetson_figures_are_the_boards_files_in_dcgms_units(board: str, tmp_path: Path) -> None:
    spec = BOARDS[board]
    snap = jetson_collector(tmp_path, board).collect()
    assert value(snap, "DCGM_FI_DEV_GPU_UTIL") == spec.gpu_load_per_mille / 10
    assert value(snap, "DCGM_FI_DEV_SM_CLOCK") == spec.gpu_hz[0] / 1_000_000
    (gpu_temp,) = [m for t, m in spec.zones if t.lower().startswith("gpu")]
    assert value(snap, "DCGM_FI_DEV_GPU_TEMP") == gpu_temp / 1000
    assert value(snap, "DCGM_FI_DEV_FB_TOTAL") == spec.mem_total_kb * 1024 // MIB
    assert value(snap, "DCGM_FI_DEV_FB_FREE") == spec.mem_available_kb * 1024 // MIB
    used_kb = spec.nvmap_used_kb  # else (r32) the total of nvmap's clients
    if used_kb is None:
        used_kb = sum(kb for *_, kb in spec.nvmap_clients)
    used = used_kb * 1024 // MIB
    assert value(snap, "DCGM_FI_DEV_FB_USED") == used
    total, free = spec.mem_total_kb * 1024 // MIB, spec.mem_available_kb * 1024 // MIB
    assert value(snap, "DCGM_FI_DEV_FB_RESERVED") == total - used - free  # held by the CPU
    rails = {label: (mv, ma) for *_, ch in spec.monitors for label, mv, ma in ch if label != "NC"}
    for rail, (mv, ma) in rails.items():
        assert value(snap, "gpurelay_jetson_rail_voltage_volts", rail=rail) == mv / 1000
        assert value(snap, "gpurelay_jetson_rail_current_amperes", rail=rail) == ma / 1000
    info = [dict(s.labels) for s in snap.samples if s.name == "gpurelay_jetson_board_info"]
    assert info[0]["model"] == spec.model and info[0]["soc"].startswith("tegra")
    gpu_rail = [(mv, ma) for r, (mv, ma) in rails.items() if r == "GPU"]  # Xavier's
    # Orin: no rail is the GPU alone (VDD_GPU_SOC, VDD_CPU_GPU_CV), so no power figure
    power = value(snap, "DCGM_FI_DEV_POWER_USAGE")
    assert power == (gpu_rail[0][0] * gpu_rail[0][1] // 1000 / 1000 if gpu_rail else None)
    modes = dict(spec.power_modes)
    mode = spec.default_mode if spec.pmode is None else spec.pmode
    (mode_labels,) = [dict(s.labels) for s in snap.samples if s.name.endswith("power_mode_info")]
    assert (mode_labels["mode_id"], mode_labels["mode"]) == (str(mode), modes[mode])
    assert mode_labels["source"] == ("default" if spec.pmode is None else "status")
    (gpu,) = snap.gpus
    tree_board = read_board(tmp_path / "proc", tmp_path / "etc")
    assert gpu.uuid == gpu_uuid(tree_board, NODE) and gpu.uuid.startswith("GPU-")
    assert gpu.memory_total_bytes == spec.mem_total_kb * 1024


def test_jetson_says_why_and_keeps_going_when_files_fail(tmp_path: Path) -> None:
    collection = jetson_collector(tmp_path, "jetson-orin")
    shutil.rmtree(tmp_path / "sys" / "kernel" / "debug")  # debugfs closed
    (tmp_path / "sys" / "devices" / "platform" / "17000000.ga10b" / "load").write_text("x\n")
    snap = collection.collect()
    unsupported = {
        dict(s.labels)["field"]: dict(s.labels)["reason"]
        for s in snap.samples
        if s.name == "gpurelay_agent_unsupported_field"
    }
    assert "not an integer" in unsupported["DCGM_FI_DEV_GPU_UTIL"]
    assert "absent" in unsupported["gpurelay_jetson_emc_clock_hertz"]
    assert value(snap, "DCGM_FI_DEV_SM_CLOCK") == 918.0  # the rest still read
    assert value(snap, "DCGM_FI_DEV_GPU_UTIL") is None


def test_without_any_nvmap_figure_the_gpus_memory_is_unknown_not_0(tmp_path: Path) -> None:
    """r32 (no NvMapMemUsed) with debugfs closed: FB_USED and FB_RESERVED are left out,
    and BIE, whose format cannot say "unknown", leaves the GPU out instead of a 0."""
    collection = jetson_collector(tmp_path, "jetson-xavier")
    shutil.rmtree(tmp_path / "sys" / "kernel" / "debug")
    snap = collection.collect()
    assert value(snap, "DCGM_FI_DEV_FB_USED") is None
    assert value(snap, "DCGM_FI_DEV_FB_RESERVED") is None
    assert value(snap, "DCGM_FI_DEV_FB_TOTAL") == BIE_XAVIER_TOTAL_MIB
    assert collect_document(NODE, snap.gpus)[NODE]["deviceNum"] == 0


BIE_XAVIER_TOTAL_MIB = BOARDS["jetson-xavier"].mem_total_kb * 1024 // MIB


def test_a_board_without_a_gpu_node_is_unhealthy_not_a_crash(tmp_path: Path) -> None:
    collection = jetson_collector(tmp_path, "jetson-orin-nano")
    (tmp_path / "sys" / "class" / "devfreq" / "17000000.gpu" / "device").unlink()
    device = JetsonDeviceCollector(
        sys_root=tmp_path / "sys", proc_root=tmp_path / "proc", etc_root=tmp_path / "etc", node=NODE
    )
    snap = Collector(node=NODE, backend="jetson", device=device, process=None).collect()
    (gpu,) = snap.gpus
    assert not gpu.healthy
    assert value(snap, "gpurelay_agent_gpu_healthy", gpu="0") == 0
    assert value(snap, "DCGM_FI_DEV_GPU_TEMP") is not None  # thermal zones still read
    collection.close()
