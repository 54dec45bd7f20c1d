"""The registry's records: one per node, one per series, one block per (family, node).

Plain data with slots, changed only by :class:`cloud_gateway.registry.store.Registry`; kept in a
module of their own so the registry reads as what it does with them. A block
(:class:`Group`) keeps its values packed and its lines as one template; the prefixes of
its lines live in that template, so a held series costs its text, a record and its label
tuple (label pairs shared within a node), not a line of its own per value."""

from __future__ import annotations

from array import array
from collections import deque

from cloud_gateway.registry.liveness import Arrivals
from cloud_gateway.registry.types import LineFormat, NodeError, NodeState, NodeView
from gpurelay.model import Family, Labels
from gpurelay.wire import Hello


class FamilyState:
    __slots__ = (
        "challengers",
        "family",
        "first_node",
        "groups",
        "holders",
        "name_label",
        "ordered",
        "version",
    )

    def __init__(self, family: Family, first_node: str) -> None:
        self.family = family
        self.first_node = first_node
        # node -> its series records of this family, live or not (none left: it goes)
        self.holders: dict[str, int] = {}
        self.challengers: dict[str, set[str]] = {}  # another TYPE -> nodes that declared it
        self.name_label = ("__name__", family.name)  # shared by the family's label tuples
        self.groups: dict[str, Group] = {}  # node -> block of that node's lines
        self.ordered: list[Group] | None = None  # groups by node name
        self.version = 0  # bumped with any of its blocks' versions, or its set of blocks


class Group:
    """One (family, node) block, compact: its live series, their values packed as
    float64, and the block as a *template*: every member's ``NAME{labels} `` prefix
    (``%`` doubled) followed by a two-byte slot (``%d``, ``%r`` or ``%s``) and a newline,
    so rendering the block is one ``template % values``, formatted in C. A batch only
    stores values and bumps :attr:`version`; the block is rendered when a scrape asks
    (the rendered bytes are the exposition's to keep, not the registry's). A member's
    slot follows its value's kind (:meth:`LineFormat.kinds`); slots are rewritten only
    when a kind changed (an integral reading that became fractional, a NaN)."""

    __slots__ = ("fs", "kinds", "members", "pending", "slots", "tmpl", "values", "version")

    def __init__(self, fs: FamilyState) -> None:
        self.fs = fs
        self.members: list[SeriesRecord] = []
        self.values = array("d")  # values[i] is members[i]'s value
        self.tmpl = b""  # the block's template
        self.slots = array("I")  # where members[i]'s slot is in tmpl (+ pending)
        self.pending: bytearray | None = None  # lines of new members, not yet in tmpl
        self.kinds: bytes | None = None  # the kinds the slots were made for; None: remake
        self.version = 0  # bumped by every change of the block's text

    def add(self, s: SeriesRecord, value: float, prefix: bytes) -> None:
        s.group, s.pos = self, len(self.members)
        self.members.append(s)
        self.values.append(value)
        if self.pending is None:
            self.pending = bytearray()
        self.pending += prefix.replace(b"%", b"%%")
        self.slots.append(len(self.tmpl) + len(self.pending))
        self.pending += b"%r\n"
        self.kinds = None
        self.version += 1
        self.fs.version += 1

    def _merge(self) -> bytes:
        if self.pending is not None:
            self.tmpl += self.pending
            self.pending = None
        return self.tmpl

    def remove(self, pos: int) -> None:
        tmpl, slots = self._merge(), self.slots
        start = slots[pos - 1] + 3 if pos else 0
        end = slots[pos] + 3
        self.tmpl = tmpl[:start] + tmpl[end:]
        cut = end - start
        slots[pos:] = array("I", [at - cut for at in slots[pos + 1 :]])
        del self.members[pos], self.values[pos]
        for later in self.members[pos:]:
            later.pos -= 1
        if self.kinds is not None:
            self.kinds = self.kinds[:pos] + self.kinds[pos + 1 :]
        self.version += 1
        self.fs.version += 1

    def render(self, lines: LineFormat) -> bytes:
        """The block's text: one ``%`` of the template over the values; the slots are
        remade first where a value's kind changed."""
        values = self.values
        kinds = lines.kinds(values)
        if kinds is None or kinds != self.kinds:
            return self._reslot(lines, kinds)
        return self.tmpl % tuple(values)

    def _reslot(self, lines: LineFormat, kinds: bytes | None) -> bytes:
        """Write each member's slot for its value's kind; values that need text of
        their own (NaN, infinities) are passed as that text."""
        tmpl = bytearray(self._merge())
        args: list[object] = []
        for at, value in zip(self.slots, self.values, strict=True):
            slot, arg = lines.slot(value)
            tmpl[at : at + 2] = slot
            args.append(arg)
        self.tmpl, self.kinds = bytes(tmpl), kinds
        return self.tmpl % tuple(args)

    def prefix(self, pos: int) -> bytes:
        """Member ``pos``'s line prefix, as :meth:`LineFormat.prefix` made it."""
        tmpl = self._merge()
        start = self.slots[pos - 1] + 3 if pos else 0
        return tmpl[start : self.slots[pos]].replace(b"%%", b"%")


class SeriesRecord:
    __slots__ = ("conn", "cost", "fs", "group", "identity", "labels", "pos", "sid")

    def __init__(self, fs: FamilyState, labels: Labels, conn: int, sid: int) -> None:
        self.identity = b""  # set by the registry: series_policy.identity
        self.cost = 0  # label bytes, against the node's budget
        self.fs = fs
        # (("__name__", name), *stamped labels): the remote write key. None once the
        # series' line is in its block's template (read back from there when asked for)
        self.labels: Labels | None = labels
        self.group: Group | None = None  # set while the series has a value
        self.pos = 0  # index in the group
        self.conn = conn
        self.sid = sid

    def read_labels(self, n: NodeRecord, lines: LineFormat) -> Labels:
        """A live series' remote write key, read back from its block's template once
        (then kept: remote write asks for every series on every live batch)."""
        assert self.group is not None
        prefix = self.group.prefix(self.pos)
        labels = self.labels = (self.fs.name_label, *n.shared(lines.labels(prefix)))
        return labels

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
