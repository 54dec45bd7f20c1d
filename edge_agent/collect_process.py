"""Process collector: per-process GPU memory and SM utilisation, attributed to containers.

For every GPU (or each MIG instance of a MIG GPU) the running compute and graphics
processes are listed, their utilisation samples since the last pass are read with
``nvmlDeviceGetProcessUtilization(handle, last_seen)``, and each PID is attributed to its
container and pod. Output uses the ACK names (``DCGM_CUSTOM_PROCESS_*``) plus per-container
sums (``DCGM_CUSTOM_CONTAINER_*``).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import pynvml

from edge_agent.attribute import Attribution
from edge_agent.degraded import Degraded
from edge_agent.nvml.backend import Handle, NvmlLib
from edge_agent.nvml.devices import GpuDevice
from edge_agent.nvml.guard import GpuGuard, Stalled
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
    mem_bytes: int | None  # None: NVML_VALUE_NOT_AVAILABLE (pynvml's None), not measured
    kind: str  # "C", "G" or "C+G"
    gpu_instance_id: int | None


@dataclass(frozen=True, slots=True)
class _Target:
    """One place whose processes we list: a whole GPU, or one MIG GPU instance (all of its
    compute instances' MIG devices)."""

    dev: GpuDevice
    handles: tuple[Handle, ...]
    key: str
    gpu_instance_id: str

    @property
    def handle(self) -> Handle:
        return self.handles[0]

    @property
    def part(self) -> str:
        return f" of GPU instance {self.gpu_instance_id}" if self.gpu_instance_id else ""


_Read = tuple[list[_Proc] | None, dict[int, Any] | None]  # processes, their utilisation


class _ListUnavailable(Exception):
    """Neither the _v3 nor the _v2 process-list symbol exists in this driver's NVML."""


# pynvml sizes a list, then fetches it; a process that starts in between makes the fetch
# answer INSUFFICIENT_SIZE. DCGM retries that at once (up to 100 times for process
# utilisation); a handful is plenty when nothing else is wrong.
SIZE_RETRIES = 5
_UNVERSIONED = {
    "C": ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetComputeRunningProcesses_v2"),
    "G": ("nvmlDeviceGetGraphicsRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses_v2"),
}


class ProcessCollector:
    name = "process"

    def __init__(
        self,
        lib: NvmlLib,
        devices: Sequence[GpuDevice],
        attributor: AttributorLike,
        *,
        node: str,
        degraded: Degraded | None = None,
        guard: GpuGuard | None = None,
        deadline_seconds: float = 5.0,
    ) -> None:
        self._lib = lib
        self.guard = guard or GpuGuard()  # the device collector's: one thread per GPU
        self.deadline_seconds = deadline_seconds
        self._attr = attributor
        self._node = node
        self._targets = list(self._iter_targets(devices))
        self._last_seen: dict[str, int] = {}
        self._util_supported: dict[str, bool] = {}
        self._v2_only = False  # the driver lacks the _v3 process calls (NVML < 11.6)
        self.degraded = degraded or Degraded()
        self._lock = threading.Lock()
        self.errors: Counter[str] = Counter()
        self.families = PROCESS_FAMILIES
        # (namespace, pod, container) -> UUIDs of the GPUs its processes ran on in the last
        # pass (edge_agent.collect_alloc: which GPU a GPU-memory request landed on)
        self.pod_gpus: dict[tuple[str, str, str], set[str]] = {}
        # The allow-listed labels and annotations of a pod (namespace, name): the pipeline
        # sets it to PodMetadata.labels when [kubernetes] lists some.
        self.pod_metadata: Callable[[str, str], Labels] = lambda _namespace, _pod: ()

    @staticmethod
    def _iter_targets(devices: Sequence[GpuDevice]) -> Iterator[_Target]:
        for dev in devices:
            if dev.mig:
                for inst in dev.mig:
                    handles = inst.handles or (inst.handle,)
                    yield _Target(dev, handles, inst.uuid, str(inst.gpu_instance_id))
            elif not dev.mig_enabled:
                yield _Target(dev, (dev.handle,), dev.uuid, "")
            # MIG on but no instance could be listed: processes live in the instances

    def collect(self, sink: SampleSink) -> None:
        for fam in self.families:
            sink.declare(fam)
        containers: dict[tuple[Labels, str], ContainerSums] = {}
        self.pod_gpus = {}
        results = self.guard.each(  # in the GPUs' worker, against a deadline
            [(t.dev.uuid, partial(self._read, t)) for t in self._targets], self.deadline_seconds
        )
        for target, result in zip(self._targets, results, strict=True):
            if isinstance(result, Stalled):
                self.degraded.report(
                    str(target.dev.index), "nvml_calls", f"{result}; its processes are left out"
                )
                continue
            if isinstance(result, BaseException):
                raise result
            procs, utils = result
            for proc in procs or ():
                self._emit(target, proc, utils, sink, containers)
        add_container_sums(sink, containers)

    def _read(self, target: _Target) -> _Read:
        procs = self._processes(target)
        return procs, (None if procs is None else self._utilisation(target))

    def _count(self, error: str) -> None:
        with self._lock:
            self.errors[error] += 1

    def _list(self, kind: str, handle: Handle) -> list[Any]:
        """One process list, on the symbols this driver has, retrying a sizing race."""
        unversioned, v2 = _UNVERSIONED[kind]
        for attempt in range(SIZE_RETRIES + 1):
            try:
                if not self._v2_only:
                    try:
                        return list(getattr(self._lib, unversioned)(handle))
                    except pynvml.NVMLLibraryMismatchError:
                        log.info(
                            "the driver's NVML has no _v3 process calls (older than 11.6, "
                            "R470-R495): using the _v2 ones"
                        )
                        self._v2_only = True
                try:
                    return list(getattr(self._lib, v2)(handle))
                except pynvml.NVMLError_FunctionNotFound as exc:
                    raise _ListUnavailable(
                        "the driver's NVML has neither the _v3 nor the _v2 process calls"
                    ) from exc
            except pynvml.NVMLError_InsufficientSize:
                if attempt == SIZE_RETRIES:
                    raise
        raise AssertionError("unreachable")

    def _processes(self, target: _Target) -> list[_Proc] | None:
        """The processes of ``target`` (None: its compute processes could not be listed).

        The graphics list is asked separately: a board or container that refuses it
        (NOT_SUPPORTED, NO_PERMISSION) still has its compute processes reported."""
        gpu = str(target.dev.index)
        merged: dict[int, _Proc] = {}
        for kind in ("C", "G"):
            part = ("process_list" if kind == "C" else "graphics_process_list") + target.part
            items: list[Any] = []
            try:
                for handle in target.handles:
                    items += self._list(kind, handle)
            except _ListUnavailable as exc:
                self._count("FunctionNotFound")
                self.degraded.report(gpu, part, str(exc))
                if kind == "C":
                    return None
                continue
            except pynvml.NVMLError as exc:
                self._count(type(exc).__name__)
                self.degraded.report(gpu, part, str(exc))
                if kind == "C":
                    return None
                continue
            self.degraded.clear(gpu, part)
            for p in items:
                self._merge(merged, kind, p)
        return list(merged.values())

    @staticmethod
    def _merge(merged: dict[int, _Proc], kind: str, p: Any) -> None:
        mem = None if p.usedGpuMemory is None else int(p.usedGpuMemory)
        seen = merged.get(int(p.pid))
        if seen is None:
            gi = getattr(p, "gpuInstanceId", None)
            merged[int(p.pid)] = _Proc(int(p.pid), mem, kind, gi)
            return
        if seen.kind not in (kind, "C+G"):
            seen.kind = "C+G"
        if mem is not None:  # one compute instance, or the other list, may know it
            seen.mem_bytes = mem if seen.mem_bytes is None else max(seen.mem_bytes, mem)

    def _utilisation(self, target: _Target) -> dict[int, Any] | None:
        """Newest utilisation sample per PID since the last pass: {} when NVML has none
        newer (every process idle), None when it was not measured (unsupported, or failed
        this pass: then no utilisation series is published, never a 0)."""
        gpu, part = str(target.dev.index), "process_utilization" + target.part
        if self._util_supported.get(target.key) is False:
            return None
        since = self._last_seen.get(target.key, 0)
        for attempt in range(SIZE_RETRIES + 1):
            try:
                samples = self._lib.nvmlDeviceGetProcessUtilization(target.handle, since)
                break
            except pynvml.NVMLError_InsufficientSize as exc:  # a process started meanwhile
                if attempt < SIZE_RETRIES:
                    continue
                self._count(type(exc).__name__)
                self.degraded.report(gpu, part, f"{exc} after {SIZE_RETRIES} retries")
                return None
            except pynvml.NVMLError_NotFound:  # no sample newer than `since`: all idle
                self._util_supported[target.key] = True
                self.degraded.clear(gpu, part)
                return {}
            except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
                self._util_supported[target.key] = False  # MIG instances, older boards
                return None
            except pynvml.NVMLError as exc:
                self._count(type(exc).__name__)
                self.degraded.report(gpu, part, str(exc))
                return None
        self._util_supported[target.key] = True
        self.degraded.clear(gpu, part)
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
        utils: dict[int, Any] | None,
        sink: SampleSink,
        containers: dict[tuple[Labels, str], ContainerSums],
    ) -> None:
        a = self._attr.attribute(proc.pid)
        dev = target.dev
        pod = self.pod_metadata(a.namespace, a.pod_name) if a.pod_name else ()
        owner = owner_labels(self._node, a, (str(dev.index), dev.uuid, target.gpu_instance_id), pod)
        labels = process_labels(owner, proc.pid, a, proc.kind)
        mem_mib = None if proc.mem_bytes is None else proc.mem_bytes / MIB
        if mem_mib is not None:
            sink.add("DCGM_CUSTOM_PROCESS_MEM_USED", labels, mem_mib)
        sm: float | None = None
        if utils is not None:  # measured: a process without a newer sample was idle
            util = utils.get(proc.pid)
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
        sums = containers.get((owner, a.container_id))
        if sums is None:
            sums = ContainerSums(0.0, 0.0 if sm is not None else None)
            containers[(owner, a.container_id)] = sums
        sums.add(mem_mib, sm)


def owner_labels(node: str, a: Attribution, gpu: tuple[str, str, str], pod: Labels = ()) -> Labels:
    """Who a GPU process belongs to, on which GPU (index, UUID, GPU instance): the labels
    of the per-container sums, and the first of each process's (ACK's names, then the
    runtime's own container labels)."""
    index, uuid, gpu_instance_id = gpu
    return (
        ("NodeName", node),
        ("NamespaceName", a.namespace),
        ("PodName", a.pod_name),
        ("ContainerName", a.k8s_container),
        ("container_id", a.container_id),
        ("container_name", a.container_name),
        ("gpu", index),
        ("UUID", uuid),
        ("GPU_I_ID", gpu_instance_id),
        *pod,
    )


def process_labels(owner: Labels, pid: int, a: Attribution, kind: str) -> Labels:
    return (*owner, ("ProcessId", str(pid)), ("ProcessName", a.process_name), ("ProcessType", kind))


def add_container_sums(
    sink: SampleSink, containers: Mapping[tuple[Labels, str], ContainerSums]
) -> None:
    """``DCGM_CUSTOM_CONTAINER_*``: each container's sums on each GPU."""
    for (labels, _), sums in containers.items():
        if sums.mem is not None:
            sink.add("DCGM_CUSTOM_CONTAINER_MEM_USED", labels, sums.mem)
        if sums.sm is not None:
            sink.add("DCGM_CUSTOM_CONTAINER_SM_UTIL", labels, sums.sm)
        sink.add("DCGM_CUSTOM_CONTAINER_PROCESSES", labels, sums.count)


@dataclass(slots=True)
class ContainerSums:
    """A container's sums on one GPU; None once one of its processes was not measured (a
    sum missing a part is not published)."""

    mem: float | None
    sm: float | None
    count: int = 0

    def add(self, mem_mib: float | None, sm: float | None) -> None:
        self.count += 1
        self.mem = None if self.mem is None or mem_mib is None else self.mem + mem_mib
        self.sm = None if self.sm is None or sm is None else self.sm + sm
