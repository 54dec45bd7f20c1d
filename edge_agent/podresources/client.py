"""``List`` on the kubelet's pod-resources socket over gRPC, with a deadline.

Importing this module imports ``grpc``; :mod:`edge_agent.attribute.pod_resources` imports it
only once the socket exists. Every gRPC failure leaves as :class:`PodResourcesError`, whose
``reason`` is the status code in lower case (``unavailable``: nobody listens;
``deadline_exceeded``: the kubelet did not answer in time; ``unimplemented``: a kubelet
without the v1 API, before Kubernetes 1.20).
"""

from __future__ import annotations

from pathlib import Path

import grpc

from edge_agent.errors import PodResourcesError
from edge_agent.podresources import api_pb2, api_pb2_grpc
from edge_agent.podresources.model import ContainerDevices


def target(socket: Path) -> str:
    """The gRPC address of a Unix socket (``unix:`` and an absolute path)."""
    return f"unix:{socket.absolute()}"


def rows(response: api_pb2.ListPodResourcesResponse) -> tuple[ContainerDevices, ...]:
    """One :class:`ContainerDevices` per container and device resource, in the kubelet's order."""
    return tuple(
        ContainerDevices(
            namespace=pod.namespace,
            pod=pod.name,
            container=container.name,
            resource=devices.resource_name,
            device_ids=tuple(devices.device_ids),
        )
        for pod in response.pod_resources
        for container in pod.containers
        for devices in container.devices
    )


class PodResourcesClient:
    """One channel to the kubelet, kept open (gRPC reconnects it when the kubelet restarts)."""

    def __init__(self, socket: Path, *, timeout: float) -> None:
        self.socket = socket
        self.timeout = timeout
        self._channel = grpc.insecure_channel(target(socket))
        self._stub = api_pb2_grpc.PodResourcesListerStub(self._channel)  # type: ignore[no-untyped-call]

    def list(self) -> tuple[ContainerDevices, ...]:
        try:
            response = self._stub.List(api_pb2.ListPodResourcesRequest(), timeout=self.timeout)
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
            details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            raise PodResourcesError(
                code.name.lower(),
                f"kubelet pod-resources List on {self.socket}: {code.name} ({details})",
            ) from exc
        return rows(response)

    def close(self) -> None:
        self._channel.close()
