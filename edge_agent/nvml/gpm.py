"""NVML GPM: DCGM's profiling fields without the DCGM host engine (Hopper and newer).

GPM (GPU performance monitoring) reads a GPU's performance counters into a *sample*;
``nvmlGpmMetricsGet`` turns two samples into metrics over the time between them: the
share of time the graphics engine, the SMs, the tensor pipes, the DRAM interface were
busy (percent), and PCIe / NVLink traffic (MiB/s). A :class:`GpmStream` keeps the last
sample of one GPU (``nvmlGpmSampleGet``) or one MIG GPU instance
(``nvmlGpmMigSampleGet`` on the parent GPU), so each collection gives the metrics since
the previous one, exactly one interval wide, as DCGM's GPM manager computes them.

Sample buffers belong to NVML: each stream owns at most two (the previous sample and the
one being filled, swapped every interval), allocated on first use and freed by
:meth:`GpmStream.close`. Nothing is allocated per interval.

Older GPUs say so through ``nvmlGpmQueryDeviceSupport`` (``isSupportedDevice == 0``), and
drivers older than R520 lack the function: :func:`unsupported_reason` tells which, once,
and no stream is opened for them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from contextlib import suppress
from typing import Any, TypeAlias

import pynvml

from edge_agent.nvml.backend import Handle, NvmlLib, text
from edge_agent.nvml.devices import GpuDevice

log = logging.getLogger(__name__)

# A metric's value, or the error NVML reported for that metric alone.
GpmValue: TypeAlias = float | pynvml.NVMLError
GPM_NEEDS = "NVML GPM (profiling counters in NVML; Hopper or newer, driver R520 or newer)"
GIVE_UP_AFTER = 5  # sampling failures in a row (of another kind than _FOR_GOOD)
_FOR_GOOD = frozenset(
    {
        pynvml.NVML_ERROR_NO_PERMISSION,
        pynvml.NVML_ERROR_NOT_SUPPORTED,
        pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
    }
)
_HINTS = {
    pynvml.NVML_ERROR_NO_PERMISSION: " (profiling counters need CAP_SYS_ADMIN, or the driver "
    "option NVreg_RestrictProfilingToAdminUsers=0)",
}


def unsupported_reason(lib: NvmlLib, handle: Handle) -> str | None:
    """None when the GPU behind ``handle`` offers GPM, else why not (for the log)."""
    try:
        support = lib.nvmlGpmQueryDeviceSupport(handle)
    except pynvml.NVMLError_FunctionNotFound:
        return "the NVIDIA driver has no GPM (nvmlGpmQueryDeviceSupport needs R520 or newer)"
    except pynvml.NVMLError as exc:  # a lost GPU too: asked once, at start-up
        return f"nvmlGpmQueryDeviceSupport failed: {exc}"
    if not support.isSupportedDevice:
        return "the GPU does not support GPM (nvmlGpmQueryDeviceSupport: not a supported device)"
    return None


class GpmStream:
    """Samples of one GPU or GPU instance, one interval apart, and the metrics between them."""

    def __init__(
        self,
        lib: NvmlLib,
        device: Handle,
        metrics: Sequence[int],
        *,
        gpu_instance_id: int | None = None,
    ) -> None:
        self._lib = lib
        self._device = device  # the physical GPU's handle, for MIG samples too
        self._gpu_instance_id = gpu_instance_id
        self.metrics = tuple(dict.fromkeys(metrics))
        if len(self.metrics) > pynvml.NVML_GPM_METRIC_MAX:
            raise ValueError(f"at most {pynvml.NVML_GPM_METRIC_MAX} GPM metrics per call")
        self._previous: Any = None  # the last sample taken
        self._spare: Any = None  # the buffer the next sample goes into
        self._failures: list[pynvml.NVMLError] = []  # since the last good sample

    def advance(self) -> Mapping[int, GpmValue] | None:
        """Take a sample; return the metrics since the previous one (None the first time).

        A failed sample raises and leaves the previous sample in place, so the next
        interval's metrics span both intervals instead of being lost.
        """
        try:
            if self._spare is None:
                self._spare = self._lib.nvmlGpmSampleAlloc()
            sample = self._spare
            if self._gpu_instance_id is None:
                self._lib.nvmlGpmSampleGet(self._device, sample)
            else:
                self._lib.nvmlGpmMigSampleGet(self._device, self._gpu_instance_id, sample)
        except pynvml.NVMLError as exc:
            self._failures.append(exc)
            raise
        self._failures.clear()
        previous, self._previous, self._spare = self._previous, sample, self._previous
        if previous is None:
            return None
        return self._between(previous, sample)

    def gave_up(self) -> str | None:
        """Why sampling should stop for good, or None while it may still recover: at once
        for an answer that will not change (no permission: profiling counters need
        CAP_SYS_ADMIN or NVreg_RestrictProfilingToAdminUsers=0; not supported; a driver
        without the call), else after GIVE_UP_AFTER failures in a row."""
        if not self._failures:
            return None
        last = self._failures[-1]
        if last.value in _FOR_GOOD:
            hint = _HINTS.get(last.value, "")
            return f"GPM sampling failed: {last}{hint}"
        if len(self._failures) >= GIVE_UP_AFTER:
            return f"GPM sampling failed {len(self._failures)} times in a row, last: {last}"
        return None

    def _between(self, first: Any, second: Any) -> dict[int, GpmValue]:
        get = pynvml.c_nvmlGpmMetricsGet_t()
        get.version = pynvml.NVML_GPM_METRICS_GET_VERSION
        get.numMetrics = len(self.metrics)
        get.sample1, get.sample2 = first, second
        for slot, metric in zip(get.metrics, self.metrics, strict=False):
            slot.metricId = metric
        self._lib.nvmlGpmMetricsGet(get)
        out: dict[int, GpmValue] = {}
        for slot, metric in zip(get.metrics, self.metrics, strict=False):
            ok = slot.nvmlReturn == pynvml.NVML_SUCCESS
            out[metric] = float(slot.value) if ok else pynvml.NVMLError(slot.nvmlReturn)
        return out

    def close(self) -> None:
        """Free the sample buffers (NVML must still be initialised)."""
        for sample in (self._previous, self._spare):
            if sample is not None:
                with suppress(pynvml.NVMLError):
                    self._lib.nvmlGpmSampleFree(sample)
        self._previous = self._spare = None


class GpmStreams:
    """A stream per GPU and per MIG GPU instance that has GPM; why the other GPUs have not.

    ``gpu_metrics`` are read on whole GPUs, ``mig_metrics`` on GPU instances (DCGM serves
    the activity fields per instance, PCIe and NVLink traffic only per GPU).
    """

    def __init__(
        self,
        lib: NvmlLib,
        devices: Iterable[GpuDevice],
        *,
        gpu_metrics: Sequence[int],
        mig_metrics: Sequence[int],
    ) -> None:
        self.streams: dict[str, GpmStream] = {}  # entity key (as entity_key) -> stream
        self.unsupported: dict[str, str] = {}  # GPU UUID -> reason
        for dev in devices:
            reason = unsupported_reason(lib, dev.handle)
            if reason is not None:
                self.unsupported[dev.uuid] = reason
                continue
            if gpu_metrics:
                self.streams[entity_key(dev.uuid)] = GpmStream(lib, dev.handle, gpu_metrics)
            if not mig_metrics:
                continue
            for inst in dev.mig:
                self.streams[entity_key(dev.uuid, inst.gpu_instance_id)] = GpmStream(
                    lib, dev.handle, mig_metrics, gpu_instance_id=inst.gpu_instance_id
                )

    def get(self, key: str) -> GpmStream | None:
        return self.streams.get(key)

    def describe(self, devices: Iterable[GpuDevice]) -> str:
        """Why no GPU of ``devices`` offers GPM, naming each GPU (for the start-up report)."""
        parts = [
            f"GPU {d.index} ({text(d.name)}): {self.unsupported[d.uuid]}"
            for d in devices
            if d.uuid in self.unsupported
        ]
        return f"needs {GPM_NEEDS}; " + "; ".join(parts)

    def close(self) -> None:
        for stream in self.streams.values():
            stream.close()


def entity_key(uuid: str, gpu_instance_id: int | None = None) -> str:
    """How the device collector names a GPU (its UUID) or a GPU instance (UUID/GI)."""
    return uuid if gpu_instance_id is None else f"{uuid}/{gpu_instance_id}"
