"""The node registry: who is connected, what each node declared, and the latest values.

Pure: no sockets, no clocks (every method that needs the time takes ``now``), no logging.
The SSH server calls it as frames arrive; the exposition and the HTTP API read it.

Node stamping (:mod:`cloud_gateway.registry.node_labels`) happens once, when a series is declared
(the wire decoder validated it: :mod:`gpurelay.wire.rules`; the registry adds only the
gateway's policy). Series live in (family, node) blocks
(:class:`cloud_gateway.registry.records.Group`): packed float64 values and a template of
the lines (prefixes made by the :class:`LineFormat` the registry is given, from the
stage that owns the text format). A batch only stores values and bumps versions; a scrape
renders a changed block (one ``%`` of its template) and the exposition keeps the text.

Series ids belong to a connection; series *records* belong to the node. A reconnecting
agent re-declares its series and they bind to the existing records (same name and
labels), so the latest values stay exposed across a reconnect; a ``full`` batch then
drops whatever it does not list.

Which seqs are duplicates is decided by :mod:`cloud_gateway.ingest.delivery`; the registry is
told, and counts them. Live BATCH frames are the newest data and set the exposed values
(a duplicate only fills series that have no value yet); REPLAY frames (older, spooled
collections) never touch them: they only go on to remote write. :meth:`Registry.samples`
gives a node's full current state, for writing each live collection as one sample per
series.
"""

from __future__ import annotations

from bisect import insort

from cloud_gateway.registry import family_types
from cloud_gateway.registry import series_policy as policy
from cloud_gateway.registry.liveness import Arrivals
from cloud_gateway.registry.node_labels import NODE_LABELS, stamp_node
from cloud_gateway.registry.reads import RegistryReads
from cloud_gateway.registry.records import FamilyState, Group, NodeRecord, SeriesRecord
from cloud_gateway.registry.types import (
    FB_FAMILIES,
    Applied,
    Connected,
    Declared,
    LineFormat,
    Liveness,
    NodeError,
    NodeState,
    NodeView,
    RegistryError,
    Rejected,
    StaleConnection,
    StoreConfig,
)
from gpurelay.families import known
from gpurelay.model import Labels
from gpurelay.wire import Batch, Declare, Hello, SeriesDecl

__all__ = [
    "FB_FAMILIES",
    "NODE_LABELS",
    "Applied",
    "Connected",
    "Declared",
    "LineFormat",
    "Liveness",
    "NodeError",
    "NodeState",
    "NodeView",
    "Registry",
    "RegistryError",
    "Rejected",
    "StaleConnection",
    "StoreConfig",
    "stamp_node",
]


class Registry(RegistryReads):
    """The registry's changes; what it is asked is :class:`RegistryReads`'."""

    def __init__(
        self, config: StoreConfig | None = None, *, lines: LineFormat | None = None
    ) -> None:
        if lines is None:  # the Prometheus text format, from the stage that owns it
            from cloud_gateway.registry.lines import TEXT_LINES

            lines = TEXT_LINES
        self.config = config or StoreConfig()
        self.lines = lines
        self.generation = 0  # bumped by every change that alters the exposition
        self.blocks_rendered = 0
        self._nodes: dict[str, NodeRecord] = {}
        self._names: list[str] = []  # sorted
        self._families: dict[str, FamilyState] = {}
        self._family_order: list[FamilyState] | None = None
        self._last_conn = 0

    # --- connections ---------------------------------------------------------------

    def connect(self, node: str, *, remote: str, hello: Hello, now: float) -> Connected:
        n = self._node(node)
        replaced = n.conn_id if n.connected else None
        self._last_conn += 1
        n.conn_id, n.connected, n.remote, n.hello = self._last_conn, True, remote, hello
        n.connected_since = n.last_seen = now
        n.disconnected_at = None
        n.ids, n.rejected = {}, set()
        n.arrivals = Arrivals(hello.interval_seconds, now)
        n.state = "online"
        self.generation += 1
        return Connected(n.conn_id, replaced)

    def disconnect(self, node: str, conn_id: int, *, now: float, reason: str) -> None:
        n = self._nodes.get(node)
        if n is None or not n.connected or n.conn_id != conn_id:
            return  # an older connection that a newer one already replaced
        n.connected, n.disconnected_at, n.disconnect_reason = False, now, reason
        n.ids, n.rejected = {}, set()
        n.arrivals, n.state = None, "offline"
        self.generation += 1

    def record_error(self, node: str, message: str, now: float) -> None:
        self._node(node).errors.append(NodeError(now, message))

    def record_conflict(self, node: str, message: str, now: float) -> None:
        """Two connections fought over the node's certificate (see cloud_gateway.ssh.conflicts)."""
        n = self._node(node)
        n.conflicts += 1
        n.errors.append(NodeError(now, message))

    def forget(self, node: str) -> None:
        """The node is another gateway's now: its series and its own families go at once."""
        n = self._nodes.pop(node, None)
        if n is not None:
            self._drop_all(n)
            self._names.remove(node)
            self.generation += 1

    def live_connection(self, node: str) -> tuple[int, str] | None:
        """The node's live connection (id, peer address); ``None`` when it has none."""
        n = self._nodes.get(node)
        return (n.conn_id, n.remote) if n is not None and n.connected else None

    # --- series and values ---------------------------------------------------------

    def declare(self, node: str, conn_id: int, decl: Declare) -> Declared:
        n = self._current(node, conn_id)
        rejected: list[Rejected] = []
        other_help = {  # a catalogued family's HELP is the catalogue's, not the node's
            sd.name
            for sd in decl.series
            if (fs := self._families.get(sd.name)) is not None
            and fs.family.help != sd.help
            and known(sd.name) is None
        }
        lost: list[tuple[str, str]] = []
        for sd in decl.series:
            refusal = self._declare_one(n, sd, lost)
            if refusal is not None:
                n.rejected.add(sd.id)
                rejected.append(Rejected(sd.id, sd.name, refusal.message, refusal.code))
        return Declared(
            len(decl.series) - len(rejected),
            tuple(rejected),
            tuple(sorted(other_help)),
            tuple(lost),
        )

    def apply(
        self,
        node: str,
        conn_id: int,
        batch: Batch,
        *,
        now: float,
        size_bytes: int,
        duplicate: bool = False,
    ) -> Applied:
        """Store a live batch's values. ``duplicate``: delivery saw its seq before (a
        restarted agent, a lost ACK): it only fills series that have no value yet."""
        n = self._current(node, conn_id)
        n.batches += 1
        n.bytes += size_bytes
        n.last_seen = n.last_batch_time = now
        if n.arrivals is not None:
            n.arrivals.arrived(now)
        n.state = "online"  # a late node that sends again is on time again
        self.generation += 1  # last_seen changed, at least
        if duplicate:
            n.duplicates += 1
            self._set(n, batch.values, only_new=True)  # fill series that have no value yet
            return Applied(seq=batch.seq, duplicate=True)
        changed, unknown = self._set(n, batch.values, only_new=False)
        ids = n.ids
        gone = dict.fromkeys(ids[sid] for sid in batch.removed if sid in ids)
        if batch.full:
            listed = {ids[sid] for sid, _ in batch.values if sid in ids}
            gone.update(dict.fromkeys(s for s in n.series.values() if s not in listed))
        for s in gone:
            self._remove(n, s)
        return Applied(
            seq=batch.seq, duplicate=False, changed=changed, removed=len(gone), unknown=unknown
        )

    def replay(
        self,
        node: str,
        conn_id: int,
        seq: int,
        *,
        now: float,
        size_bytes: int,
        duplicate: bool = False,
    ) -> Applied:
        """Account for one REPLAY frame; the exposed values are never touched (a replay
        is older than what the live batches set)."""
        n = self._current(node, conn_id)
        n.replays += 1
        n.bytes += size_bytes
        n.last_seen = now
        self.generation += 1  # last_seen changed
        if duplicate:
            n.duplicates += 1
        return Applied(seq=seq, duplicate=duplicate)

    def expire(self, now: float) -> list[str]:
        """Drop the series of nodes offline for longer than the grace; keep the nodes."""
        expired = []
        for n in self._nodes.values():
            gone = (
                n.disconnected_at is not None
                and now - n.disconnected_at > self.config.offline_grace
            )
            if gone and n.series:
                self._drop_all(n)
                expired.append(n.name)
        if expired:
            self.generation += 1
        return expired

    def refresh(self, now: float) -> list[tuple[str, NodeState]]:
        """Publish the states that time changed (online nodes that became late): the
        nodes that changed and their new state. Called on the gateway's tick."""
        changed = []
        for name in self._names:
            n = self._nodes[name]
            state = self._state(n, now)
            if state != n.state:
                n.state = state
                changed.append((name, state))
        if changed:
            self.generation += 1
        return changed

    # --- internals -----------------------------------------------------------------

    def _node(self, name: str) -> NodeRecord:
        n = self._nodes.get(name)
        if n is None:
            n = self._nodes[name] = NodeRecord(name, self.config.recent_errors)
            insort(self._names, name)
            self.generation += 1  # a gpurelay_node_up line more
        return n

    def _current(self, node: str, conn_id: int) -> NodeRecord:
        n = self._nodes.get(node)
        if n is None or not n.connected or n.conn_id != conn_id:
            raise StaleConnection(f"connection {conn_id} of node {node!r} is not current")
        return n

    def _set(
        self, n: NodeRecord, values: tuple[tuple[int, float], ...], *, only_new: bool
    ) -> tuple[int, int]:
        """Store values, note which changed, dirty their blocks: (changed, unknown). No
        formatting here: a dirty block formats its changed values when it is rendered."""
        ids = n.ids
        dirty: set[Group] = set()
        changed = unknown = 0
        for sid, raw in values:
            s = ids.get(sid)
            if s is None:
                if sid not in n.rejected:
                    unknown += 1
                continue
            value = float(raw)
            g = s.group
            if g is None:
                g = self._go_live(n, s, value)
            else:
                pos = s.pos
                if only_new or g.values[pos] == value:
                    continue
                g.values[pos] = value
            dirty.add(g)
            changed += 1
        for g in dirty:
            g.version += 1
            g.fs.version += 1
        return changed, unknown

    def _declare_one(
        self, n: NodeRecord, sd: SeriesDecl, lost: list[tuple[str, str]]
    ) -> policy.Refusal | None:
        """Bind one declared series to its record (found by identity in constant time, or
        made), or say why not. ``lost``: gets the nodes a retype of the family costs."""
        refusal = self.refuses(sd.name, sd.labels)
        if refusal is not None:
            return refusal
        if sd.id in n.ids or sd.id in n.rejected:
            return policy.Refusal(
                policy.DUPLICATE_ID, f"series id {sd.id} is already declared on this connection"
            )
        fs = self._families.get(sd.name)
        verdict = family_types.judge(fs, sd, n.name)
        if isinstance(verdict, policy.Refusal):
            return verdict
        if verdict is family_types.RETYPE and fs is not None:
            lost.extend(self._retype(fs, sd.type))
            fs = self._families.get(sd.name)
        # not shared (NodeRecord.shared): held only until the series' first value
        labels = stamp_node(sd.labels, n.name, self.config.node_label)
        identity = policy.identity(sd.name, labels)
        s = n.series.get(identity)
        if s is not None:  # a record from an earlier connection (or a duplicate)
            if s.conn == n.conn_id:
                return policy.Refusal(
                    policy.SAME_SERIES, f"same name and labels as series id {s.sid}"
                )
            s.conn, s.sid = n.conn_id, sd.id
        else:
            cost = policy.label_bytes(sd.name, labels)
            refusal = policy.refuse_room(
                name=sd.name,
                counter=sd.type == "counter",
                cost=cost,
                series=len(n.series),
                max_series=self.config.max_series_per_node,
                used_bytes=n.label_bytes,
                budget=self.config.max_label_bytes_per_node,
                new_family=fs is None,
                family_type=self._family_type,
            )
            if refusal is not None:
                return refusal
            s = self._new_series(n, sd, fs, labels, identity=identity, cost=cost)
        n.ids[sd.id] = s
        return None

    def _new_series(
        self,
        n: NodeRecord,
        sd: SeriesDecl,
        fs: FamilyState | None,
        labels: Labels,
        *,
        identity: bytes,
        cost: int,
    ) -> SeriesRecord:
        if fs is None:
            fs = self._families[sd.name] = FamilyState(family_types.family_of(sd), n.name)
            self._family_order = None
        s = SeriesRecord(fs, (fs.name_label, *labels), n.conn_id, sd.id)
        s.identity, s.cost = identity, cost
        fs.holders[n.name] = fs.holders.get(n.name, 0) + 1
        n.series[identity] = s
        n.label_bytes += s.cost
        if sd.name in self.config.tracked_families:
            n.tracked.add(s)
        return s

    def _family_type(self, name: str) -> str | None:
        fs = self._families.get(name)
        return None if fs is None else fs.family.type

    def refuses(self, name: str, labels: Labels = ()) -> policy.Refusal | None:
        """Why the gateway refuses a series, whoever declares or replays it. Only the
        gateway's own policy (:mod:`cloud_gateway.registry.series_policy`): the naming rules of
        :mod:`gpurelay.wire.rules` were checked by the decoder (DECLARE) or the record
        codec (REPLAY)."""
        return policy.refuse_name(name, self.config.reserved_prefixes) or policy.refuse_labels(
            name, labels
        )

    def _go_live(self, n: NodeRecord, s: SeriesRecord, value: float) -> Group:
        """A series joins its (family, node) block when its first value arrives."""
        fs = s.fs
        g = n.groups.get(fs.family.name)
        if g is None:
            g = n.groups[fs.family.name] = fs.groups[n.name] = Group(fs)
            fs.ordered = None
        assert s.labels is not None, "a series that is not live keeps its labels"
        g.add(s, value, self.lines.prefix(fs.family.name, s.labels[1:]))
        s.labels = None  # in the template now: read back from there when asked for
        return g

    def _remove(self, n: NodeRecord, s: SeriesRecord) -> None:
        fs, g = s.fs, s.group
        if g is not None:
            g.remove(s.pos)
            s.group = None
            if not g.members:
                del n.groups[fs.family.name], fs.groups[n.name]
                fs.ordered = None
        if n.series.get(s.identity) is s:
            del n.series[s.identity]
            n.label_bytes -= s.cost
        n.tracked.discard(s)
        if s.conn == n.conn_id and n.ids.get(s.sid) is s:
            del n.ids[s.sid]
        self._unref(fs, n.name)

    def _retype(self, fs: FamilyState, new_type: str) -> list[tuple[str, str]]:
        """More nodes declared ``fs`` with ``new_type`` than hold it: the holders' series of
        it go (a live one's id is refused from now on) and the family with them."""
        why = family_types.lost_message(fs.family, new_type, len(fs.challengers[new_type]))
        lost = []
        for name in list(fs.holders):
            n = self._nodes[name]
            for s in [s for s in n.series.values() if s.fs is fs]:
                if s.conn == n.conn_id and n.ids.get(s.sid) is s:
                    n.rejected.add(s.sid)
                self._remove(n, s)
            lost.append((name, why))
        self.generation += 1
        return lost

    def _drop_all(self, n: NodeRecord) -> None:
        for g in n.groups.values():
            del g.fs.groups[n.name]
            g.fs.ordered = None
            g.fs.version += 1
        for s in n.series.values():
            self._unref(s.fs, n.name)
        n.groups, n.series, n.tracked, n.ids = {}, {}, set(), {}
        n.label_bytes = 0

    def _unref(self, fs: FamilyState, node: str) -> None:
        held = fs.holders[node] - 1
        if held:
            fs.holders[node] = held
        else:
            del fs.holders[node]
        if not fs.holders and self._families.get(fs.family.name) is fs:
            del self._families[fs.family.name]
            self._family_order = None
