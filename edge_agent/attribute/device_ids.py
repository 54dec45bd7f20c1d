"""Device-plugin ids → the GPU or MIG instance the agent knows. Pure.

What the kubelet reports is whatever id the device plugin advertised:

=========================================  ===============================================
``GPU-<uuid>``                             NVIDIA's plugin (default ``uuid`` strategy)
``MIG-<uuid>``, ``MIG-GPU-<uuid>/<gi>/<ci>`` a MIG instance (R470+ and older drivers)
``<id>::<n>``                              replica ``n`` of a time-sliced or MPS-shared
                                           device (``sharing.timeSlicing`` in the plugin)
``<n>``                                    a GPU index (plugins that advertise indices)
``nvidia<n>``, ``nvidia<n>/gi<g>``         GKE's plugin: device minor, MIG GPU instance
``nvidia<n>/vgpu<k>``                      GKE's time-shared GPUs
``<GPU uuid>-_-<n>``                       ACK's gpushare plugin: unit ``n`` of the GPU
                                           memory resource (``aliyun.com/gpu-mem``)
=========================================  ===============================================

dcgm-exporter (``internal/pkg/transformation/kubernetes.go``) understands the same forms.
An id none of the node's GPUs answers to resolves to ``None``: the caller counts it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from edge_agent.nvml.devices import GpuDevice, MigInstance

NVIDIA_GPU = "nvidia.com/gpu"
NVIDIA_MIG_PREFIX = "nvidia.com/mig-"  # mixed strategy: nvidia.com/mig-1g.10gb, …
GPUSHARE_SEPARATOR = "-_-"

_GKE = re.compile(r"^nvidia(\d+)(?:/gi(\d+))?(?:/vgpu\d+)?$")
_OLD_MIG = re.compile(r"^MIG-(GPU-[0-9a-fA-F-]+)/(\d+)/\d+$")


@dataclass(frozen=True, slots=True)
class Target:
    """A whole GPU (``mig`` None) or one of its MIG instances."""

    gpu: GpuDevice
    mig: MigInstance | None = None

    @property
    def key(self) -> tuple[str, int | None]:
        return (self.gpu.uuid, None if self.mig is None else self.mig.gpu_instance_id)


class DeviceIndex:
    """The node's GPUs and MIG instances by every name a device plugin may use."""

    def __init__(self, devices: Sequence[GpuDevice]) -> None:
        self.devices = tuple(devices)
        self._by_uuid = {d.uuid: d for d in devices}
        self._by_index = {str(d.index): d for d in devices}
        self._by_minor = {d.minor: d for d in devices}
        self._mig = {
            uuid: Target(d, m) for d in devices for m in d.mig for uuid in (m.uuids or (m.uuid,))
        }

    def _instance(self, gpu: GpuDevice | None, gi: int) -> Target | None:
        if gpu is None:
            return None
        for m in gpu.mig:
            if m.gpu_instance_id == gi:
                return Target(gpu, m)
        return None

    def resolve(self, device_id: str) -> Target | None:
        """The GPU or MIG instance ``device_id`` names on this node, or None."""
        base = device_id.partition("::")[0]
        if base.startswith("MIG-"):
            found = self._mig.get(base)
            if found is not None:
                return found
            old = _OLD_MIG.match(base)
            return self._instance(self._by_uuid.get(old[1]), int(old[2])) if old else None
        if base.startswith("GPU-"):
            gpu = self._by_uuid.get(base)
            return None if gpu is None else Target(gpu)
        if base.isascii() and base.isdigit() and len(base) <= 9:  # "²".isdigit(): int() fails
            gpu = self._by_index.get(str(int(base)))
            return None if gpu is None else Target(gpu)
        gke = _GKE.match(base)
        if gke:
            gpu = self._by_minor.get(int(gke[1]))
            if gke[2] is None:
                return None if gpu is None else Target(gpu)
            return self._instance(gpu, int(gke[2]))
        return None

    def gpushare_gpu(self, device_id: str) -> GpuDevice | None:
        """The GPU a gpushare memory unit id is named after (not necessarily the GPU the
        scheduler bound the pod to: see :mod:`edge_agent.collect_alloc`)."""
        uuid, sep, unit = device_id.rpartition(GPUSHARE_SEPARATOR)
        return self._by_uuid.get(uuid) if sep and unit.isdigit() else None


def is_gpu_resource(name: str, extra: Sequence[str] = ()) -> bool:
    """``nvidia.com/gpu``, ``nvidia.com/mig-*`` or one of the configured names."""
    return name == NVIDIA_GPU or name.startswith(NVIDIA_MIG_PREFIX) or name in extra
