"""The registry's records: one per node, one per series, one block per (family, node).

Plain data with slots, changed only by :class:`cloud_gateway.registry.Registry`; kept in a
module of their own so the registry reads as what it does with them. A block
(:class:`Group`) keeps its values packed and its text as last rendered; the prefixes of
its lines live in that text, so a held series costs its text, a record and its label
tuple (label pairs shared within a node), not a line of its own per value."""

from __future__ import annotations

from array import array
from collections import deque
from itertools import accumulate
from typing import Final

from cloud_gateway.liveness import Arrivals
from cloud_gateway.registry_types import LineFormat, NodeError, NodeState, NodeView
from gpurelay.model import Family, Labels
from gpurelay.wire import Hello


class FamilyState:
    __slots__ = ("blocks", "family", "first_node", "groups", "name_label", "ordered", "refs")

    def __init__(self, family: Family, first_node: str) -> None:
        self.family = family
        self.first_node = first_node
        self.name_label = ("__name__", family.name)  # shared by the family's label tuples
        self.groups: dict[str, Group] = {}  # node -> block of that node's lines
        self.ordered: list[Group] | None = None  # groups by node name
        self.blocks: list[bytes] | None = None  # their bytes, in that order
        self.refs = 0  # series records of this family, live or not


PENDING: Final = 0x80000000  # a start with this bit: the prefix is in Group.pending


class Group:
    """One (family, node) block, compact: its live series, their values packed as
    float64, and the block's text as last rendered, which holds every rendered member's
    ``NAME{labels} `` prefix (a new member's prefix waits in one buffer per block, not
    a bytes object per series). A batch stores values and notes which changed;
    :meth:`render` makes the new text from slices of the old one and formats only the
    changed values (lazily: when a scrape asks, not per batch)."""

    __slots__ = (
        "block",
        "changed",
        "dead",
        "fs",
        "members",
        "pending",
        "plens",
        "starts",
        "text",
        "values",
    )

    def __init__(self, fs: FamilyState) -> None:
        self.fs = fs
        self.members: list[SeriesRecord] = []
        self.values = array("d")  # values[i] is members[i]'s value
        self.text = b""  # the block as last rendered
        self.starts = array("I")  # where members[i]'s line starts in text (or PENDING|at)
        self.plens = array("I")  # the length of members[i]'s prefix
        self.pending: bytearray | None = None  # prefixes of members not yet in text
        self.dead = 0  # bytes of pending that removed members left
        self.changed: set[int] | None = set()  # positions changed since text; None: all
        self.block: bytes | None = None  # text, while it is current

    def add(self, s: SeriesRecord, value: float, prefix: bytes) -> None:
        s.group, s.pos = self, len(self.members)
        self.members.append(s)
        self.values.append(value)
        if self.pending is None:
            self.pending = bytearray()
        self.starts.append(PENDING | len(self.pending))
        self.pending += prefix
        self.plens.append(len(prefix))

    def remove(self, pos: int) -> None:
        pending = self.pending
        if pending is not None and self.starts[pos] & PENDING:
            self.dead += self.plens[pos]
            if self.dead > 65536 and 2 * self.dead > len(pending):  # never scraped: compact
                self.pending, self.dead = bytearray(), 0
                for i, start in enumerate(self.starts):
                    if start & PENDING and i != pos:
                        at = start ^ PENDING
                        self.starts[i] = PENDING | len(self.pending)
                        self.pending += pending[at : at + self.plens[i]]
        del self.members[pos], self.values[pos], self.starts[pos], self.plens[pos]
        for later in self.members[pos:]:
            later.pos -= 1
        self.changed = None  # positions moved: format every value at the next render

    def render(self, lines: LineFormat) -> bytes:
        """The block's new text: when only values changed, the old text in runs between
        them, and those values formatted; else every line made again (a member's prefix
        from the old text or, before its first render, from the pending buffer)."""
        old, starts, plens, values = self.text, self.starts, self.plens, self.values
        value_bytes = lines.value
        changed = self.changed
        pending = self.pending
        if changed is not None and pending is None:
            parts: list[bytes] = []
            shifts: list[tuple[int, int]] = []  # (first member moved, by how much)
            pos = 0  # in old
            index = old.index
            for i in sorted(changed):
                cut = starts[i] + plens[i]
                end = index(b"\n", cut) + 1
                value = value_bytes(values[i])
                parts.append(old[pos:cut])
                parts.append(value)
                if len(value) != end - cut:
                    shifts.append((i + 1, len(value) - end + cut))
                pos = end
            parts.append(old[pos:])
            new_starts = starts
            if shifts:  # most new values have as many digits as the old: nothing moves
                new_starts = starts[: shifts[0][0]]
                shift = 0
                for (first, delta), (last, _) in zip(
                    shifts, [*shifts[1:], (len(starts), 0)], strict=True
                ):
                    shift += delta
                    new_starts.extend(map(shift.__add__, starts[first:last]))
        else:
            parts = []
            for start, plen, v in zip(starts, plens, values, strict=True):
                if start & PENDING:
                    assert pending is not None
                    at = start ^ PENDING
                    parts.append(bytes(pending[at : at + plen]) + value_bytes(v))
                else:
                    parts.append(old[start : start + plen] + value_bytes(v))
            new_starts = array("I", accumulate(map(len, parts), initial=0))
            new_starts.pop()
        self.text = self.block = b"".join(parts)
        self.starts, self.changed, self.pending, self.dead = new_starts, set(), None, 0
        return self.text


class SeriesRecord:
    __slots__ = ("conn", "cost", "fs", "group", "identity", "labels", "pos", "sid")

    def __init__(self, fs: FamilyState, labels: Labels, conn: int, sid: int) -> None:
        self.identity = b""  # set by the registry: series_policy.identity
        self.cost = 0  # label bytes, against the node's budget
        self.fs = fs
        self.labels = labels  # (("__name__", name), *stamped labels): the remote write key
        self.group: Group | None = None  # set while the series has a value
        self.pos = 0  # index in the group
        self.conn = conn
        self.sid = sid

    @property
    def value(self) -> float | None:
        g = self.group
        return None if g is None else g.values[self.pos]


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
        self.series: dict[bytes, SeriesRecord] = {}
        self.pairs: dict[tuple[str, str], tuple[str, str]] = {}  # label pairs, shared
        self.label_bytes = 0  # of those records
        self.groups: dict[str, Group] = {}  # family name -> group
        self.tracked: set[SeriesRecord] = set()  # of the tracked families

    def shared(self, labels: Labels) -> Labels:
        """``labels`` made of the node's shared label pairs (a GPU's UUID, model and
        driver are on most of its series: one pair object each, not one per series). The
        table is only a cache: it is emptied when it outgrows the node's series."""
        pairs = self.pairs
        if len(pairs) > 2 * len(self.series) + 4096:
            pairs.clear()
        return tuple([pairs.setdefault(p, p) for p in labels])

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
