"""Jetson temperatures: the kernel's thermal zones, by type.

``/sys/class/thermal/thermal_zone<N>/type`` names the sensor (L4T r35: ``CPU-therm``,
``GPU-therm``, ``SOC0-therm``, ``Tboard_tegra``, ``tj-therm``; r36: ``cpu-thermal``,
``gpu-thermal``, ``tj-thermal``), ``temp`` is millidegrees Celsius. A sensor of a block
that is powered down reads -256000 (tegrastats prints ``GPU@-256C``) or fails with EIO:
offline, not a temperature. ``PMIC-Die`` is a fixed trip point, not a measurement (it
always reads 100 °C), and is left out as tegrastats' users leave it out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from edge_agent.jetson.files import Missing, read_int, read_text

OFFLINE_MILLIDEGREES = -256_000


@dataclass(frozen=True, slots=True)
class Zone:
    type: str  # as the kernel names it (GPU-therm, gpu-thermal, ...)
    celsius: float | None  # None: offline or unreadable (see ``missing``)

    @property
    def kind(self) -> str:
        """The sensor without the driver's suffix, lower case: gpu, cpu, soc0, tj, tboard."""
        for sep in ("-", "_"):
            if sep in self.type:
                return self.type.split(sep, 1)[0].lower()
        return self.type.lower()


@dataclass(frozen=True, slots=True)
class Zones:
    zones: tuple[Zone, ...]
    missing: tuple[Missing, ...] = field(default=())

    def by_kind(self, kind: str) -> Zone | None:
        return next((z for z in self.zones if z.kind == kind), None)


def read_zones(sys_root: Path) -> Zones:
    base = sys_root / "class" / "thermal"
    try:
        entries = sorted(
            (p for p in base.iterdir() if p.name.startswith("thermal_zone")),
            key=lambda p: int(p.name.removeprefix("thermal_zone") or 0),
        )
    except (OSError, ValueError) as exc:
        return Zones((), (Missing(base, str(exc)),))
    zones: list[Zone] = []
    missing: list[Missing] = []
    for entry in entries:
        kind = read_text(entry / "type")
        if isinstance(kind, Missing):
            missing.append(kind)
            continue
        if kind.startswith("PMIC"):
            continue
        temp = read_int(entry / "temp")
        if isinstance(temp, Missing):
            missing.append(temp)
            zones.append(Zone(kind, None))
        elif temp <= OFFLINE_MILLIDEGREES:
            missing.append(Missing(entry / "temp", f"offline ({temp})"))
            zones.append(Zone(kind, None))
        else:
            zones.append(Zone(kind, temp / 1000))
    return Zones(tuple(zones), tuple(missing))
