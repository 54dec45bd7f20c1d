"""The registry's records: one per node, one per series, one block per (family, node).

Plain data with slots, changed only by :class:`cloud_gateway.registry.Registry`; kept in a
module of their own so the registry reads as what it does with them."""

from __future__ import annotations

from collections import deque

from cloud_gateway.liveness import Arrivals
from cloud_gateway.registry_types import NodeError, NodeState, NodeView
from gpurelay.model import Family, Labels
from gpurelay.wire import Hello


class FamilyState:
    __slots__ = ("blocks", "family", "first_node", "groups", "ordered", "refs")

    def __init__(self, family: Family, first_node: str) -> None:
        self.family = family
        self.first_node = first_node
        self.groups: dict[str, Group] = {}  # node -> block of that node's lines
        self.ordered: list[Group] | None = None  # groups by node name
        self.blocks: list[bytes] | None = None  # their bytes, in that order
        self.refs = 0  # series records of this family, live or not


class Group:
    """One (family, node) block: its live series and their lines, in the same order."""

    __slots__ = ("block", "fs", "lines", "members")

    def __init__(self, fs: FamilyState) -> None:
        self.fs = fs
        self.members: list[SeriesRecord] = []
        self.lines: list[bytes] = []  # lines[i] is members[i].line: a block is one join
        self.block: bytes | None = None


class SeriesRecord:
    __slots__ = (
        "conn",
        "cost",
        "cut",
        "fs",
        "group",
        "identity",
        "labels",
        "line",
        "pos",
        "sid",
        "value",
    )

    def __init__(self, fs: FamilyState, prefix: bytes, labels: Labels, conn: int, sid: int) -> None:
        self.identity: tuple[str, Labels] = ("", ())  # set by the registry
        self.cost = 0  # label bytes, against the node's budget
        self.fs = fs
        self.labels = labels  # (("__name__", name), *stamped labels): the remote write key
        self.line = prefix  # b'NAME{labels} ' until a value arrives, then + b'VALUE\n'
        self.cut = len(prefix)
        self.value: float | None = None
        self.group: Group | None = None  # set while the series has a value
        self.pos = 0  # index in the group
        self.conn = conn
        self.sid = sid


class NodeRecord:
    def __init__(self, name: str, max_errors: int) -> None:
        self.name = name
        self.conn_id = 0
        self.connected = False
        self.remote = ""
        self.hello: Hello | None = None
        self.connected_since: float | None = None
        self.disconnected_at: float | None = None
        self.disconnect_reason = ""
        self.last_batch_time: float | None = None
        self.last_seen: float | None = None
        self.arrivals: Arrivals | None = None  # of the current connection's live batches
        self.state: NodeState = "offline"  # as last published (see Registry.refresh)
        self.batches = self.replays = self.bytes = self.duplicates = 0
        self.conflicts = 0
        self.errors: deque[NodeError] = deque(maxlen=max_errors)
        self.ids: dict[int, SeriesRecord] = {}  # ids of the current connection
        self.rejected: set[int] = set()  # ids of the current connection that were refused
        # every record, bound to the connection or not, by identity (name, sorted labels)
        self.series: dict[tuple[str, Labels], SeriesRecord] = {}
        self.label_bytes = 0  # of those records
        self.groups: dict[str, Group] = {}  # family name -> group
        self.tracked: set[SeriesRecord] = set()  # of the tracked families

    def view(self, state: NodeState) -> NodeView:
        h = self.hello
        return NodeView(
            name=self.name,
            state=state,
            connected_since=self.connected_since,
            last_batch_time=self.last_batch_time,
            last_seen=self.last_seen,
            remote=self.remote,
            agent_version=h.agent_version if h else "",
            domain=h.domain if h else "",
            backend=h.backend if h else "",
            interval_seconds=h.interval_seconds if h else 0.0,
            gpus=h.gpus if h else (),
            series_count=sum(len(g.members) for g in self.groups.values()),
            batches_received=self.batches,
            replays_received=self.replays,
            bytes_received=self.bytes,
            duplicates=self.duplicates,
            recent_errors=tuple(self.errors),
            connection_conflicts=self.conflicts,
            last_disconnect_reason=self.disconnect_reason,
        )
