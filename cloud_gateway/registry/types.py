"""The registry's configuration, errors and the values it hands out (pure data).

Kept apart from :mod:`cloud_gateway.registry.store` so that its readers (the HTTP API, the
gateway's own metrics) need not import the store itself."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal, NamedTuple, Protocol, get_args

from cloud_gateway.metrics import FamilySamples, by
from cloud_gateway.registry.config import LivenessPolicy
from gpurelay.model import GpuInventory, Labels
from gpurelay.naming import with_49_names

NodeState = Literal["online", "stale", "offline"]
NODE_STATES: Final[tuple[NodeState, ...]] = get_args(NodeState)  # the one list of them


def state_families(states: Mapping[str, NodeState]) -> list[FamilySamples]:
    """The registry's own metric: nodes known, by state (every state, 0 included)."""
    by_state: dict[str, int] = dict.fromkeys(NODE_STATES, 0)
    for state in states.values():
        by_state[state] += 1
    return [by("gpurelay_gateway_nodes", "state", by_state)]


# Read by the BIE document (cloud_gateway.http.bie), under dcgm-exporter 4.8's or 4.9's names.
FB_FAMILIES = with_49_names(
    frozenset({"DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_RESERVED"})
)


class LineFormat(Protocol):
    """How a series becomes an exposition line: ``prefix(name, labels) + value(v)``; the
    registry stores the bytes and knows nothing of their format. A block is rendered
    from a template, ``prefix`` (``%`` doubled) + ``slot`` per line: ``slot(v)`` is a
    two-byte ``%`` conversion ending the line and what to format with it, and
    ``kinds(values)`` says, in one bulk call, which slot each value needs (``None`` when
    some value needs :meth:`slot` itself: the registry then asks per value)."""

    def prefix(self, name: str, labels: Labels) -> bytes: ...

    def labels(self, prefix: bytes) -> Labels:
        """The labels a :meth:`prefix` was made of, in their order."""
        ...

    def value(self, value: float) -> bytes: ...

    def slot(self, value: float) -> tuple[bytes, object]: ...

    def kinds(self, values: Sequence[float]) -> bytes | None: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreConfig:
    liveness: LivenessPolicy = field(default_factory=LivenessPolicy)  # stale, and gone
    offline_grace: float = 300.0  # seconds offline before a node's series are dropped
    max_series_per_node: int = 50_000
    # Name and label text of a node's series (a 16-GPU box with 8 processes per GPU needs
    # about 0.3 MiB): bounds what one node can make the gateway hold and render.
    max_label_bytes_per_node: int = 4 * 1024 * 1024
    recent_errors: int = 20
    reserved_prefixes: tuple[str, ...] = ("gpurelay_node_", "gpurelay_gateway_")
    tracked_families: frozenset[str] = FB_FAMILIES  # for :meth:`Registry.latest`
    # The host label the gateway stamps (and its own gpurelay_node_* families carry):
    # "Hostname" (dcgm-exporter up to 4.8) or "hostname" (from its PR #655 on); see
    # cloud_gateway.registry.node_labels.
    node_label: str = "Hostname"


class RegistryError(Exception):
    """Base of the registry's errors."""


class StaleConnection(RegistryError):
    """A frame on a connection that is no longer the node's current one: close it."""


@dataclass(frozen=True, slots=True)
class Connected:
    conn_id: int
    replaced: int | None  # the node's previous live connection, which the caller closes


@dataclass(frozen=True, slots=True)
class Rejected:
    id: int
    name: str
    reason: str  # for logs and the API
    code: str = "other"  # a fixed set: cloud_gateway.registry.series_policy.REFUSAL_CODES


@dataclass(frozen=True, slots=True)
class Declared:
    accepted: int
    rejected: tuple[Rejected, ...]
    # families whose HELP this node gave differently from the fleet's (first declaration);
    # the series are kept, under the fleet's HELP: one HELP per family
    help_conflicts: tuple[str, ...] = ()
    # (node, why): nodes whose series of a family were dropped because more nodes declared
    # it with another TYPE (cloud_gateway.registry.family_types); the caller tells them
    lost: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Applied:
    """The outcome of one batch or replay. A duplicate was delivered before (the agent
    sent it again): acknowledge it at once, it must leave the agent's spool too."""

    seq: int
    duplicate: bool
    changed: int = 0  # values that differ from the previous ones
    removed: int = 0
    unknown: int = 0  # ids never declared on this connection (rejected ids not counted)


@dataclass(frozen=True, slots=True)
class NodeError:
    time: float
    message: str


class Liveness(NamedTuple):
    name: str
    state: NodeState  # as of the last Registry.refresh (or connect, batch, disconnect)
    last_seen: float | None
    late_after: float | None  # seconds without a batch before stale; None while offline

    @property
    def up(self) -> bool:
        """Online: connected and sending on time (what ``gpurelay_node_up`` says)."""
        return self.state == "online"


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeView:
    name: str
    state: NodeState
    connected_since: float | None
    last_batch_time: float | None
    last_seen: float | None
    remote: str
    agent_version: str
    domain: str
    backend: str
    interval_seconds: float
    gpus: tuple[GpuInventory, ...]
    series_count: int
    batches_received: int
    replays_received: int
    bytes_received: int
    duplicates: int
    recent_errors: tuple[NodeError, ...]
    last_disconnect_reason: str
    connection_conflicts: int = 0  # two connections fought over the node's certificate
