"""The source values of a simulated Jetson for the truth test: what the board's files say.

A Jetson's agent reads its kernel's files (:mod:`edge_agent.jetson`); the fake board
(:mod:`edge_agent.sim.jetson`) writes them from a :class:`~edge_agent.sim.jetson.BoardSpec`.
This module turns that spec into the figures a user must read, in DCGM's units, by the
rules of docs/jetson.md, without the agent's readers: load per mille / 10 = %, Hz / 10^6
= MHz, millidegrees / 1000, kB x 1024 / 2^20 rounded down = MiB (as DCGM's FB fields), mV
x mA = µW (the INA3221's hwmon; r32's iio gives mW).
"""

from __future__ import annotations

from collections.abc import Mapping

from edge_agent.sim.jetson import BOARDS, BoardSpec
from gpurelay.naming import by_old
from tests.integration.truth_source import MIB, WHOLE, Device, NodeTruth, Process

GPU_RAILS = ("GPU", "VDD_GPU", "VDD_SYS_GPU", "POM_5V_GPU")  # a rail that measures the GPU alone


def read_board_truth(
    board: str,
    *,
    node: str,
    uuid: str,
    pods: Mapping[int, tuple[str, str, str]],
    naming: str = "4.8",
) -> NodeTruth:
    """``uuid``: the agent's label for the board's GPU (an identity the test checks is
    stable, not a figure); ``naming``: dcgm-exporter's scheme the agent publishes (4.9:
    the fields' 4.9 names, each figure from the source's integers in 4.9's unit)."""
    spec = BOARDS[board]
    kib = 1024
    fields: dict[str, float] = {
        "DCGM_FI_DEV_GPU_UTIL": spec.gpu_load_per_mille / 10,
        "DCGM_FI_DEV_SM_CLOCK": spec.gpu_hz[0] / 1_000_000,
        "DCGM_FI_DEV_FB_TOTAL": float(spec.mem_total_kb * kib // MIB),
        "DCGM_FI_DEV_FB_FREE": float(spec.mem_available_kb * kib // MIB),
    }
    (gpu_temp,) = [m for kind, m in spec.zones if kind.lower().startswith("gpu")]
    fields["DCGM_FI_DEV_GPU_TEMP"] = gpu_temp / 1000
    # NvMapMemUsed, else (r32) the total line of nvmap's clients
    used_kb = spec.nvmap_used_kb
    if used_kb is None and spec.nvmap_clients:
        used_kb = sum(kb for *_, kb in spec.nvmap_clients)
    if used_kb is not None:
        used_mib = used_kb * kib // MIB
        fields["DCGM_FI_DEV_FB_USED"] = float(used_mib)
        # what neither the GPU holds nor is available to it (docs/jetson.md)
        fields["DCGM_FI_DEV_FB_RESERVED"] = (
            fields["DCGM_FI_DEV_FB_TOTAL"] - used_mib - fields["DCGM_FI_DEV_FB_FREE"]
        )
    extra: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for kind, millideg in spec.zones:
        if millideg != -256_000 and not kind.startswith("PMIC"):  # offline; the PMIC's
            extra[("gpurelay_jetson_temperature_celsius", (("zone", kind),))] = millideg / 1000
    for _, _, iio, channels in spec.monitors:
        for rail, mv, ma in channels:
            if rail == "NC":
                continue
            own = (("rail", rail),)
            uw = mv * ma // 1000 * 1000 if iio else mv * ma  # iio: the driver's mW
            extra[("gpurelay_jetson_rail_voltage_volts", own)] = mv / 1000
            extra[("gpurelay_jetson_rail_current_amperes", own)] = ma / 1000
            extra[("gpurelay_jetson_rail_power_watts", own)] = uw / 1_000_000
            if rail in GPU_RAILS:
                fields["DCGM_FI_DEV_POWER_USAGE"] = uw / 1_000_000
    if spec.emc_hz:
        extra[("gpurelay_jetson_emc_clock_hertz", ())] = float(spec.emc_hz)
        if spec.emc_mc_all is not None:  # actmon's count per ms of the EMC's kHz
            extra[("gpurelay_jetson_emc_utilization_ratio", ())] = spec.emc_mc_all / (
                spec.emc_hz / 1000 * 100
            )
    used = 0 if used_kb is None else used_kb * kib
    total = 0 if used_kb is None else spec.mem_total_kb * kib  # BIE: not known, left out
    device = Device("0", WHOLE, uuid, "", fields, (used, total))
    processes = {
        pid: Process(pid, "0", WHOLE, uuid, kb * kib / MIB, None, pods.get(pid))
        for _, _, pid, kb in spec.nvmap_clients
        if pid
    }
    if naming == "4.9":
        device = Device("0", WHOLE, uuid, "", _as49(spec, fields, used_kb), device.memory_bytes)
    modes = dict(spec.power_modes)
    mode, source = (spec.default_mode, "default") if spec.pmode is None else (spec.pmode, "status")
    return NodeTruth(
        node,
        board,
        1,
        {("0", WHOLE): device},
        processes,
        "simulated-jetson",
        extra,
        ((str(mode), modes.get(mode, ""), source),) if spec.power_modes else (),
    )


def _as49(spec: BoardSpec, fields: dict[str, float], used_kb: int | None) -> dict[str, float]:
    """4.9's names (docs/migration.md) and units, from the spec's integers."""
    kib = 1024
    exact: dict[str, float] = {
        "DCGM_FI_DEV_GPU_UTIL": spec.gpu_load_per_mille / 1000,
        "DCGM_FI_DEV_SM_CLOCK": float(spec.gpu_hz[0]),
        "DCGM_FI_DEV_FB_TOTAL": float(spec.mem_total_kb * kib),
        "DCGM_FI_DEV_FB_FREE": float(spec.mem_available_kb * kib),
    }
    if used_kb is not None:
        exact["DCGM_FI_DEV_FB_USED"] = float(used_kb * kib)
        exact["DCGM_FI_DEV_FB_RESERVED"] = float(
            (spec.mem_total_kb - used_kb - spec.mem_available_kb) * kib
        )
    return {by_old()[name].new: exact.get(name, value) for name, value in fields.items()}
