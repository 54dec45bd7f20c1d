"""Jetson power rails: the INA3221 (and Thor's INA238) monitors on the module.

L4T r34 and later (JetPack 5, 6) publish them through hwmon: an I2C device whose ``name``
is ``ina3221`` has ``hwmon/hwmon<N>/`` with, per channel ``<c>``, ``in<c>_label`` (the
rail: VDD_GPU_SOC, VDD_CPU_CV, VIN_SYS_5V0 on AGX Orin; VDD_IN, VDD_CPU_GPU_CV, VDD_SOC on
Orin NX and Nano), ``in<c>_input`` (bus voltage, mV) and ``curr<c>_input`` (mA); the
kernel's ina3221 documentation gives the units. A channel labelled ``NC`` is not
connected, and ``in7`` is the sum of the shunt voltages: both are left out. Power is
mV x mA / 1000 (mW). The INA238 gives ``power1_input`` in µW.

L4T r32 (JetPack 4) used the iio driver ``ina3221x``: ``iio:device<N>/rail_name_<c>``,
``in_voltage<c>_input`` (mV), ``in_current<c>_input`` (mA), ``in_power<c>_input`` (mW).

The board's input is the rail named VDD_IN (or POM_5V_IN, Nano) where the board has one;
AGX Orin has none, and its total is left to the user (the sum of the rails misses what
they do not measure).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from edge_agent.jetson.files import Missing, read_text, read_value

INPUT_RAILS = ("VDD_IN", "POM_5V_IN")


@dataclass(frozen=True, slots=True)
class Rail:
    name: str
    millivolts: int | None
    milliamps: int | None
    microwatts: int | None  # mV x mA exactly, or the monitor's own figure

    @property
    def is_input(self) -> bool:
        return self.name in INPUT_RAILS


@dataclass(frozen=True, slots=True)
class Rails:
    rails: tuple[Rail, ...]
    missing: tuple[Missing, ...] = field(default=())


def read_rails(sys_root: Path) -> Rails:
    devices = sys_root / "bus" / "i2c" / "devices"
    rails: list[Rail] = []
    missing: list[Missing] = []
    try:
        entries = sorted(devices.iterdir())
    except OSError as exc:
        return Rails((), (Missing(devices, exc.strerror or "unreadable"),))
    for dev in entries:
        name = read_text(dev / "name")
        if isinstance(name, Missing) or not name.startswith(("ina3221", "ina238")):
            continue
        hwmon = sorted((dev / "hwmon").glob("hwmon*")) if (dev / "hwmon").is_dir() else []
        if hwmon:
            _hwmon_rails(hwmon[0], name, rails, missing)
            continue
        iio = sorted(dev.glob("iio:device*"))
        if iio:
            _iio_rails(iio[0], rails, missing)
            continue
        missing.append(Missing(dev, f"{name} without hwmon or iio"))
    return Rails(tuple(rails), tuple(missing))


def _hwmon_rails(hwmon: Path, chip: str, rails: list[Rail], missing: list[Missing]) -> None:
    labels = sorted(hwmon.glob("in*_label"))
    if chip.startswith("ina238") and not labels:
        labels = [hwmon / "in1_label"]  # one channel; the label is optional
    for label_path in labels:
        channel = label_path.name.removeprefix("in").removesuffix("_label")
        if channel == "7":
            continue  # INA3221: the sum of the shunt voltages, not a rail
        label = read_text(label_path)
        if isinstance(label, Missing):
            label = f"{hwmon.parent.parent.name}:in{channel}"
        if label == "NC" or label.startswith("sum of"):
            continue
        mv = read_value(hwmon / f"in{channel}_input", missing)
        ma = read_value(hwmon / f"curr{channel}_input", missing)
        if chip.startswith("ina238"):
            uw = read_value(hwmon / f"power{channel}_input", missing)
        else:
            uw = None if mv is None or ma is None else mv * ma
        rails.append(Rail(label, mv, ma, uw))


def _iio_rails(iio: Path, rails: list[Rail], missing: list[Missing]) -> None:
    for name_path in sorted(iio.glob("rail_name_*")):
        channel = name_path.name.removeprefix("rail_name_")
        label = read_text(name_path)
        if isinstance(label, Missing):
            missing.append(label)
            continue
        mv = read_value(iio / f"in_voltage{channel}_input", missing)
        ma = read_value(iio / f"in_current{channel}_input", missing)
        mw = read_value(iio / f"in_power{channel}_input", missing)
        rails.append(Rail(label, mv, ma, None if mw is None else mw * 1000))
