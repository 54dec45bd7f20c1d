"""GPM and NVLink counters for the NVML simulator (:mod:`edge_agent.sim.nvml`).

What a GPU model offers is its :class:`Profile`: an H100 has GPM and 18 NVLinks; an
A100 has NVLinks but no GPM (``nvmlGpmQueryDeviceSupport`` answers
``isSupportedDevice == 0`` and a sample fails with NOT_SUPPORTED, as real NVML does before
Hopper); a T4 has neither.

A sample remembers its device and the simulated time it was taken. ``nvmlGpmMetricsGet``
then averages the simulated activity over the time between two samples, as the hardware
counters would: the graphics engine is busy as much as ``nvmlDeviceGetUtilizationRates``
says (no process, no activity), the SM, tensor and FP pipes are fixed shares of that,
DRAM follows the memory-copy utilisation, PCIe follows ``nvmlDeviceGetPcieThroughput``.
NVLink traffic is an exact integral of the GPU's load, so the cumulative
``NVML_FI_DEV_NVLINK_THROUGHPUT_*`` field values and GPM's NVLink rates agree.

MIG: a GPU instance is active while one of its processes runs; ``nvmlGpmMigSampleGet``
(parent GPU + GPU instance id) and ``nvmlGpmSampleGet`` on a MIG device handle sample it.
Its PCIe and NVLink metrics are NOT_SUPPORTED (DCGM reads those per GPU only); the
parent GPU's activity is the instances' weighted by their slices.

Simplifications, documented: metrics the agent does not read (NVDEC, NVJPG, C2C, per-link
NVLink, ...) answer NOT_SUPPORTED; samples taken at the same instant give NaN.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol

import pynvml

MIB = 1 << 20
_GPM_SLICES = 7  # compute slices of an H100 or A100 in MIG mode
_NVLINK_BYTES_PER_LINK = 25e9  # per direction, H100 NVLink 4
_NVLINK_SHARE = {"rx": 0.3, "tx": 0.27}  # of the links' peak, at full load
_MAX_POINTS = 5  # activity is averaged over at most this many instants per interval
_ALL_LINKS = 0xFFFFFFFF  # scopeId for "every NVLink of the GPU" (as DCGM passes it)
_NVLINK_FIELDS = {
    pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: ("rx", 1.0),
    pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: ("tx", 1.0),
    pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_RX: ("rx", 1.06),  # + protocol overhead
    pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_TX: ("tx", 1.06),
}
# Activity metrics: share of the SM activity (or, for these two, the base values).
_SM_SHARE = 0.92
_OF_SM = {
    pynvml.NVML_GPM_METRIC_SM_UTIL: 1.0,
    pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: 0.5,
    pynvml.NVML_GPM_METRIC_INTEGER_UTIL: 0.18,
    pynvml.NVML_GPM_METRIC_FP64_UTIL: 0.02,
    pynvml.NVML_GPM_METRIC_FP32_UTIL: 0.30,
    pynvml.NVML_GPM_METRIC_FP16_UTIL: 0.12,
    pynvml.NVML_GPM_METRIC_DFMA_TENSOR_UTIL: 0.0,
    pynvml.NVML_GPM_METRIC_DMMA_TENSOR_UTIL: 0.0,
}
_OF_TENSOR = {
    pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: 1.0,
    pynvml.NVML_GPM_METRIC_HMMA_TENSOR_UTIL: 0.9,
    pynvml.NVML_GPM_METRIC_IMMA_TENSOR_UTIL: 0.1,
}
_PCIE = {
    pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC: pynvml.NVML_PCIE_UTIL_TX_BYTES,
    pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC: pynvml.NVML_PCIE_UTIL_RX_BYTES,
}
_ACTIVITY = {
    *_OF_SM,
    *_OF_TENSOR,
    pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL,
    pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL,
}
_NVLINK = {
    pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC: "rx",
    pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC: "tx",
}


@dataclass(frozen=True, slots=True)
class Profile:
    """What a simulated GPU model offers beyond the common calls."""

    gpm: bool
    nvlinks: int


PROFILES = {
    "NVIDIA H100 80GB HBM3": Profile(gpm=True, nvlinks=18),
    "NVIDIA H100 PCIe": Profile(gpm=True, nvlinks=0),
    "NVIDIA A100-SXM4-80GB": Profile(gpm=False, nvlinks=12),
    "NVIDIA A100-SXM4-40GB": Profile(gpm=False, nvlinks=12),
    "Tesla T4": Profile(gpm=False, nvlinks=0),
    "NVIDIA GeForce RTX 4090": Profile(gpm=False, nvlinks=0),  # GPM on GeForce: Blackwell on
}


def profile_for(model: str) -> Profile:
    """The model's profile; an unknown name is taken for a Hopper-class SXM GPU."""
    return PROFILES.get(model, PROFILES["NVIDIA H100 80GB HBM3"])


class SimGpu(Protocol):
    """What this module reads from the simulator's GPU objects."""

    seed: int
    index: int
    t0: float
    level: float
    waves: list[tuple[float, float, float]]
    mig_devices: list[Any]

    def processes(self, t: float) -> list[Any]: ...
    def load(self, t: float) -> float: ...
    def utilization(self, t: float, processes: list[Any]) -> tuple[int, int]: ...
    def pcie_kbps(self, counter: int, t: float) -> int: ...


def _fail(code: int) -> NoReturn:
    raise pynvml.NVMLError(code)


def _unit(*key: object) -> float:
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def _slices(profile: str) -> int:
    """``"3g.40gb"`` -> 3."""
    return int(profile.split("g.", 1)[0])


def load_integral(gpu: SimGpu, t: float) -> float:
    """The integral of ``gpu.load`` from driver load to ``t`` (load-seconds)."""
    total = gpu.level * (t - gpu.t0)
    for amplitude, period, phase in gpu.waves:
        theta0, theta = (2 * math.pi * x / period + phase for x in (gpu.t0, t))
        total -= amplitude * period / (2 * math.pi) * (math.cos(theta) - math.cos(theta0))
    return total


def nvlink_bytes(gpu: SimGpu, nvlinks: int, direction: str, t: float) -> float:
    """Bytes over all NVLinks in ``direction`` since driver load: rate (load + 0.2) / 1.25."""
    peak = nvlinks * _NVLINK_BYTES_PER_LINK * _NVLINK_SHARE[direction]
    return peak * (load_integral(gpu, t) + 0.2 * (t - gpu.t0)) / 1.25


def nvlink_field(gpu: SimGpu, nvlinks: int, field_id: int, scope: int, t: float) -> int | None:
    """KiB since driver load for an ``NVML_FI_DEV_NVLINK_THROUGHPUT_*`` field, or None when
    the GPU has no such field (no NVLink, another field, a link it does not have)."""
    kind = _NVLINK_FIELDS.get(field_id)
    if kind is None or nvlinks == 0 or (scope != _ALL_LINKS and scope >= nvlinks):
        return None
    direction, overhead = kind
    share = 1.0 if scope == _ALL_LINKS else 1.0 / nvlinks
    return int(nvlink_bytes(gpu, nvlinks, direction, t) * share * overhead) // 1024


def _activity(device: Any, t: float) -> tuple[float, float]:
    """(graphics engine %, DRAM %) of a GPU or GPU instance at ``t``."""
    gpu: SimGpu = device.owner
    if device is not gpu:  # a GPU instance: busy while one of its processes runs
        processes = device.processes(t)
        util, memory = gpu.utilization(t, processes)
        share = 0.6 + 0.4 * _unit(gpu.seed, gpu.index, device.gpu_instance_id, "gpm")
        return util * share, memory * share
    if gpu.mig_devices:  # the parent of GPU instances: their activity by slices
        graphics = dram = 0.0
        for instance in gpu.mig_devices:
            g, d = _activity(instance, t)
            graphics += g * _slices(instance.profile) / _GPM_SLICES
            dram += d * _slices(instance.profile) / _GPM_SLICES
        return graphics, dram
    util, memory = gpu.utilization(t, gpu.processes(t))
    return float(util), float(memory)


def _instants(t1: float, t2: float) -> list[float]:
    """Where an average over [t1, t2] looks: the midpoints of one-second steps (at most
    five equal steps), as the counters would integrate it."""
    n = max(1, min(_MAX_POINTS, math.ceil(t2 - t1)))
    step = (t2 - t1) / n
    return [t1 + (k + 0.5) * step for k in range(n)]


def _mean(f: Callable[[float], float], t1: float, t2: float) -> float:
    instants = _instants(t1, t2)
    return sum(f(t) for t in instants) / len(instants)


@dataclass
class _Sample:
    buffer: Any  # the struct a c_nvmlGpmSample_t points at (kept alive here)
    device: Any = None  # the GPU or GPU instance sampled; None until a sample is taken
    t: float = 0.0


@dataclass
class _Window:
    """The time between two samples of one device; each average computed once."""

    device: Any
    t1: float
    t2: float
    nvlinks: int
    _means: dict[object, float] = field(default_factory=dict)

    def _mean(self, key: object, f: Callable[[float], float]) -> float:
        if key not in self._means:
            self._means[key] = _mean(f, self.t1, self.t2)
        return self._means[key]

    def _activity(self) -> tuple[float, float]:
        """Mean (graphics engine %, DRAM %) over the window, in one pass."""
        if "activity" not in self._means:
            points = [_activity(self.device, t) for t in _instants(self.t1, self.t2)]
            self._means["activity"] = sum(g for g, _ in points) / len(points)
            self._means["dram"] = sum(d for _, d in points) / len(points)
        return self._means["activity"], self._means["dram"]

    def metric(self, metric: int) -> tuple[int, float]:
        """(nvmlReturn, value) of ``metric`` over the window."""
        if not 0 < metric < pynvml.NVML_GPM_METRIC_MAX:
            return pynvml.NVML_ERROR_INVALID_ARGUMENT, 0.0
        device, t1, t2 = self.device, self.t1, self.t2
        gpu: SimGpu = device.owner
        if metric in _PCIE or metric in _NVLINK:
            if device is not gpu:  # a GPU instance
                return pynvml.NVML_ERROR_NOT_SUPPORTED, 0.0
        elif metric not in _ACTIVITY:
            return pynvml.NVML_ERROR_NOT_SUPPORTED, 0.0
        if t2 <= t1:
            return pynvml.NVML_SUCCESS, math.nan  # no time between the samples
        if metric in _PCIE:
            counter = _PCIE[metric]
            kbps = self._mean(metric, lambda t: float(gpu.pcie_kbps(counter, t)))
            return pynvml.NVML_SUCCESS, kbps * 1024 / MIB
        if metric in _NVLINK:
            direction = _NVLINK[metric]
            moved = nvlink_bytes(gpu, self.nvlinks, direction, t2) - nvlink_bytes(
                gpu, self.nvlinks, direction, t1
            )
            return pynvml.NVML_SUCCESS, moved / (t2 - t1) / MIB
        graphics, dram = self._activity()
        if metric == pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL:
            return pynvml.NVML_SUCCESS, dram
        if metric == pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL:
            return pynvml.NVML_SUCCESS, graphics
        sm = graphics * _SM_SHARE
        if metric in _OF_SM:
            return pynvml.NVML_SUCCESS, sm * _OF_SM[metric]
        tensor = sm * (0.35 + 0.3 * _unit(gpu.seed, gpu.index, "tensor"))
        return pynvml.NVML_SUCCESS, tensor * _OF_TENSOR[metric]


class GpmSimulation:
    """Sample buffers and metric maths; the simulator resolves handles and faults first."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self._lock = threading.Lock()
        self._samples: dict[int, _Sample] = {}

    @property
    def allocated(self) -> int:
        """Sample buffers allocated and not yet freed (for leak tests)."""
        with self._lock:
            return len(self._samples)

    def support(self) -> Any:
        return pynvml.c_nvmlGpmSupport_t(
            version=pynvml.NVML_GPM_SUPPORT_VERSION, isSupportedDevice=int(self.profile.gpm)
        )

    def alloc(self) -> Any:
        buffer = pynvml.struct_c_nvmlGpmSample_t()
        with self._lock:
            self._samples[ctypes.addressof(buffer)] = _Sample(buffer)
        return pynvml.c_nvmlGpmSample_t(buffer)

    def free(self, sample: Any) -> None:
        with self._lock:
            if self._samples.pop(self._address(sample), None) is None:
                _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def take(self, device: Any, sample: Any, t: float) -> Any:
        """Sample ``device`` (a GPU, or a GPU instance) into ``sample`` at ``t``."""
        if not self.profile.gpm:
            _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        with self._lock:
            found = self._samples.get(self._address(sample))
            if found is None:
                _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            found.device, found.t = device, t
        return sample

    def take_mig(self, gpu: SimGpu, gpu_instance_id: int, sample: Any, t: float) -> Any:
        if not self.profile.gpm:
            _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        instance = next((m for m in gpu.mig_devices if m.gpu_instance_id == gpu_instance_id), None)
        if instance is None:
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self.take(instance, sample, t)

    def metrics(self, get: Any) -> Any:
        """Fill ``get`` (a ``c_nvmlGpmMetricsGet_t``) from its two samples."""
        if get.version != pynvml.NVML_GPM_METRICS_GET_VERSION:
            _fail(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        if get.numMetrics > pynvml.NVML_GPM_METRIC_MAX:
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        with self._lock:
            first = self._samples.get(self._address(get.sample1))
            second = self._samples.get(self._address(get.sample2))
        if first is None or second is None or first.device is None:
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if first.device is not second.device:
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        window = _Window(first.device, first.t, second.t, self.profile.nvlinks)
        for k in range(get.numMetrics):
            slot = get.metrics[k]
            slot.nvmlReturn, slot.value = window.metric(slot.metricId)
        return get

    @staticmethod
    def _address(sample: Any) -> int:
        try:
            return ctypes.addressof(sample.contents)
        except (AttributeError, TypeError, ValueError):  # not a sample, or NULL
            return 0
