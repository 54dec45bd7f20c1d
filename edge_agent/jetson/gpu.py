"""The Jetson's integrated GPU and its memory controller, from devfreq.

The GPU is the devfreq device whose platform device's device-tree node is named for it:
``/sys/class/devfreq/<node>/device/of_node/name`` is ``ga10b`` (Orin, L4T r35), ``gpu``
(Orin r36, Nano), ``gv11b`` (Xavier), ``gp10b`` (TX2); the devfreq node is
``17000000.ga10b``, ``17000000.gpu``, ``57000000.gpu``... so it is found by that name,
not by an address. In the platform device (``<node>/device``):

- ``load``: the GPU's busy share over the governor's last window, per mille (0-1000);

in the devfreq node:

- ``cur_freq``, ``min_freq``, ``max_freq``: Hz; ``governor``: nvhost_podgov, performance...

The memory controller (EMC): its clock from BPMP's debugfs
(``/sys/kernel/debug/bpmp/debug/clk/emc/rate``, Hz; root only) where there is one, and
its activity from actmon (``/sys/kernel/actmon_avg_activity/mc_all``, r32/r35;
``/sys/kernel/debug/cactmon/mc_all``, r36) as tegrastats reads them: ``mc_all`` over the
EMC clock in kHz is its busy share in percent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from edge_agent.jetson.files import Missing, read_count, read_text, read_value

GPU_NODE_NAMES = frozenset({"ga10b", "gv11b", "gp10b", "gb10b", "gpu"})


@dataclass(frozen=True, slots=True)
class GpuNode:
    name: str  # the device-tree node's name (ga10b, gpu, ...)
    devfreq: Path  # /sys/class/devfreq/<node>
    device: Path  # its platform device (load, railgate)


@dataclass(frozen=True, slots=True)
class GpuReading:
    load_per_mille: int | None  # as the kernel gives it, 0-1000
    frequency_hz: int | None
    min_hz: int | None
    max_hz: int | None
    governor: str | None
    missing: tuple[Missing, ...] = field(default=())

    @property
    def load(self) -> float | None:
        """0-1."""
        return None if self.load_per_mille is None else self.load_per_mille / 1000


@dataclass(frozen=True, slots=True)
class EmcReading:
    frequency_hz: int | None
    load: float | None  # 0-1
    missing: tuple[Missing, ...] = field(default=())


def find_gpu(sys_root: Path) -> GpuNode | Missing:
    """The integrated GPU's devfreq node, or why there is none."""
    devfreq = sys_root / "class" / "devfreq"
    try:
        nodes = sorted(devfreq.iterdir())
    except OSError as exc:
        return Missing(devfreq, exc.strerror or "unreadable")
    for node in nodes:
        name = read_text(node / "device" / "of_node" / "name")
        if isinstance(name, Missing):
            continue
        if name.lower() in GPU_NODE_NAMES:
            return GpuNode(name, node, node / "device")
    return Missing(devfreq, "no devfreq device whose device-tree node is a GPU")


def read_gpu(gpu: GpuNode) -> GpuReading:
    missing: list[Missing] = []
    load = read_value(gpu.device / "load", missing)
    if load is not None and not 0 <= load <= 1000:
        missing.append(Missing(gpu.device / "load", f"out of range: {load} per mille"))
        load = None
    read = read_text(gpu.devfreq / "governor")
    governor: str | None = None
    if isinstance(read, Missing):
        missing.append(read)
    else:
        governor = read
    return GpuReading(
        load_per_mille=load,
        frequency_hz=read_count(gpu.devfreq / "cur_freq", missing),
        min_hz=read_count(gpu.devfreq / "min_freq", missing),
        max_hz=read_count(gpu.devfreq / "max_freq", missing),
        governor=governor,
        missing=tuple(missing),
    )


def read_emc(sys_root: Path) -> EmcReading:
    missing: list[Missing] = []
    rate = read_count(
        sys_root / "kernel" / "debug" / "bpmp" / "debug" / "clk" / "emc" / "rate", missing
    )
    activity: int | None = None
    for path in (
        sys_root / "kernel" / "debug" / "cactmon" / "mc_all",
        sys_root / "kernel" / "actmon_avg_activity" / "mc_all",
    ):
        activity = read_count(path, missing)
        if activity is not None:
            break
    load = None
    if activity is not None and rate:
        load = min(activity / (rate / 1000) / 100, 1.0)
    return EmcReading(rate, load, tuple(missing))
