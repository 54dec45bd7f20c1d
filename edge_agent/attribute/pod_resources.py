"""GPU → container → pod: the kubelet's pod-resources ``List``, resolved and cached.

The device series of an allocated GPU or MIG instance get dcgm-exporter's labels ``pod``,
``namespace``, ``container`` (``pod_name``, ``pod_namespace``, ``container_name`` with
``old_pod_label_names``, as dcgm-exporter's ``--use-old-namespace``), and
:mod:`edge_agent.collect_alloc` turns the same answer into ACK's allocation metrics.

- No socket (not a Kubernetes node): one info line, nothing else; ``grpc`` is never
  imported. The client, and with it ``grpc``, is loaded the first time the socket exists.
- ``List`` runs at most once per ``ttl`` seconds, with a ``timeout`` deadline, in the
  collection thread. A failure is logged once per reason (again after a recovery), counted
  in :attr:`PodDevices.errors` by reason, and the last good answer is kept: while the
  kubelet is down no pod starts or stops on the node. A socket that disappears after it
  was seen counts as ``socket_missing``; a device id no GPU of this node answers to as
  ``unknown_device`` (logged once per id). Nothing here raises into a collection.
- A GPU held by several containers (time-slicing or MPS replicas, ``<id>::<n>``): its
  series carry one container, the first by (namespace, pod, container). dcgm-exporter,
  without ``--kubernetes-virtual-gpus``, keeps whichever the kubelet listed last, an order
  that can change between calls; the first in sorted order keeps a series' labels stable.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from edge_agent.attribute.device_ids import DeviceIndex, Target, is_gpu_resource
from edge_agent.errors import PodResourcesError
from edge_agent.nvml.devices import GpuDevice
from edge_agent.podresources.model import ContainerDevices
from gpurelay.model import Labels

log = logging.getLogger(__name__)

Owner = tuple[str, str, str]  # (namespace, pod, container)
POD_LABELS = ("pod", "namespace", "container")
OLD_POD_LABELS = ("pod_name", "pod_namespace", "container_name")
GPUSHARE_MEMORY = "aliyun.com/gpu-mem"


class Lister(Protocol):
    def list(self) -> tuple[ContainerDevices, ...]: ...
    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Allocations:
    """One ``List`` answer, resolved against this node's GPUs."""

    devices: tuple[tuple[Owner, Target], ...]  # distinct (container, GPU or MIG instance)
    # (container, units of a GPU-memory resource, its GPU when known)
    memory: tuple[tuple[Owner, int, GpuDevice | None], ...]
    unknown: tuple[str, ...]  # device ids of GPU resources that no GPU here answers to


def resolve(
    rows: Sequence[ContainerDevices],
    index: DeviceIndex,
    *,
    gpu_resources: Sequence[str] = (),
    memory_resources: Sequence[str] = (GPUSHARE_MEMORY,),
) -> Allocations:
    """Allocations of GPU resources (by device) and GPU-memory resources (by units).

    Which GPU a gpushare pod got is the scheduler extender's choice, written in the pod's
    annotations; the kubelet picks the memory-unit ids it hands to the plugin from any GPU.
    So the GPU of a memory allocation is known only on a node with one GPU.
    """
    devices: dict[tuple[Owner, tuple[str, int | None]], Target] = {}
    memory: dict[Owner, int] = {}
    unknown: list[str] = []
    for row in rows:
        if row.resource in memory_resources:
            memory[row.owner] = memory.get(row.owner, 0) + len(row.device_ids)
        elif is_gpu_resource(row.resource, gpu_resources):
            for device_id in row.device_ids:
                target = index.resolve(device_id)
                if target is None:
                    unknown.append(device_id)
                else:
                    devices.setdefault((row.owner, target.key), target)
    only = index.devices[0] if len(index.devices) == 1 else None
    return Allocations(
        devices=tuple((owner, target) for (owner, _), target in devices.items()),
        memory=tuple((owner, units, only) for owner, units in memory.items()),
        unknown=tuple(unknown),
    )


def _grpc_lister(socket: Path, timeout: float) -> Lister:
    from edge_agent.podresources.client import PodResourcesClient  # imports grpc

    return PodResourcesClient(socket, timeout=timeout)


class PodDevices:
    """The pod-resources answer for one node's GPUs; see the module docstring."""

    def __init__(
        self,
        socket: Path | None,
        devices: Sequence[GpuDevice],
        *,
        ttl: float = 10.0,
        timeout: float = 1.0,
        gpu_resources: Sequence[str] = (),
        memory_resources: Sequence[str] = (GPUSHARE_MEMORY,),
        old_label_names: bool = False,
        clock: Callable[[], float] = time.monotonic,
        connect: Callable[[Path, float], Lister] = _grpc_lister,
    ) -> None:
        self.socket = socket
        self.index = DeviceIndex(devices)
        self.errors: Counter[str] = Counter()
        self._ttl, self._timeout, self._clock, self._connect = ttl, timeout, clock, connect
        self._gpu_resources = tuple(gpu_resources)
        self._memory_resources = tuple(memory_resources)
        self._names = OLD_POD_LABELS if old_label_names else POD_LABELS
        self._client: Lister | None = None
        self._answer: Allocations | None = None
        self._labels: dict[tuple[str, int | None], Labels] = {}
        self._fetched_at: float | None = None
        self._seen_socket = False
        self._told_absent = False
        self._logged: set[str] = set()
        self._unknown_logged: set[str] = set()
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        """True once the socket was there: from then on the node is a Kubernetes node."""
        return self._seen_socket

    def current(self) -> Allocations | None:
        """The newest good answer (refreshed when older than the TTL), None before any."""
        if self.socket is None:
            return None
        with self._lock:  # the GPUs are read in threads of their own: one refresh for all
            now = self._clock()
            if self._fetched_at is None or now - self._fetched_at >= self._ttl:
                self._fetched_at = now
                try:
                    self._refresh(self.socket)
                except Exception as exc:  # never fail a collection over pod labels
                    self._fail(
                        "unexpected", f"pod-resources: unexpected {type(exc).__name__}: {exc}"
                    )
                    log.debug("pod-resources refresh failed", exc_info=True)
            return self._answer

    def device_labels(self, uuid: str, gpu_instance_id: int | None = None) -> Labels:
        """``pod``, ``namespace``, ``container`` of the GPU (or MIG instance), or ()."""
        self.current()
        return self._labels.get((uuid, gpu_instance_id), ())

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def _refresh(self, socket: Path) -> None:
        if not socket.exists():
            if self._seen_socket:
                self._fail("socket_missing", f"kubelet pod-resources socket {socket} is gone")
            elif not self._told_absent:
                self._told_absent = True
                log.info(
                    "no kubelet pod-resources socket at %s: no pod labels on device series, "
                    "no allocation metrics (not a Kubernetes node?)",
                    socket,
                )
            return
        if not self._seen_socket:
            self._seen_socket = True
            log.info("reading GPU allocations from the kubelet at %s", socket)
        if self._client is None:
            self._client = self._connect(socket, self._timeout)
        try:
            rows = self._client.list()
        except PodResourcesError as exc:
            self._fail(exc.reason, str(exc))
            return
        answer = resolve(
            rows,
            self.index,
            gpu_resources=self._gpu_resources,
            memory_resources=self._memory_resources,
        )
        self._note_unknown(answer.unknown)
        if self._logged:
            log.info("kubelet pod-resources answers again")
            self._logged.clear()
        self._answer = answer
        self._labels = self._device_labels(answer)

    def _device_labels(self, answer: Allocations) -> dict[tuple[str, int | None], Labels]:
        owners: dict[tuple[str, int | None], Owner] = {}
        for owner, target in answer.devices:
            held = owners.get(target.key)
            owners[target.key] = owner if held is None else min(held, owner)
        pod, namespace, container = self._names
        return {
            key: ((pod, o[1]), (namespace, o[0]), (container, o[2])) for key, o in owners.items()
        }

    def _note_unknown(self, unknown: Sequence[str]) -> None:
        if not unknown:
            return
        self.errors["unknown_device"] += len(unknown)
        for device_id in sorted(set(unknown) - self._unknown_logged):
            self._unknown_logged.add(device_id)
            log.warning(
                "pod-resources names device %r, which no GPU on this node answers to "
                "(GPUs: %s): its container gets no GPU",
                device_id,
                ", ".join(d.uuid for d in self.index.devices) or "none",
            )

    def _fail(self, reason: str, message: str) -> None:
        self.errors[reason] += 1
        if reason not in self._logged:
            self._logged.add(reason)
            kept = " (keeping the last answer)" if self._answer is not None else ""
            log.warning("%s%s", message, kept)
