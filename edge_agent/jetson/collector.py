"""The Jetson's device collector: the readers' figures as series, behind the same seam as
NVML's (:class:`edge_agent.collect.DeviceSource`).

Under DCGM's names, where the meaning is the same (docs/jetson.md):

- ``DCGM_FI_DEV_GPU_UTIL`` (%): the GPU's devfreq load, per mille / 10;
- ``DCGM_FI_DEV_SM_CLOCK`` (MHz): the GPU's devfreq clock (the SMs run on it);
- ``DCGM_FI_DEV_GPU_TEMP`` (°C): the ``gpu`` thermal zone;
- ``DCGM_FI_DEV_FB_USED``, ``_FREE``, ``_TOTAL`` (MiB, rounded down as DCGM does): the
  GPU has no framebuffer of its own, so these are nvmap's memory in use
  (``NvMapMemUsed``), ``MemAvailable`` and ``MemTotal``; ``_RESERVED`` is what the GPU
  cannot have now, held by the CPU's processes and the kernel: total - used - free, in
  MiB, so that used + free + reserved = total as on a discrete GPU (the dashboards and
  the adapter's memory ratio add them up).

What has no DCGM field, as ``gpurelay_jetson_*``: the memory controller's clock and busy
share, every thermal zone, every power rail (V, A, W), and the board (model, module, SoC,
L4T release, JetPack) and its nvpmodel power mode. ``DCGM_FI_DEV_POWER_USAGE`` (W) only
where a rail measures the GPU alone (Xavier's ``GPU``, TX2's ``VDD_SYS_GPU``, Nano's
``POM_5V_GPU``); Orin has
none (AGX Orin's ``VDD_GPU_SOC`` includes the SoC, Orin Nano/NX's ``VDD_CPU_GPU_CV`` the
CPU and the vision engines), so it is left out there rather than over-stated.

With ``dcgm_naming = "4.9"`` the DCGM fields take dcgm-exporter 4.9's names and units
(docs/migration.md), each computed from the source's own integers, not converted from
4.8's figure: ``GPU_UTIL_RATIO`` = per mille / 1000, ``SM_CLOCK_HERTZ`` = Hz, and
``FB_*_BYTES`` / ``FB_CAPACITY_BYTES`` exact bytes.

The GPU's labels are NVML's: ``gpu`` 0, ``UUID`` derived from the module's serial number
(``GPU-`` + a UUID 5 of it; of the node name where the device tree has none: the kernel
gives the integrated GPU no UUID), ``device`` ``nvgpu``, ``modelName`` the module, and
the driver label the L4T release.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections import Counter
from pathlib import Path
from typing import Final

from edge_agent.degraded import Degraded
from edge_agent.jetson.board import Board, PowerMode, read_board, read_power_mode
from edge_agent.jetson.files import Missing
from edge_agent.jetson.gpu import GpuNode, find_gpu, read_emc, read_gpu
from edge_agent.jetson.memory import read_memory, read_nvmap_total
from edge_agent.jetson.rails import read_rails
from edge_agent.jetson.thermal import read_zones
from gpurelay.families import known
from gpurelay.model import MIB, Family, GpuInventory, Labels, SampleSink
from gpurelay.naming import DRIVER_LABEL, Naming, name_in

UTIL, CLOCK, TEMP = "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_GPU_TEMP"
FB_USED, FB_FREE, FB_TOTAL = "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_TOTAL"
FB_RESERVED = "DCGM_FI_DEV_FB_RESERVED"
POWER = "DCGM_FI_DEV_POWER_USAGE"
BOARD, MODE = "gpurelay_jetson_board_info", "gpurelay_jetson_power_mode_info"
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


DCGM_NAMES: Final = (UTIL, CLOCK, TEMP, POWER, FB_USED, FB_FREE, FB_RESERVED, FB_TOTAL)
NAMES: Final = (*DCGM_NAMES, BOARD, MODE, EMC_CLOCK, EMC_UTIL)
# The rails that measure the GPU alone, by board (rbonghi/jetson_stats, docs/jetson.md)
GPU_RAILS: Final = frozenset({"GPU", "VDD_GPU", "VDD_SYS_GPU", "POM_5V_GPU"})
NAMES_OF_SEVERAL: Final = (ZONE, VOLTS, AMPS, WATTS)  # one series per zone or rail


def families(naming: Naming) -> tuple[Family, ...]:
    """What the collector declares: DCGM's fields under ``naming``'s names."""
    return tuple(_family(name_in(n, naming)) for n in (*NAMES, *NAMES_OF_SEVERAL))


_UUID_NAMESPACE: Final = uuid.UUID("9c1ae1c2-6f1c-5b4a-9a3e-6a65747369ff")  # ours, fixed


def gpu_uuid(board: Board, node: str) -> str:
    """The integrated GPU's UUID label: stable for the module (its serial number), or for
    the node where the device tree has no serial."""
    key = f"serial:{board.serial}" if board.serial else f"node:{node}"
    return f"GPU-{uuid.uuid5(_UUID_NAMESPACE, key)}"


class _Pass:
    """One pass's samples, and why each family left out was left out."""

    def __init__(
        self, sink: SampleSink, labels: Labels, own_labels: Labels, naming: Naming
    ) -> None:
        self.sink, self.labels, self.own_labels = sink, labels, own_labels
        self.naming = naming
        self.published: set[str] = set()
        self.why: dict[str, str] = {}

    def dcgm(self, name: str, v48: float | None, v49: float | None, reason: str = "") -> None:
        """A DCGM field (its 4.8 name): 4.8's figure, or 4.9's name and exact figure."""
        if self.naming == "4.9":
            self.add(name_in(name, "4.9"), v49, reason=reason)
        else:
            self.add(name, v48, reason=reason)

    def add(self, name: str, value: float | None, extra: Labels = (), reason: str = "") -> None:
        if value is None:
            self.why.setdefault(name, reason or "not readable on this board")
            return
        base = self.own_labels if name.startswith("gpurelay_") else self.labels
        self.sink.add(name, (*base, *extra), float(value))
        self.published.add(name)


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
        var_root: Path | None = None,  # default: etc_root's sibling var/
        node: str,
        node_label: str = "Hostname",
        naming: Naming = "4.8",
    ) -> None:
        self._naming: Naming = naming
        self.families = families(naming)
        driver_label = DRIVER_LABEL[naming]
        self._sys, self._proc, self._etc = sys_root, proc_root, etc_root
        self._var = var_root if var_root is not None else etc_root.parent / "var"
        self.degraded = Degraded()
        self.errors: Counter[tuple[str, str]] = Counter()
        self.board = read_board(proc_root, etc_root, sys_root)
        self._gpu: GpuNode | Missing = find_gpu(sys_root)
        self.uuid = gpu_uuid(self.board, node)
        # DCGM's fields carry dcgm-exporter's labels; gpurelay_jetson_* the ones that
        # name the GPU and the node only, in snake_case as Prometheus asks of new names
        # (the board's model and release are gpurelay_jetson_board_info's)
        self._labels: Labels = (
            ("gpu", "0"),
            ("UUID", self.uuid),
            ("device", "nvgpu"),
            ("modelName", self.board.module_name),
            (node_label, node),
            ("NodeName", node),
            (driver_label, self.board.l4t),
        )
        self._own_labels: Labels = (("gpu", "0"), ("UUID", self.uuid), (node_label, node))
        self._unsupported: dict[str, str] = {}

    def collect(self, sink: SampleSink) -> list[GpuInventory]:
        for family in self.families:
            sink.declare(family)
        p = _Pass(sink, self._labels, self._own_labels, self._naming)
        self._board(p)
        healthy = self._gpu_series(p)
        zones = read_zones(self._sys)
        gpu_zone = zones.by_kind("gpu")
        celsius = None if gpu_zone is None else gpu_zone.celsius
        p.dcgm(TEMP, celsius, celsius, reason="no online gpu zone")
        for z in zones.zones:
            p.add(ZONE, z.celsius, (("zone", z.type),), reason="every zone offline")
        mem = read_memory(self._proc)
        reason = str(mem.missing[0]) if mem.missing else ""
        if mem.gpu_bytes is None:  # an older kernel: nvmap's own total, where readable
            nvmap = read_nvmap_total(self._sys)
            if isinstance(nvmap, Missing):
                reason = f"{reason}; {nvmap}"
            else:
                mem = dataclasses.replace(mem, gpu_bytes=nvmap)
        exact = {FB_USED: mem.gpu_bytes, FB_FREE: mem.available_bytes, FB_TOTAL: mem.total_bytes}
        used, free, total = exact[FB_USED], exact[FB_FREE], exact[FB_TOTAL]
        if used is not None and free is not None and total is not None:
            # in whole MiB too, so that 4.8's used + free + reserved = total exactly
            reserved_mib = max(total // MIB - used // MIB - free // MIB, 0)
            p.dcgm(FB_RESERVED, reserved_mib, max(total - used - free, 0))
        else:
            p.dcgm(FB_RESERVED, None, None, reason=reason)
        for name in (FB_USED, FB_FREE, FB_TOTAL):
            b = exact[name]
            p.dcgm(name, None if b is None else b // MIB, b, reason=reason)
        emc = read_emc(self._sys)
        reason = "; ".join(m.reason for m in emc.missing)
        p.add(EMC_CLOCK, emc.frequency_hz, reason=reason)
        p.add(EMC_UTIL, emc.load, reason=reason)
        self._rails(p)
        self._unsupported = {n: r for n, r in p.why.items() if n not in p.published}
        return [
            GpuInventory(
                index=0,
                uuid=self.uuid,
                name=self.board.module_name,
                pci_bus_id="",
                minor=0,
                # both 0 where the GPU's memory in use is not known: BIE then leaves
                # the GPU out rather than report 0 used
                memory_total_bytes=(mem.total_bytes or 0) if mem.gpu_bytes is not None else 0,
                memory_used_bytes=mem.gpu_bytes or 0,
                healthy=healthy,
            )
        ]

    def _board(self, p: _Pass) -> None:
        b = self.board
        info = (("model", b.model), ("module", b.module), ("soc", b.soc))
        p.add(BOARD, 1.0, (*info, ("l4t", b.l4t), ("jetpack", b.jetpack)))
        mode = read_power_mode(self._etc, self._var)
        if isinstance(mode, PowerMode):
            p.add(MODE, 1.0, (("mode_id", mode.id), ("mode", mode.name), ("source", mode.source)))
        else:
            p.add(MODE, None, reason=str(mode))

    def _gpu_series(self, p: _Pass) -> bool:
        """GPU load and clock; False when the GPU's devfreq node is not there."""
        if isinstance(self._gpu, Missing):  # a driver loaded late (nvgpu is a module on r36)
            self._gpu = find_gpu(self._sys)
        if isinstance(self._gpu, Missing):
            for name in (UTIL, CLOCK):
                p.dcgm(name, None, None, reason=f"no GPU devfreq node ({self._gpu})")
            return False
        g = read_gpu(self._gpu)
        first = str(g.missing[0]) if g.missing else ""
        per_mille, hz = g.load_per_mille, g.frequency_hz
        if per_mille is None:
            p.dcgm(UTIL, None, None, reason=first)
        else:
            p.dcgm(UTIL, per_mille / 10, per_mille / 1000)
        p.dcgm(CLOCK, None if hz is None else hz / 1_000_000, hz, reason=first)
        return True

    def _rails(self, p: _Pass) -> None:
        rails = read_rails(self._sys)
        reason = str(rails.missing[0]) if rails.missing else "no INA3221 or INA238 monitor"
        for r in rails.rails:
            own = (("rail", r.name),)
            p.add(VOLTS, None if r.millivolts is None else r.millivolts / 1000, own, reason)
            p.add(AMPS, None if r.milliamps is None else r.milliamps / 1000, own, reason)
            p.add(WATTS, None if r.microwatts is None else r.microwatts / 1_000_000, own, reason)
        if not rails.rails:
            for name in (VOLTS, AMPS, WATTS):
                p.add(name, None, reason=reason)
        gpu_rail = next((r for r in rails.rails if r.name in GPU_RAILS), None)
        if gpu_rail is None or gpu_rail.microwatts is None:
            p.dcgm(POWER, None, None, reason="no rail measures the GPU alone on this board")
        else:
            watts = gpu_rail.microwatts / 1_000_000
            p.dcgm(POWER, watts, watts)

    @property
    def gpu_path(self) -> str:
        """The GPU's devfreq node, or why there is none (for the start-up log)."""
        return str(self._gpu.devfreq if isinstance(self._gpu, GpuNode) else self._gpu)

    def report_unsupported(self) -> dict[str, str]:
        return dict(self._unsupported)

    def close(self) -> None:
        """Nothing held open: every pass reads the files anew."""
