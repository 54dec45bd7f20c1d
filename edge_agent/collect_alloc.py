"""Allocation collector: ACK's GPU allocation metrics, from the kubelet's pod-resources.

What each container was *given*, next to what its processes use
(:mod:`edge_agent.collect_process`), so that ACK's prometheus-adapter rule
``…_GPU_MEM_USED_RATIO`` (``DCGM_CUSTOM_PROCESS_MEM_USED`` divided by
``DCGM_CUSTOM_CONTAINER_MEM_ALLOCATED``, by namespace and pod) works unchanged:

- ``nvidia.com/gpu`` (and configured names): the whole memory of each allocated GPU;
  ``nvidia.com/mig-*``: the memory of the MIG instance. A GPU a container holds several
  replicas of (time-slicing) counts once for that container.
- ``aliyun.com/gpu-mem`` (ACK GPU sharing, and configured names): one unit per device id,
  ``memory_unit_mib`` MiB each (the gpushare plugin's ``--memory-unit``, GiB by default).
  Which GPU it landed on is the scheduler extender's choice, which pod-resources does not
  carry (see :func:`edge_agent.attribute.pod_resources.resolve`): it is the node's only
  GPU, else the one GPU the container's processes run on (the process collector's
  attribution); until then the series has empty ``gpu``/``UUID`` labels and no GPU's
  ``DCGM_CUSTOM_DEV_FB_ALLOCATED`` counts it.

Nothing is published until the kubelet has answered once, so a box outside Kubernetes
gains no series. ``gpurelay_agent_pod_resources_errors_total{reason}`` counts failures
(see :class:`~edge_agent.attribute.pod_resources.PodDevices`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import pynvml

from edge_agent.attribute.pod_resources import Allocations, Owner, PodDevices
from edge_agent.fields import Probe
from edge_agent.nvml.backend import Handle, NvmlLib
from edge_agent.nvml.devices import GpuDevice
from gpurelay.model import MIB, Family, Labels, SampleSink

MODE_NONE, MODE_EXCLUSIVE, MODE_SHARED = 0, 1, 2

ALLOC_FAMILIES = (
    Family(
        name="DCGM_CUSTOM_CONTAINER_MEM_ALLOCATED",
        type="gauge",
        help="GPU memory allocated to the container (MiB): the whole GPU or MIG instance, "
        "or its GPU memory request under ACK GPU sharing.",
    ),
    Family(
        name="DCGM_CUSTOM_ALLOCATE_MODE",
        type="gauge",
        help="GPU allocation mode of the node: 0 no GPU allocated to a pod, "
        "1 exclusive (whole GPUs or MIG instances), 2 shared (GPU memory requests).",
    ),
    Family(
        name="DCGM_CUSTOM_DEV_FB_TOTAL",
        type="gauge",
        help="Total memory of the GPU (MiB).",
    ),
    Family(
        name="DCGM_CUSTOM_DEV_FB_ALLOCATED",
        type="gauge",
        help="Share of the GPU's memory allocated to containers (0-1).",
    ),
)
ERRORS_FAMILY = Family(
    name="gpurelay_agent_pod_resources_errors_total",
    type="counter",
    help="Failed or unusable answers of the kubelet's pod-resources API, by reason.",
)


class AllocationCollector:
    name = "alloc"

    def __init__(
        self,
        lib: NvmlLib,
        devices: Sequence[GpuDevice],
        pods: PodDevices,
        *,
        node: str,
        memory_unit_mib: int = 1024,
        pod_gpus: Callable[[], Mapping[Owner, set[str]]] = dict,
    ) -> None:
        self._pod_gpus = pod_gpus
        self._lib = lib
        self._devices = list(devices)
        self._pods = pods
        self._node = node
        self._unit_mib = memory_unit_mib
        self._totals: dict[str, int] = {}  # GPU or MIG UUID -> MiB (never changes)
        self._by_uuid = {d.uuid: d for d in devices}
        self.families = (*ALLOC_FAMILIES, ERRORS_FAMILY)

    @property
    def active(self) -> bool:
        """False on a node without the kubelet's socket: no series, not even this stage's."""
        return self._pods.active or bool(self._pods.errors)

    def collect(self, sink: SampleSink) -> None:
        answer = self._pods.current()
        if self._pods.errors:
            sink.declare(ERRORS_FAMILY)
            for reason, n in sorted(self._pods.errors.items()):
                sink.add(ERRORS_FAMILY.name, (("reason", reason),), n)
        if answer is None:
            return
        for fam in ALLOC_FAMILIES:
            sink.declare(fam)
        node = (("NodeName", self._node),)
        mode = MODE_SHARED if answer.memory else MODE_EXCLUSIVE if answer.devices else MODE_NONE
        sink.add("DCGM_CUSTOM_ALLOCATE_MODE", node, mode)
        memory = self._place(answer)
        self._containers(answer, memory, sink)
        self._gpus(answer, memory, sink)

    def _place(self, answer: Allocations) -> list[tuple[Owner, int, GpuDevice | None]]:
        """GPU-memory allocations with their GPU where it is known (see the docstring)."""
        seen = self._pod_gpus()
        placed = []
        for owner, units, known in answer.memory:
            uuids = seen.get(owner, set())
            ran_on = self._by_uuid.get(next(iter(uuids))) if len(uuids) == 1 else None
            placed.append((owner, units * self._unit_mib, known or ran_on))
        return placed

    def _total_mib(self, uuid: str, handle: Handle) -> int | None:
        total = self._totals.get(uuid)
        if total is None:
            try:
                total = Probe(self._lib, handle).memory()[0] // MIB
            except pynvml.NVMLError:
                return None  # lost or unreadable now; asked again next cycle
            self._totals[uuid] = total
        return total

    def _containers(
        self,
        answer: Allocations,
        memory: list[tuple[Owner, int, GpuDevice | None]],
        sink: SampleSink,
    ) -> None:
        mib: dict[tuple[Owner, str, str, str], float] = {}
        for owner, target in answer.devices:
            gpu, mig = target.gpu, target.mig
            total = (
                self._total_mib(gpu.uuid, gpu.handle)
                if mig is None
                else self._total_mib(mig.uuid, mig.handle)
            )
            if total is None:
                continue
            gi = "" if mig is None else str(mig.gpu_instance_id)
            key = (owner, str(gpu.index), gpu.uuid, gi)
            mib[key] = mib.get(key, 0.0) + total
        for owner, size, maybe_gpu in memory:
            key = (owner, *((str(maybe_gpu.index), maybe_gpu.uuid) if maybe_gpu else ("", "")), "")
            mib[key] = mib.get(key, 0.0) + size
        for (owner, gpu_index, uuid, gi), value in mib.items():
            labels: Labels = (
                ("NodeName", self._node),
                ("NamespaceName", owner[0]),
                ("PodName", owner[1]),
                ("ContainerName", owner[2]),
                ("gpu", gpu_index),
                ("UUID", uuid),
                ("GPU_I_ID", gi),
            )
            sink.add("DCGM_CUSTOM_CONTAINER_MEM_ALLOCATED", labels, value)

    def _gpus(
        self,
        answer: Allocations,
        memory: list[tuple[Owner, int, GpuDevice | None]],
        sink: SampleSink,
    ) -> None:
        whole = {t.gpu.uuid for _, t in answer.devices if t.mig is None}
        instances = {t.mig.uuid: t for _, t in answer.devices if t.mig is not None}
        shared: dict[str, int] = {}
        for _, size, maybe_gpu in memory:
            if maybe_gpu is not None:
                shared[maybe_gpu.uuid] = shared.get(maybe_gpu.uuid, 0) + size
        for dev in self._devices:
            total = self._total_mib(dev.uuid, dev.handle)
            if not total:
                continue
            if dev.uuid in whole:
                allocated = float(total)
            else:
                allocated = float(shared.get(dev.uuid, 0))
                for mig_uuid, t in instances.items():
                    if t.gpu.uuid == dev.uuid and t.mig is not None:
                        allocated += self._total_mib(mig_uuid, t.mig.handle) or 0
            labels: Labels = (
                ("NodeName", self._node),
                ("gpu", str(dev.index)),
                ("UUID", dev.uuid),
                ("device", f"nvidia{dev.minor}"),
                ("modelName", dev.name),
            )
            sink.add("DCGM_CUSTOM_DEV_FB_TOTAL", labels, total)
            sink.add("DCGM_CUSTOM_DEV_FB_ALLOCATED", labels, min(allocated / total, 1.0))
