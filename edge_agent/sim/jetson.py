"""Fake Jetson boards: the sysfs, procfs and /etc files an L4T board has, as a tree.

Each board is written from the documented paths (docs/jetson.md) with sample values of
that board: its GPU's devfreq node and device-tree name, its thermal zones' types, its
power monitors' rails, its meminfo and nvmap clients, its model and L4T release. SIMULATED:
the values are typical of the board, not read from one. Used by the tests of
:mod:`edge_agent.jetson` and, next, by ``--simulate jetson-orin``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from edge_agent.jetson.files import JetsonRoots

MIB_KB = 1024  # kB per MiB, as /proc/meminfo counts


@dataclass(frozen=True, slots=True, kw_only=True)
class BoardSpec:
    model: str
    compatible: tuple[str, ...]
    release: str  # the first line of /etc/nv_tegra_release
    gpu_devfreq: str  # the devfreq node (17000000.ga10b, ...)
    gpu_of_node: str  # its device-tree node's name
    gpu_hz: tuple[int, int, int]  # cur, min, max
    gpu_load_per_mille: int
    zones: tuple[tuple[str, int], ...]  # (type, millidegrees)
    # (i2c device, driver name, iio (r32) or hwmon, ((label, mV, mA), ...))
    monitors: tuple[tuple[str, str, bool, tuple[tuple[str, int, int], ...]], ...]
    mem_total_kb: int
    mem_available_kb: int
    nvmap_used_kb: int | None  # None: a kernel without NvMapMemUsed
    nvmap_clients: tuple[tuple[str, str, int, int], ...] = field(
        default=()
    )  # client, comm, pid, kB
    emc_hz: int = 0
    emc_mc_all: int | None = None
    emc_actmon: str = "actmon_avg_activity"  # r35; r36: debug/cactmon
    # nvpmodel.conf's modes (id, name) and boot default; the mode nvpmodel -m last set
    # (/var/lib/nvpmodel/status), None where it was never run (the default is in force)
    power_modes: tuple[tuple[int, str], ...] = ()
    default_mode: int = 0
    pmode: int | None = None
    nvpmodel_link: bool = True  # /etc/nvpmodel.conf a symlink to /etc/nvpmodel/<board>.conf


BOARDS: dict[str, BoardSpec] = {
    # AGX Orin 64GB, JetPack 5.1.2: two INA3221 with an unconnected channel each
    "jetson-orin": BoardSpec(
        model="NVIDIA Jetson AGX Orin Developer Kit",
        compatible=("nvidia,p3737-0000+p3701-0005", "nvidia,p3701-0005", "nvidia,tegra234"),
        release=(
            "# R35 (release), REVISION: 4.1, GCID: 33958178, BOARD: t186ref"
            ", EABI: aarch64, DATE: Tue Aug  1 19:57:35 UTC 2023"
        ),
        gpu_devfreq="17000000.ga10b",
        gpu_of_node="ga10b",
        gpu_hz=(918_000_000, 306_000_000, 1_300_500_000),
        gpu_load_per_mille=437,
        zones=(
            ("CPU-therm", 48_593),
            ("GPU-therm", 47_218),
            ("CV0-therm", -256_000),  # a powered-down DLA/PVA block
            ("SOC0-therm", 45_843),
            ("SOC1-therm", 46_062),
            ("SOC2-therm", 45_500),
            ("tj-therm", 48_593),
            ("Tboard_tegra", 36_000),
        ),
        monitors=(
            (
                "1-0040",
                "ina3221",
                False,
                (
                    ("VDD_GPU_SOC", 4_992, 1_288),
                    ("VDD_CPU_CV", 4_992, 608),
                    ("VIN_SYS_5V0", 5_008, 944),
                ),
            ),
            (
                "1-0041",
                "ina3221",
                False,
                (("NC", 0, 0), ("VDDQ_VDD2_1V8AO", 4_992, 80), ("NC", 0, 0)),
            ),
        ),
        mem_total_kb=64_335_836,
        mem_available_kb=58_117_224,
        nvmap_used_kb=2_204_672,
        nvmap_clients=(
            ("user", "python3", 4242, 1_843_200),
            ("user", "deepstream-app", 4377, 356_352),
            ("kernel", "kernel", 0, 5_120),
        ),
        emc_hz=3_199_000_000,
        emc_mc_all=63_980_000,  # 20 % of 3199 MHz, as tegrastats computes it
        power_modes=((0, "MAXN"), (1, "MODE_15W"), (2, "MODE_30W"), (3, "MODE_50W")),
        default_mode=2,
        pmode=0,
    ),
    # Orin Nano 8GB developer kit, JetPack 6.2: lower-case zones, VDD_IN on the monitor
    "jetson-orin-nano": BoardSpec(
        model="NVIDIA Jetson Orin Nano Developer Kit",
        compatible=("nvidia,p3768-0000+p3767-0005", "nvidia,p3767-0005", "nvidia,tegra234"),
        release=(
            "# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic"
            ", EABI: aarch64, DATE: Wed Jan  8 01:49:37 UTC 2025"
        ),
        gpu_devfreq="17000000.gpu",
        gpu_of_node="gpu",
        gpu_hz=(624_750_000, 306_000_000, 624_750_000),
        gpu_load_per_mille=991,
        zones=(
            ("cpu-thermal", 51_250),
            ("gpu-thermal", 50_937),
            ("cv0-thermal", -256_000),
            ("soc0-thermal", 49_875),
            ("tj-thermal", 51_250),
        ),
        monitors=(
            (
                "1-0040",
                "ina3221",
                False,
                (("VDD_IN", 5_048, 1_464), ("VDD_CPU_GPU_CV", 5_048, 560), ("VDD_SOC", 5_048, 392)),
            ),
        ),
        mem_total_kb=7_802_032,
        mem_available_kb=5_120_116,
        nvmap_used_kb=1_048_576,
        nvmap_clients=(("user", "trtexec", 1312, 1_024_000),),
        emc_hz=2_133_000_000,
        emc_mc_all=74_655_000,  # 35 %
        emc_actmon="debug/cactmon",
        power_modes=((0, "15W"), (1, "25W"), (2, "MAXN_SUPER"), (3, "7W")),
        default_mode=0,
    ),
    # AGX Xavier 32GB, JetPack 4.6.4: the r32 iio driver, upper-case zones with PMIC-Die
    "jetson-xavier": BoardSpec(
        model="NVIDIA Jetson AGX Xavier Developer Kit",
        compatible=("nvidia,p2972-0000", "nvidia,galen", "nvidia,tegra194"),
        release=(
            "# R32 (release), REVISION: 7.4, GCID: 33514132, BOARD: t186ref"
            ", EABI: aarch64, DATE: Fri Jun  9 04:25:08 UTC 2023"
        ),
        gpu_devfreq="17000000.gv11b",
        gpu_of_node="gv11b",
        gpu_hz=(1_377_000_000, 114_750_000, 1_377_000_000),
        gpu_load_per_mille=118,
        zones=(
            ("AO-therm", 37_000),
            ("CPU-therm", 39_500),
            ("GPU-therm", 38_500),
            ("PMIC-Die", 100_000),
            ("Tboard_tegra", 35_000),
            ("Tdiode_tegra", 37_750),
        ),
        monitors=(
            (
                "1-0040",
                "ina3221x",
                True,
                (("GPU", 19_024, 152), ("CPU", 19_032, 128), ("SOC", 19_032, 96)),
            ),
            (
                "1-0041",
                "ina3221x",
                True,
                (("CV", 19_032, 0), ("VDDRQ", 19_032, 48), ("SYS5V", 4_968, 584)),
            ),
        ),
        mem_total_kb=32_538_116,
        mem_available_kb=30_977_900,
        nvmap_used_kb=None,  # r32: the GPU's memory is nvmap's clients' total
        nvmap_clients=(
            ("user", "detectnet", 2876, 412_672),
            ("user", "gst-launch-1.0", 2911, 96_256),
            ("kernel", "kernel", 0, 3_072),
        ),
        emc_hz=2_133_000_000,
        emc_mc_all=2_133_000,  # 1 %
        power_modes=((0, "MAXN"), (1, "MODE_10W"), (2, "MODE_15W"), (3, "MODE_30W_ALL")),
        default_mode=2,
        pmode=3,
        nvpmodel_link=False,  # r32: a plain file
    ),
}


JetsonTree = JetsonRoots  # what build() writes


def client_pids(board: str) -> tuple[int, ...]:
    """The PIDs of the board's nvmap clients (not the kernel's, pid 0)."""
    return tuple(pid for _, _, pid, _ in BOARDS[board].nvmap_clients if pid)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def build(root: Path, board: str) -> JetsonTree:
    """The tree of ``board`` (a key of :data:`BOARDS`) under ``root``."""
    spec = BOARDS[board]
    sys_root, proc_root, etc_root = root / "sys", root / "proc", root / "etc"
    var_root = root / "var"
    _write(root / "README", f"SIMULATED {board}: a fake L4T sysfs/procfs tree, not a board.\n")
    # The device tree is the firmware's; /proc/device-tree is an absolute symlink to it,
    # dangling here as on a host whose / is mounted elsewhere (a pod's /host)
    dt = sys_root / "firmware" / "devicetree" / "base"
    proc_root.mkdir(parents=True, exist_ok=True)
    (proc_root / "device-tree").symlink_to("/sys/firmware/devicetree/base")
    _write(dt / "model", spec.model + "\x00")
    serial = int(hashlib.sha256(board.encode()).hexdigest(), 16) % 10**11
    _write(dt / "serial-number", f"14{serial:011d}\x00")
    _write(dt / "compatible", "".join(c + "\x00" for c in spec.compatible))
    _write(etc_root / "nv_tegra_release", spec.release + "\n# KERNEL_VARIANT: oot\n")
    # The GPU: a platform device, and its devfreq node in /sys/class/devfreq
    device = sys_root / "devices" / "platform" / spec.gpu_devfreq
    _write(device / "of_node" / "name", spec.gpu_of_node + "\x00")
    _write(device / "load", f"{spec.gpu_load_per_mille}\n")
    _write(device / "railgate_enable", "1\n")
    node = sys_root / "class" / "devfreq" / spec.gpu_devfreq
    node.mkdir(parents=True)
    (node / "device").symlink_to(device)
    cur, low, high = spec.gpu_hz
    for name, value in (("cur_freq", cur), ("min_freq", low), ("max_freq", high)):
        _write(node / name, f"{value}\n")
    _write(node / "governor", "nvhost_podgov\n")
    # Thermal zones
    for i, (kind, millideg) in enumerate(spec.zones):
        zone = sys_root / "class" / "thermal" / f"thermal_zone{i}"
        _write(zone / "type", kind + "\n")
        _write(zone / "temp", f"{millideg}\n")
    _monitors(sys_root, spec)
    # Memory
    lines = [
        f"MemTotal:       {spec.mem_total_kb} kB",
        f"MemFree:        {spec.mem_available_kb - 400_000} kB",
        f"MemAvailable:   {spec.mem_available_kb} kB",
        "Buffers:           30120 kB",
    ]
    if spec.nvmap_used_kb is not None:
        lines += ["NvMapMemFree:      94784 kB", f"NvMapMemUsed:   {spec.nvmap_used_kb} kB"]
    _write(proc_root / "meminfo", "\n".join(lines) + "\n")
    if spec.nvmap_clients:
        rows = [f"{'CLIENT':<18} {'PROCESS':>18} {'PID':>8} {'SIZE':>11}"]
        rows += [
            f"{c:<18} {comm:>18} {pid:>8} {kb:>10}K" for c, comm, pid, kb in spec.nvmap_clients
        ]
        rows.append(f"{'total':<18} {'':>18} {'':>8} {sum(k for *_, k in spec.nvmap_clients):>10}K")
        _write(
            sys_root / "kernel" / "debug" / "nvmap" / "iovmm" / "clients", "\n".join(rows) + "\n"
        )
    # EMC
    if spec.emc_hz:
        _write(
            sys_root / "kernel" / "debug" / "bpmp" / "debug" / "clk" / "emc" / "rate",
            f"{spec.emc_hz}\n",
        )
    if spec.emc_mc_all is not None:
        _write(sys_root / "kernel" / spec.emc_actmon / "mc_all", f"{spec.emc_mc_all}\n")
    _nvpmodel(etc_root, var_root, spec)
    return JetsonRoots(sys_root, proc_root, etc_root, var_root)


def _monitors(sys_root: Path, spec: BoardSpec) -> None:
    """The INA3221 power monitors: hwmon (r34 and later) or iio (r32)."""
    for address, driver, iio, channels in spec.monitors:
        dev = sys_root / "bus" / "i2c" / "devices" / address
        _write(dev / "name", driver + "\n")
        if iio:
            base = dev / "iio:device0"
            for c, (label, mv, ma) in enumerate(channels):
                _write(base / f"rail_name_{c}", label + "\n")
                _write(base / f"in_voltage{c}_input", f"{mv}\n")
                _write(base / f"in_current{c}_input", f"{ma}\n")
                _write(base / f"in_power{c}_input", f"{mv * ma // 1000}\n")
        else:
            base = dev / "hwmon" / f"hwmon{int(address[-1]) + 1}"
            for c, (label, mv, ma) in enumerate(channels, start=1):
                _write(base / f"in{c}_label", label + "\n")
                _write(base / f"in{c}_input", f"{mv}\n")
                _write(base / f"curr{c}_input", f"{ma}\n")
            _write(base / "in7_label", "sum of shunt voltages\n")
            _write(base / "in7_input", "40\n")


def _nvpmodel(etc_root: Path, var_root: Path, spec: BoardSpec) -> None:
    """nvpmodel.conf (its modes and boot default) and the mode nvpmodel -m last set."""
    if spec.power_modes:
        modes = [
            f"< POWER_MODEL ID={i} NAME={name} >\nCPU_ONLINE CORE_0 1\n"
            for i, name in spec.power_modes
        ]
        conf = (
            "< PARAM TYPE=FILE NAME=CPU_ONLINE >\n\n"
            + "\n".join(modes)
            + f"\n< PM_CONFIG DEFAULT={spec.default_mode} >\n"
        )
        if spec.nvpmodel_link:  # JetPack 5 and 6: the board's file, linked absolutely
            own = f"nvpmodel/nvpmodel_{spec.compatible[1].split(',')[1]}.conf"
            _write(etc_root / own, conf)
            (etc_root / "nvpmodel.conf").symlink_to(f"/etc/{own}")
        else:
            _write(etc_root / "nvpmodel.conf", conf)
    if spec.pmode is not None:
        _write(var_root / "lib" / "nvpmodel" / "status", f"pmode:{spec.pmode:04d} fmode:quiet\n")
