"""The Jetson's device collector: the readers' figures as series, behind the same seam as
NVML's (:class:`edge_agent.collect.DeviceSource`).

Under DCGM's names, where the meaning is the same (docs/jetson.md):

- ``DCGM_FI_DEV_GPU_UTIL`` (%): the GPU's devfreq load, per mille / 10;
- ``DCGM_FI_DEV_SM_CLOCK`` (MHz): the GPU's devfreq clock (the SMs run on it);
- ``DCGM_FI_DEV_GPU_TEMP`` (°C): the ``gpu`` thermal zone;
- ``DCGM_FI_DEV_FB_USED``, ``_FREE``, ``_TOTAL`` (MiB, rounded down as DCGM does): the
  GPU has no framebuffer of its own, so these are nvmap's memory in use
  (``NvMapMemUsed``), ``MemAvailable`` and ``MemTotal``.

What has no DCGM field, as ``gpurelay_jetson_*``: the memory controller's clock and busy
share, every thermal zone, every power rail (V, A, W), and the board (model, module, SoC,
L4T release, JetPack). ``DCGM_FI_DEV_POWER_USAGE`` is left out: no rail measures the
GPU alone (AGX Orin's ``VDD_GPU_SOC`` includes the SoC).

The GPU's labels are NVML's: ``gpu`` 0, ``UUID`` derived from the module's serial number
(``GPU-`` + a UUID 5 of it; of the node name where the device tree has none: the kernel
gives the integrated GPU no UUID), ``device`` ``nvgpu``, ``modelName`` the module, and
the driver label the L4T release.
"""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path
from typing import Final

from edge_agent.degraded import Degraded
from edge_agent.jetson.board import Board, read_board
from edge_agent.jetson.files import Missing
from edge_agent.jetson.gpu import GpuNode, find_gpu, read_emc, read_gpu
from edge_agent.jetson.memory import read_memory
from edge_agent.jetson.rails import read_rails
from edge_agent.jetson.thermal import read_zones
from gpurelay.families import known
from gpurelay.model import MIB, Family, GpuInventory, Labels, SampleSink

UTIL, CLOCK, TEMP = "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_GPU_TEMP"
FB_USED, FB_FREE, FB_TOTAL = "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_TOTAL"
BOARD = "gpurelay_jetson_board_info"
EMC_CLOCK, EMC_UTIL = "gpurelay_jetson_emc_clock_hertz", "gpurelay_jetson_emc_utilization_ratio"
ZONE = "gpurelay_jetson_temperature_celsius"
VOLTS, AMPS, WATTS = (
    "gpurelay_jetson_rail_voltage_volts",
    "gpurelay_jetson_rail_current_amperes",
    "gpurelay_jetson_rail_power_watts",
)


def _family(name: str) -> Family:
    family = known(name)
    assert family is not None, f"{name} is not in gpurelay/data/families.csv"
    return family


NAMES: Final = (UTIL, CLOCK, TEMP, FB_USED, FB_FREE, FB_TOTAL, BOARD, EMC_CLOCK, EMC_UTIL)
NAMES_OF_SEVERAL: Final = (ZONE, VOLTS, AMPS, WATTS)  # one series per zone or rail
FAMILIES: Final[tuple[Family, ...]] = tuple(_family(n) for n in (*NAMES, *NAMES_OF_SEVERAL))
_UUID_NAMESPACE: Final = uuid.UUID("9c1ae1c2-6f1c-5b4a-9a3e-6a65747369ff")  # ours, fixed


def gpu_uuid(board: Board, node: str) -> str:
    """The integrated GPU's UUID label: stable for the module (its serial number), or for
    the node where the device tree has no serial."""
    key = f"serial:{board.serial}" if board.serial else f"node:{node}"
    return f"GPU-{uuid.uuid5(_UUID_NAMESPACE, key)}"


class JetsonDeviceCollector:
    """Reads the board's kernel files each pass; never raises for a file that is absent,
    unreadable or offline: that series is left out and said so
    (:meth:`report_unsupported`)."""

    def __init__(
        self,
        *,
        sys_root: Path,
        proc_root: Path,
        etc_root: Path,
        node: str,
        node_label: str = "Hostname",
        driver_label: str = "DCGM_FI_DRIVER_VERSION",
    ) -> None:
        self._sys, self._proc = sys_root, proc_root
        self.degraded = Degraded()
        self.errors: Counter[tuple[str, str]] = Counter()
        self.board = read_board(proc_root, etc_root)
        self._gpu: GpuNode | Missing = find_gpu(sys_root)
        self._uuid = gpu_uuid(self.board, node)
        self._labels: Labels = (
            ("gpu", "0"),
            ("UUID", self._uuid),
            ("device", "nvgpu"),
            ("modelName", self.board.module_name),
            (node_label, node),
            ("NodeName", node),
            (driver_label, self.board.l4t),
        )
        self._unsupported: dict[str, str] = {}

    def collect(self, sink: SampleSink) -> list[GpuInventory]:
        for family in FAMILIES:
            sink.declare(family)
        published: set[str] = set()
        why: dict[str, str] = {}

        def add(name: str, value: float | None, extra: Labels = (), reason: str = "") -> None:
            if value is None:
                why.setdefault(name, reason or "not readable on this board")
                return
            sink.add(name, (*self._labels, *extra), float(value))
            published.add(name)

        b = self.board
        info = (("model", b.model), ("module", b.module), ("soc", b.soc))
        add(BOARD, 1.0, (*info, ("l4t", b.l4t), ("jetpack", b.jetpack)))
        healthy = not isinstance(self._gpu, Missing)
        if isinstance(self._gpu, Missing):
            for name in (UTIL, CLOCK):
                add(name, None, reason=f"no GPU devfreq node ({self._gpu})")
        else:
            g = read_gpu(self._gpu)
            first = str(g.missing[0]) if g.missing else ""
            per_mille = g.load_per_mille
            add(UTIL, None if per_mille is None else per_mille / 10, reason=first)
            hz = g.frequency_hz
            add(CLOCK, None if hz is None else hz / 1_000_000, reason=first)
        zones = read_zones(self._sys)
        gpu_zone = zones.by_kind("gpu")
        add(TEMP, None if gpu_zone is None else gpu_zone.celsius, reason="no online gpu zone")
        for z in zones.zones:
            add(ZONE, z.celsius, (("zone", z.type),), reason="every zone offline")
        mem = read_memory(self._proc)
        reason = str(mem.missing[0]) if mem.missing else ""
        for name, value in (
            (FB_USED, mem.gpu_bytes),
            (FB_FREE, mem.available_bytes),
            (FB_TOTAL, mem.total_bytes),
        ):
            add(name, None if value is None else value // MIB, reason=reason)
        emc = read_emc(self._sys)
        reason = "; ".join(m.reason for m in emc.missing)
        add(EMC_CLOCK, emc.frequency_hz, reason=reason)
        add(EMC_UTIL, emc.load, reason=reason)
        rails = read_rails(self._sys)
        reason = str(rails.missing[0]) if rails.missing else "no INA3221 or INA238 monitor"
        for r in rails.rails:
            own = (("rail", r.name),)
            add(VOLTS, None if r.millivolts is None else r.millivolts / 1000, own, reason)
            add(AMPS, None if r.milliamps is None else r.milliamps / 1000, own, reason)
            add(WATTS, None if r.milliwatts is None else r.milliwatts / 1000, own, reason)
        if not rails.rails:
            for name in (VOLTS, AMPS, WATTS):
                add(name, None, reason=reason)
        self._unsupported = {n: r for n, r in why.items() if n not in published}
        return [
            GpuInventory(
                index=0,
                uuid=self._uuid,
                name=b.module_name,
                pci_bus_id="",
                minor=0,
                memory_total_bytes=mem.total_bytes or 0,
                memory_used_bytes=mem.gpu_bytes or 0,
                healthy=healthy,
            )
        ]

    def report_unsupported(self) -> dict[str, str]:
        return dict(self._unsupported)

    def close(self) -> None:
        """Nothing held open: every pass reads the files anew."""
