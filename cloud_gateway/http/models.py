"""The shapes of the gateway's JSON answers, written once: the handlers build their bodies
as these types (mypy refuses a key a model does not declare) and
:mod:`cloud_gateway.http.openapi` derives ``/openapi.json`` from them.

TypedDicts rather than classes: a body is the dict ``json.dumps`` writes, so nothing is
converted on the way out. ``Annotated[T, "text"]`` gives a field its description;
``NotRequired`` marks a key that only some answers carry.
"""

from __future__ import annotations

from typing import Annotated, Literal, NotRequired, TypedDict

from gpurelay.bie import BieDevice, BieNode
from gpurelay.model import GpuInventory

NodeState = Literal["online", "stale", "offline"]
Seconds = Annotated[float, "unix time, seconds"]

__all__ = [
    "BieDevice",
    "BieNode",
    "ErrorBody",
    "Gateway",
    "GatewayList",
    "Gpu",
    "NodeDetail",
    "NodeErrorEntry",
    "NodeList",
    "NodeState",
    "NodeSummary",
    "TargetGroup",
    "gpu",
]


class ErrorBody(TypedDict):
    """Every refusal and error of the JSON endpoints."""

    error: Annotated[str, "what went wrong and, where it helps, what to do; one line"]


class Gpu(TypedDict):
    """One physical GPU as the node's agent reported it at connect."""

    index: int
    uuid: str
    name: Annotated[str, "model name"]
    pci_bus_id: str
    minor: int
    memory_total_bytes: int
    memory_used_bytes: int
    mig_enabled: bool
    healthy: bool


def gpu(g: GpuInventory) -> Gpu:
    return {
        "index": g.index,
        "uuid": g.uuid,
        "name": g.name,
        "pci_bus_id": g.pci_bus_id,
        "minor": g.minor,
        "memory_total_bytes": g.memory_total_bytes,
        "memory_used_bytes": g.memory_used_bytes,
        "mig_enabled": g.mig_enabled,
        "healthy": g.healthy,
    }


class NodeErrorEntry(TypedDict):
    time: Seconds
    message: str


class NodeSummary(TypedDict):
    """A node in ``/api/v1/nodes``. The counters are null for a node another gateway of
    the cluster holds (or one known only from an earlier run's inventory)."""

    published: Annotated[list[str], "host:port endpoints the node publishes through the proxy"]
    name: str
    state: NodeState
    domain: Annotated[str, "the node's domain label (its name when it set none)"]
    gpu_count: int
    gpu_models: list[str]
    agent_version: str
    backend: Annotated[str, "the agent's GPU backend (nvml, simulated, ...)"]
    remote: Annotated[str, "the agent's address as the SSH listener saw it"]
    connected_since: Seconds | None
    last_seen: Seconds | None
    last_seen_seconds_ago: float | None
    last_batch_time: Seconds | None
    interval_seconds: Annotated[float, "the agent's collection interval"]
    series: int | None
    batches_received: int | None
    bytes_received: int | None
    duplicate_batches: int | None
    replayed_batches: int | None
    connection_conflicts: int | None
    certificate_serial: Annotated[int | None, "serial of the node's SSH certificate"]
    certificate_expires: Annotated[
        int | None,
        "unix time the node's SSH certificate expires (valid_before); null: no expiry, "
        "or not known",
    ]
    gateway: NotRequired[Annotated[str, "the owner's gateway id (with [cluster])"]]
    gateway_alive: NotRequired[Annotated[bool, "its owner is a live gateway (not held here)"]]
    first_seen: NotRequired[Annotated[Seconds, "first connect (not held here)"]]
    last_disconnect_reason: NotRequired[str]


class NodeDetail(NodeSummary):
    """``/api/v1/nodes/{node}``: the summary, its GPUs and its recent errors."""

    gpus: list[Gpu]
    recent_errors: Annotated[
        list[NodeErrorEntry], "the latest errors on its connection (empty when not held here)"
    ]


class NodeList(TypedDict):
    now: Annotated[Seconds, "the gateway's clock when it answered"]
    nodes: list[NodeSummary]


class Gateway(TypedDict):
    id: Annotated[str, "gateway_id ('' without [cluster])"]
    advertise: Annotated[str, "its peer listener ('' alone)"]
    alive: bool
    this: Annotated[bool, "the gateway that answered"]
    heartbeat_age_seconds: float
    up_seconds: Annotated[float | None, "since it (re)started; null alone"]
    nodes: Annotated[int, "nodes it holds (0 when not alive: its nodes are offline)"]


class GatewayList(TypedDict):
    gateways: list[Gateway]


class TargetGroup(TypedDict):
    """One Prometheus http_sd target group."""

    targets: list[str]
    labels: dict[str, str]
