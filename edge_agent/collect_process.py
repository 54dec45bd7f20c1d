"""Process collector: per-process GPU memory and SM utilisation, attributed to containers.

For every GPU (or each MIG instance of a MIG GPU) the running compute and graphics
processes are listed, their utilisation samples since the last pass are read with
``nvmlDeviceGetProcessUtilization(handle, last_seen)``, and each PID is attributed to its
container and pod. Output uses the ACK names (``DCGM_CUSTOM_PROCESS_*``) plus per-container
sums (``DCGM_CUSTOM_CONTAINER_*``).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import pynvml

from edge_agent.attribute import Attribution
from edge_agent.nvml.backend import Handle, NvmlLib
from edge_agent.nvml.devices import GpuDevice
from gpurelay.model import MIB, Family, Labels, SampleSink

log = logging.getLogger(__name__)


class AttributorLike(Protocol):
    def attribute(self, pid: int) -> Attribution: ...


PROCESS_FAMILIES = (
    Family(
        name="DCGM_CUSTOM_PROCESS_MEM_USED",
        type="gauge",
        help="GPU memory used by the process (MiB).",
    ),
    Family(
        name="DCGM_CUSTOM_PROCESS_SM_UTIL",
        type="gauge",
        help="Share of SM time used by the process over the last sampling window (%).",
    ),
    Family(
        name="DCGM_CUSTOM_PROCESS_MEM_COPY_UTIL",
        type="gauge",
        help="Share of memory-copy time used by the process over the last window (%).",
    ),
    Family(
        name="DCGM_CUSTOM_PROCESS_ENCODE_UTIL",
        type="gauge",
        help="Video encoder use by the process over the last window (%).",
    ),
    Family(
        name="DCGM_CUSTOM_PROCESS_DECODE_UTIL",
        type="gauge",
        help="Video decoder use by the process over the last window (%).",
    ),
    Family(
        name="DCGM_CUSTOM_CONTAINER_MEM_USED",
        type="gauge",
        help="GPU memory used by all processes of the container on this GPU (MiB).",
    ),
    Family(
        name="DCGM_CUSTOM_CONTAINER_SM_UTIL",
        type="gauge",
        help="Sum of the SM utilisation of the container's processes on this GPU (%).",
    ),
    Family(
        name="DCGM_CUSTOM_CONTAINER_PROCESSES",
        type="gauge",
        help="Number of GPU processes of the container on this GPU.",
    ),
)


@dataclass(slots=True)
class _Proc:
    pid: int
    mem_bytes: int
    kind: str  # "C", "G" or "C+G"
    gpu_instance_id: int | None


@dataclass(frozen=True, slots=True)
class _Target:
    """One handle whose processes we list: a whole GPU, or one MIG instance."""

    dev: GpuDevice
    handle: Handle
    key: str
    gpu_instance_id: str


class ProcessCollector:
    name = "process"

    def __init__(
        self, lib: NvmlLib, devices: Sequence[GpuDevice], attributor: AttributorLike, *, node: str
    ) -> None:
        self._lib = lib
        self._attr = attributor
        self._node = node
        self._targets = list(self._iter_targets(devices))
        self._last_seen: dict[str, int] = {}
        self._util_supported: dict[str, bool] = {}
        self.errors: Counter[str] = Counter()
        self.families = PROCESS_FAMILIES
        # (namespace, pod, container) -> UUIDs of the GPUs its processes ran on in the last
        # pass (edge_agent.collect_alloc: which GPU a GPU-memory request landed on)
        self.pod_gpus: dict[tuple[str, str, str], set[str]] = {}

    @staticmethod
    def _iter_targets(devices: Sequence[GpuDevice]) -> Iterator[_Target]:
        for dev in devices:
            if dev.mig:
                for inst in dev.mig:
                    yield _Target(dev, inst.handle, inst.uuid, str(inst.gpu_instance_id))
            else:
                yield _Target(dev, dev.handle, dev.uuid, "")

    def collect(self, sink: SampleSink) -> None:
        for fam in self.families:
            sink.declare(fam)
        containers: dict[tuple[Labels, str], list[float]] = {}
        self.pod_gpus = {}
        for target in self._targets:
            try:
                procs = self._processes(target.handle)
            except pynvml.NVMLError as exc:
                self.errors[type(exc).__name__] += 1
                continue
            utils = self._utilisation(target)
            for proc in procs:
                self._emit(target, proc, utils.get(proc.pid), sink, containers)
        for (clabels, _), (mem, sm, count) in containers.items():
            sink.add("DCGM_CUSTOM_CONTAINER_MEM_USED", clabels, mem)
            if sm >= 0:
                sink.add("DCGM_CUSTOM_CONTAINER_SM_UTIL", clabels, sm)
            sink.add("DCGM_CUSTOM_CONTAINER_PROCESSES", clabels, count)

    def _processes(self, handle: Handle) -> list[_Proc]:
        merged: dict[int, _Proc] = {}
        lists: tuple[tuple[str, list[Any]], ...] = (
            ("C", self._lib.nvmlDeviceGetComputeRunningProcesses(handle)),
            ("G", self._lib.nvmlDeviceGetGraphicsRunningProcesses(handle)),
        )
        for kind, items in lists:
            for p in items:
                mem = int(p.usedGpuMemory or 0)
                gi = getattr(p, "gpuInstanceId", None)
                seen = merged.get(p.pid)
                if seen is None:
                    merged[p.pid] = _Proc(int(p.pid), mem, kind, gi)
                else:
                    seen.kind = "C+G"
                    seen.mem_bytes = max(seen.mem_bytes, mem)
        return list(merged.values())

    def _utilisation(self, target: _Target) -> dict[int, Any]:
        """Newest utilisation sample per PID since the last pass; {} when none or unsupported."""
        if self._util_supported.get(target.key) is False:
            return {}
        since = self._last_seen.get(target.key, 0)
        try:
            samples = self._lib.nvmlDeviceGetProcessUtilization(target.handle, since)
        except pynvml.NVMLError_NotFound:  # no sample newer than `since`: all idle
            self._util_supported[target.key] = True
            return {}
        except pynvml.NVMLError_NotSupported:  # MIG instances, older boards
            self._util_supported[target.key] = False
            return {}
        except pynvml.NVMLError as exc:
            self.errors[type(exc).__name__] += 1
            return {}
        self._util_supported[target.key] = True
        newest: dict[int, Any] = {}
        for s in samples:
            prev = newest.get(s.pid)
            if prev is None or s.timeStamp > prev.timeStamp:
                newest[s.pid] = s
            since = max(since, int(s.timeStamp))
        self._last_seen[target.key] = since
        return newest

    def _emit(
        self,
        target: _Target,
        proc: _Proc,
        util: Any,
        sink: SampleSink,
        containers: dict[tuple[Labels, str], list[float]],
    ) -> None:
        a = self._attr.attribute(proc.pid)
        dev = target.dev
        owner: Labels = (
            ("NodeName", self._node),
            ("NamespaceName", a.namespace),
            ("PodName", a.pod_name),
            ("ContainerName", a.k8s_container),
            ("container_id", a.container_id),
            ("container_name", a.container_name),
            ("gpu", str(dev.index)),
            ("UUID", dev.uuid),
            ("GPU_I_ID", target.gpu_instance_id),
        )
        labels = (
            *owner,
            ("ProcessId", str(proc.pid)),
            ("ProcessName", a.process_name),
            ("ProcessType", proc.kind),
        )
        mem_mib = proc.mem_bytes / MIB
        sink.add("DCGM_CUSTOM_PROCESS_MEM_USED", labels, mem_mib)
        sm = -1.0
        if self._util_supported.get(target.key):
            sm = float(util.smUtil) if util is not None else 0.0
            sink.add("DCGM_CUSTOM_PROCESS_SM_UTIL", labels, sm)
            sink.add(
                "DCGM_CUSTOM_PROCESS_MEM_COPY_UTIL",
                labels,
                float(util.memUtil) if util is not None else 0.0,
            )
            sink.add(
                "DCGM_CUSTOM_PROCESS_ENCODE_UTIL",
                labels,
                float(util.encUtil) if util is not None else 0.0,
            )
            sink.add(
                "DCGM_CUSTOM_PROCESS_DECODE_UTIL",
                labels,
                float(util.decUtil) if util is not None else 0.0,
            )
        if a.pod_name:
            key = (a.namespace, a.pod_name, a.k8s_container)
            self.pod_gpus.setdefault(key, set()).add(dev.uuid)
        if not a.container_id:
            return  # host process: no container to sum into
        acc = containers.setdefault((owner, a.container_id), [0.0, -1.0, 0.0])
        acc[0] += mem_mib
        if sm >= 0:
            acc[1] = sm if acc[1] < 0 else acc[1] + sm
        acc[2] += 1
