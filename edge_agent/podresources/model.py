"""What a ``List`` answer says, as plain data: one row per container and device resource."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"


@dataclass(frozen=True, slots=True, kw_only=True)
class ContainerDevices:
    """The devices of one resource (``nvidia.com/gpu``, …) allocated to one container."""

    namespace: str
    pod: str
    container: str
    resource: str
    device_ids: tuple[str, ...]

    @property
    def owner(self) -> tuple[str, str, str]:
        return (self.namespace, self.pod, self.container)
