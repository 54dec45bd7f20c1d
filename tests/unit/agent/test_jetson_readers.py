"""The Jetson readers (issue 28) on fake board trees (edge_agent.sim.jetson), and the ways
a real board fails them: debugfs closed, a rail missing, a zone unreadable or offline,
a board the agent does not know.

Each expected value is the board's sample file content turned into the unit by hand here
(per mille / 1000, mV x mA / 1000, millidegrees / 1000, kB x 1024), not by the readers.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from edge_agent.jetson.board import parse_release, read_board
from edge_agent.jetson.files import Missing, rooted
from edge_agent.jetson.gpu import find_gpu, read_emc, read_gpu
from edge_agent.jetson.memory import read_memory, read_nvmap_clients, read_nvmap_total
from edge_agent.jetson.rails import read_rails
from edge_agent.jetson.thermal import read_zones
from edge_agent.sim.jetson import BOARDS, JetsonTree, build


@pytest.fixture(params=sorted(BOARDS))
def board(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, JetsonTree]:
    return request.param, build(tmp_path, request.param)


def test_every_board_is_read_whole(board: tuple[str, JetsonTree]) -> None:
    name, tree = board
    spec = BOARDS[name]
    b = read_board(tree.proc_root, tree.etc_root)
    assert b.known and not b.missing and b.model == spec.model
    gpu = find_gpu(tree.sys_root)
    assert not isinstance(gpu, Missing)
    assert gpu.name == spec.gpu_of_node and gpu.devfreq.name == spec.gpu_devfreq
    g = read_gpu(gpu)
    assert not g.missing
    assert g.load == spec.gpu_load_per_mille / 1000
    assert (g.frequency_hz, g.min_hz, g.max_hz) == spec.gpu_hz
    zones = read_zones(tree.sys_root)
    shown = {z.type for z in zones.zones}
    assert shown == {t for t, _ in spec.zones if not t.startswith("PMIC")}
    for z in zones.zones:
        (raw,) = [m for t, m in spec.zones if t == z.type]
        assert z.celsius == (None if raw == -256_000 else raw / 1000), z
    rails = read_rails(tree.sys_root)
    want = {
        label: (mv, ma)
        for *_, channels in spec.monitors
        for label, mv, ma in channels
        if label != "NC"
    }
    assert {r.name: (r.millivolts, r.milliamps) for r in rails.rails} == want
    assert not rails.missing


def test_orin_agx_jetpack5(tmp_path: Path) -> None:
    tree = build(tmp_path, "jetson-orin")
    b = read_board(tree.proc_root, tree.etc_root)
    assert (b.soc, b.module, b.l4t, b.jetpack) == ("tegra234", "p3701-0005", "35.4.1", "5.1.2")
    assert b.module_name == "Jetson AGX Orin 64GB"
    rails = {r.name: r for r in read_rails(tree.sys_root).rails}
    assert set(rails) == {"VDD_GPU_SOC", "VDD_CPU_CV", "VIN_SYS_5V0", "VDDQ_VDD2_1V8AO"}
    assert rails["VDD_GPU_SOC"].microwatts == 4_992 * 1_288
    assert not any(r.is_input for r in rails.values())  # AGX Orin measures no VDD_IN
    zones = read_zones(tree.sys_root)
    assert zones.by_kind("gpu").celsius == 47.218  # type: ignore[union-attr]
    assert zones.by_kind("cv0").celsius is None  # type: ignore[union-attr]
    assert any("offline (-256000)" in m.reason for m in zones.missing)
    emc = read_emc(tree.sys_root)
    assert emc.frequency_hz == 3_199_000_000 and emc.load == pytest.approx(0.20)
    mem = read_memory(tree.proc_root)
    assert (mem.total_bytes, mem.gpu_bytes) == (64_335_836 * 1024, 2_204_672 * 1024)
    clients = read_nvmap_clients(tree.sys_root)
    assert clients == {4242: 1_843_200 * 1024, 4377: 356_352 * 1024}  # the kernel's pid 0 left out


def test_orin_nano_jetpack6(tmp_path: Path) -> None:
    tree = build(tmp_path, "jetson-orin-nano")
    b = read_board(tree.proc_root, tree.etc_root)
    assert (b.l4t, b.jetpack, b.module) == ("36.4.3", "6.2", "p3767-0005")
    assert read_gpu(find_gpu(tree.sys_root)).load == 0.991  # type: ignore[arg-type]
    rails = {r.name: r for r in read_rails(tree.sys_root).rails}
    assert rails["VDD_IN"].is_input and rails["VDD_IN"].microwatts == 5_048 * 1_464
    assert read_zones(tree.sys_root).by_kind("gpu").celsius == 50.937  # type: ignore[union-attr]
    emc = read_emc(tree.sys_root)  # JetPack 6: actmon moved to debugfs (cactmon)
    assert emc.load == pytest.approx(0.35)


def test_xavier_jetpack4_iio_rails_and_no_nvmap_meminfo(tmp_path: Path) -> None:
    tree = build(tmp_path, "jetson-xavier")
    b = read_board(tree.proc_root, tree.etc_root)
    assert (b.soc, b.l4t, b.jetpack, b.module) == ("tegra194", "32.7.4", "4.6.4", "")
    rails = {r.name: r for r in read_rails(tree.sys_root).rails}
    assert rails["SYS5V"].microwatts == 4_968 * 584 // 1000 * 1000  # the driver's own mW
    assert "PMIC-Die" not in {z.type for z in read_zones(tree.sys_root).zones}
    mem = read_memory(tree.proc_root)
    assert mem.gpu_bytes is None and any("NvMapMemUsed" in m.reason for m in mem.missing)


def test_debugfs_absent_leaves_out_process_memory_and_emc_clock(tmp_path: Path) -> None:
    tree = build(tmp_path, "jetson-orin")
    shutil.rmtree(tree.sys_root / "kernel" / "debug")  # not mounted, or not root
    clients = read_nvmap_clients(tree.sys_root)
    assert isinstance(clients, Missing) and clients.reason == "absent"
    emc = read_emc(tree.sys_root)
    assert emc.frequency_hz is None and emc.load is None
    assert read_memory(tree.proc_root).gpu_bytes == 2_204_672 * 1024  # meminfo still has it


def test_a_missing_rail_file_loses_that_figure_only(tmp_path: Path) -> None:
    tree = build(tmp_path, "jetson-orin")
    hwmon = tree.sys_root / "bus" / "i2c" / "devices" / "1-0040" / "hwmon" / "hwmon1"
    (hwmon / "curr1_input").unlink()
    rails = read_rails(tree.sys_root)
    gpu_soc = next(r for r in rails.rails if r.name == "VDD_GPU_SOC")
    assert (gpu_soc.millivolts, gpu_soc.milliamps, gpu_soc.microwatts) == (4_992, None, None)
    assert [str(m) for m in rails.missing] == [f"{hwmon / 'curr1_input'}: absent"]
    assert len(rails.rails) == 4


def test_an_unreadable_or_garbled_zone_is_offline_not_zero(tmp_path: Path) -> None:
    tree = build(tmp_path, "jetson-orin")
    zones_dir = tree.sys_root / "class" / "thermal"
    (zones_dir / "thermal_zone1" / "temp").unlink()
    (zones_dir / "thermal_zone1" / "temp").mkdir()  # what open() cannot read
    (zones_dir / "thermal_zone0" / "temp").write_text("\n")  # tj-thermal on p3767 reads empty
    zones = read_zones(tree.sys_root)
    assert zones.by_kind("gpu").celsius is None  # type: ignore[union-attr]
    assert zones.by_kind("cpu").celsius is None  # type: ignore[union-attr]
    reasons = {m.path.parent.name: m.reason for m in zones.missing}
    assert reasons["thermal_zone1"] == "a directory, not a file"
    assert reasons["thermal_zone0"].startswith("not an integer")
    assert zones.by_kind("soc0").celsius == 45.843  # type: ignore[union-attr]


def test_a_board_the_agent_does_not_know(tmp_path: Path) -> None:
    tree = build(tmp_path, "jetson-orin")
    dt = tree.sys_root / "firmware" / "devicetree" / "base"
    (dt / "compatible").write_bytes(b"nvidia,p9999-0000\x00nvidia,tegra999\x00")
    (tree.etc_root / "nv_tegra_release").write_text("something else\n")
    b = read_board(tree.proc_root, tree.etc_root)
    assert not b.known and b.soc == "tegra999" and b.l4t == "" and b.jetpack == ""
    assert b.module_name == b.model  # named by its model string
    assert any("not an L4T release line" in m.reason for m in b.missing)


def test_the_device_tree_through_proc_s_absolute_symlink(tmp_path: Path) -> None:
    """A kernel without /sys/firmware/devicetree, whose /proc/device-tree is an absolute
    symlink: followed under the host's root (a pod's /host), not the reader's own /."""
    tree = build(tmp_path, "jetson-orin-nano")
    firmware = tree.sys_root / "firmware" / "devicetree" / "base"
    firmware.rename(tmp_path / "dt-elsewhere")
    link = tree.proc_root / "device-tree"
    link.unlink()
    link.symlink_to("/dt-elsewhere")
    b = read_board(tree.proc_root, tree.etc_root, tree.sys_root)
    assert b.model == BOARDS["jetson-orin-nano"].model and b.soc == "tegra234" and b.serial
    assert not b.missing
    assert rooted(tmp_path, link / "model") == tmp_path / "dt-elsewhere" / "model"
    assert rooted(tmp_path, tmp_path / "no" / "such") == tmp_path / "no" / "such"
    loop = tmp_path / "loop"
    loop.symlink_to("/loop")  # a chain that never ends: the path as given
    assert rooted(tmp_path, loop) == loop


def test_a_garbled_nvmap_total_is_missing_not_a_crash(tmp_path: Path) -> None:
    tree = build(tmp_path, "jetson-xavier")  # r32: the GPU's memory is this total
    clients = tree.sys_root / "kernel" / "debug" / "nvmap" / "iovmm" / "clients"
    for garbled in ("total 1.5K", "total K", "total -5K"):
        clients.write_text(f"CLIENT PROCESS PID SIZE\nuser detectnet 2876 10K\n{garbled}\n")
        total = read_nvmap_total(tree.sys_root)
        assert isinstance(total, Missing) and "not <n>K" in total.reason, garbled
    clients.write_text("CLIENT PROCESS PID SIZE\n")
    assert read_nvmap_total(tree.sys_root) == Missing(clients, "no total line")


def test_no_gpu_node_says_why(tmp_path: Path) -> None:
    tree = build(tmp_path, "jetson-orin")
    node = tree.sys_root / "class" / "devfreq" / "17000000.ga10b"
    (node / "device").unlink()
    missing = find_gpu(tree.sys_root)
    assert isinstance(missing, Missing) and "no devfreq device" in missing.reason
    assert isinstance(find_gpu(tmp_path / "nowhere"), Missing)


def test_out_of_range_load_is_not_published(tmp_path: Path) -> None:
    tree = build(tmp_path, "jetson-orin")
    (tree.sys_root / "devices" / "platform" / "17000000.ga10b" / "load").write_text("4000\n")
    g = read_gpu(find_gpu(tree.sys_root))  # type: ignore[arg-type]
    assert g.load is None and "out of range" in g.missing[0].reason
    assert g.frequency_hz == 918_000_000


@pytest.mark.parametrize(
    ("line", "release"),
    [
        ("# R35 (release), REVISION: 4.1, GCID: 33958178, BOARD: t186ref", "35.4.1"),
        ("# R32 (release), REVISION: 5, GCID: 2, BOARD: t210ref", "32.5"),
        ("# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic", "36.4.3"),
        ("R35 4.1", ""),
    ],
)
def test_l4t_release_lines(line: str, release: str) -> None:
    assert parse_release(line) == release
