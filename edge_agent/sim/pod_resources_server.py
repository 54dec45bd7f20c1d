"""A real ``PodResourcesLister`` gRPC server on a Unix socket, answering from plain data.

The simulator runs one so that ``--simulate`` agents see pods holding their simulated GPUs
through the same client, socket and proto as on a Kubernetes node; the tests run one to
check the client against errors, slow answers and every kind of device id. Faults:
:meth:`PodResourcesServer.fail` answers every call with a status code, ``delay`` holds
every answer back (released at :meth:`~PodResourcesServer.stop`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from edge_agent.podresources import api_pb2, api_pb2_grpc
from edge_agent.podresources.client import target
from edge_agent.podresources.model import ContainerDevices


def response(rows: Iterable[ContainerDevices]) -> api_pb2.ListPodResourcesResponse:
    """``rows`` grouped back into pods and containers (first-seen order)."""
    pods: dict[tuple[str, str], dict[str, list[ContainerDevices]]] = {}
    for row in rows:
        pods.setdefault((row.namespace, row.pod), {}).setdefault(row.container, []).append(row)
    return api_pb2.ListPodResourcesResponse(
        pod_resources=[
            api_pb2.PodResources(
                namespace=namespace,
                name=pod,
                containers=[
                    api_pb2.ContainerResources(
                        name=name,
                        devices=[
                            api_pb2.ContainerDevices(
                                resource_name=r.resource, device_ids=list(r.device_ids)
                            )
                            for r in devs
                            if r.resource
                        ],
                    )
                    for name, devs in containers.items()
                ],
            )
            for (namespace, pod), containers in pods.items()
        ]
    )


class _Lister(api_pb2_grpc.PodResourcesListerServicer):
    def __init__(self, owner: PodResourcesServer) -> None:
        self.owner = owner

    def _enter(self, context: Any) -> None:
        owner = self.owner
        with owner.lock:
            owner.calls += 1
            delay, fault = owner.delay, owner.fault
        if delay:
            owner.released.wait(delay)
        if fault is not None:
            context.abort(fault[0], fault[1])

    def List(self, request: Any, context: Any) -> api_pb2.ListPodResourcesResponse:
        self._enter(context)
        with self.owner.lock:
            return response(self.owner.rows)

    def GetAllocatableResources(
        self, request: Any, context: Any
    ) -> api_pb2.AllocatableResourcesResponse:
        self._enter(context)
        with self.owner.lock:
            allocatable = self.owner.allocatable
        return api_pb2.AllocatableResourcesResponse(
            devices=[
                api_pb2.ContainerDevices(resource_name=name, device_ids=list(ids))
                for name, ids in allocatable
            ]
        )

    def Get(self, request: Any, context: Any) -> api_pb2.GetPodResourcesResponse:
        self._enter(context)
        with self.owner.lock:
            rows = [
                r
                for r in self.owner.rows
                if (r.namespace, r.pod) == (request.pod_namespace, request.pod_name)
            ]
        if not rows:
            context.abort(grpc.StatusCode.NOT_FOUND, "pod not found")
        return api_pb2.GetPodResourcesResponse(pod_resources=response(rows).pod_resources[0])


class PodResourcesServer:
    """Serves ``rows`` (and ``allocatable``: (resource, device ids) pairs) on ``socket``."""

    def __init__(
        self,
        socket: Path,
        rows: Sequence[ContainerDevices] = (),
        *,
        allocatable: Sequence[tuple[str, Sequence[str]]] = (),
    ) -> None:
        self.socket = socket
        self.lock = threading.Lock()
        self.rows = tuple(rows)
        self.allocatable = tuple((name, tuple(ids)) for name, ids in allocatable)
        self.calls = 0
        self.delay = 0.0
        self.fault: tuple[grpc.StatusCode, str] | None = None
        self.released = threading.Event()
        self._server: Any = None

    def start(self) -> PodResourcesServer:
        self.released.clear()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        add = api_pb2_grpc.add_PodResourcesListerServicer_to_server
        add(_Lister(self), server)  # type: ignore[no-untyped-call]
        if not server.add_insecure_port(target(self.socket)):
            raise OSError(f"cannot listen on {self.socket}")
        server.start()
        self._server = server
        return self

    def set_rows(self, rows: Sequence[ContainerDevices]) -> None:
        with self.lock:
            self.rows = tuple(rows)

    def fail(self, code: grpc.StatusCode | None, details: str = "injected fault") -> None:
        """Answer every call with ``code`` from now on (None: answer normally again)."""
        with self.lock:
            self.fault = None if code is None else (code, details)

    def stop(self) -> None:
        self.released.set()
        if self._server is not None:
            self._server.stop(grace=None).wait(5)
            self._server = None
        self.socket.unlink(missing_ok=True)
