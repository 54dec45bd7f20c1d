"""Ingest: turn one node's frames into registry updates and acknowledgements.

The SSH server decodes frames and hands them here; the registry stays pure. The node
name is the authenticated certificate principal given by the SSH layer, never what the
agent says about itself. Two connections for one node: the newer wins, the older is
closed and logged.

Liveness (:mod:`cloud_gateway.registry.liveness`) is swept on the gateway's tick
(:meth:`Ingest.sweep`): a connection that has received nothing for the node's silent
threshold while the gateway was reading is closed (the node goes offline at once, not
after TCP or SSH keepalives give up), and an agent that asked for heartbeats in HELLO
gets a HEARTBEAT whenever the gateway has sent it nothing for that long, so it can tell
ACKs held for remote write from a dead link. An agent that asked for delayed range ACKs
gets its ACKs gathered per connection (:mod:`cloud_gateway.ingest.acks`), written on the tick
when due, at the end of a read that carried a REPLAY, and in place of a due HEARTBEAT.

One way through for a BATCH or REPLAY, each step a call that returns here:
:meth:`NodeDelivery.judge <cloud_gateway.ingest.delivery.NodeDelivery.judge>` (new, or a
duplicate), the registry (a BATCH is applied at once, so /metrics stays fresh; a REPLAY,
an older spooled collection, is decoded, so a malformed record closes the connection, and
never changes the exposed values), :meth:`~cloud_gateway.ingest.delivery.NodeDelivery.settle`
for a new seq (acknowledged now, or once remote write took it), and the connection's
:class:`~cloud_gateway.ingest.acks.Acknowledger`, which alone writes ACKs and HEARTBEATs.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from cloud_gateway.ingest.acks import Acknowledger
from cloud_gateway.ingest.delivery import Delivery, NodeDelivery, Verdict
from cloud_gateway.metrics import FamilySamples, fixed, one
from cloud_gateway.registry.series_policy import REFUSAL_CODES
from cloud_gateway.registry.store import Registry, StaleConnection, stamp_node
from cloud_gateway.remote_write.forwarder import QueuedCollection
from cloud_gateway.self_metrics import SelfMetrics
from cloud_gateway.ssh.conflicts import ConflictPolicy
from cloud_gateway.ssh.logins import node_log
from gpurelay.model import Labels
from gpurelay.record import Record, RecordDecoder
from gpurelay.wire import Batch, Declare, Frame, Hello, Limits, Replay, WireError

_MAX_KEYS: Final = 100_000  # remote write label sets remembered per session (replays)


@dataclass
class IngestStats:
    batches: int = 0
    replays: int = 0
    duplicates: int = 0
    bytes: int = 0
    replaced_connections: int = 0
    rejected_series: Counter[str] = field(default_factory=Counter)
    unknown_values: int = 0
    name_mismatches: int = 0
    connection_conflicts: int = 0  # fights over one certificate (cloud_gateway.ssh.conflicts)
    help_conflicts: int = 0  # families declared with another HELP than the fleet's
    silent_closed: int = 0  # connections closed after nothing was received for too long
    heartbeats: int = 0  # HEARTBEAT frames sent
    ack_frames: int = 0  # ACK and ACK_RANGES frames sent
    batch_seconds: float = 0.0  # CPU-ish time spent applying batches (perf_counter)
    replay_seconds: float = 0.0  # same for replays (decode, and samples for remote write)

    def families(self) -> list[FamilySamples]:
        """The ingest stage's own metrics."""
        return [
            one("gpurelay_gateway_batches_total", self.batches),
            one("gpurelay_gateway_replayed_batches_total", self.replays),
            one("gpurelay_gateway_duplicate_batches_total", self.duplicates),
            one("gpurelay_gateway_received_bytes_total", self.bytes),
            fixed(
                "gpurelay_gateway_rejected_series_total",
                "reason",
                self.rejected_series,
                REFUSAL_CODES,
            ),
            one("gpurelay_gateway_replaced_connections_total", self.replaced_connections),
            one("gpurelay_gateway_connection_conflicts_total", self.connection_conflicts),
            one("gpurelay_gateway_help_conflicts_total", self.help_conflicts),
            one("gpurelay_gateway_silent_connections_closed_total", self.silent_closed),
            one("gpurelay_gateway_heartbeats_sent_total", self.heartbeats),
            one("gpurelay_gateway_ack_frames_total", self.ack_frames),
        ]


class Ingest:
    """Implements the SSH server's ``SessionFactory`` over a :class:`Registry`."""

    def __init__(
        self,
        registry: Registry,
        *,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        on_change: Callable[[], None] = lambda: None,
        limits: Limits | None = None,
        delivery: Delivery | None = None,
        conflicts: ConflictPolicy | None = None,
        self_metrics: SelfMetrics | None = None,
    ) -> None:
        """``delivery``: the seq ledger and, with remote write, the forwarders (built once
        from ``[remote_write]`` in ``app.py``); none: remote write off, defaults."""
        self.registry = registry
        self.clock = clock
        self.monotonic = monotonic  # for silences and heartbeats: immune to clock steps
        self.on_change = on_change
        self.limits = limits or Limits()
        self.delivery = delivery or Delivery()
        self.forward_stats = self.delivery.forward_stats
        self.stats = IngestStats()
        self.self_metrics = self_metrics or SelfMetrics()
        self._apply_batch = self.self_metrics.apply_seconds.labels("batch")
        self._apply_replay = self.self_metrics.apply_seconds.labels("replay")
        self._sessions: dict[int, NodeSession] = {}  # by connection, after HELLO
        self.conflicts = conflicts or ConflictPolicy()

    def open_session(
        self,
        node: str,
        remote: str,
        close: Callable[[str], None],
        send: Callable[[Frame], None] = lambda frame: None,
    ) -> NodeSession:
        """``send`` writes a frame to the agent: the ACKs and HEARTBEATs of the
        session's :class:`Acknowledger` (the only frames the gateway sends it)."""
        return NodeSession(self, node, remote, close, send)

    def close_connection(self, conn_id: int, reason: str) -> None:
        session = self._sessions.pop(conn_id, None)
        if session is not None:
            session._close(reason)

    def sweep(self) -> None:
        """On the gateway's tick: heartbeats due, and connections silent for too long."""
        now = self.monotonic()
        for session in list(self._sessions.values()):
            session.tick(now)

    async def aclose(self) -> None:
        """Stop forwarding (before the remote writer closes); see :meth:`Delivery.aclose`."""
        await self.delivery.aclose()


class NodeSession:
    def __init__(
        self,
        ingest: Ingest,
        node: str,
        remote: str,
        close: Callable[[str], None],
        send: Callable[[Frame], None],
    ) -> None:
        self._ingest = ingest
        self.node = node
        self.remote = remote
        self._close = close
        self.acks = Acknowledger(send, ingest.stats, ingest.monotonic)
        self.conn_id: int | None = None
        self._last_received = ingest.monotonic()
        self.log = node_log(node)
        self._pending_bytes = 0
        self._records = RecordDecoder(limits=ingest.limits)
        self._keys: dict[tuple[str, Labels], Labels | None] = {}  # replayed series -> key
        self._replay_series: tuple[tuple[str, Labels], ...] = ()  # the last record's series
        self._replay_keys: list[Labels | None] = []  # and their keys
        self._delivery: NodeDelivery = ingest.delivery.open(
            node, log=self.log, acknowledge=self.acks.later, failed=close
        )

    @property
    def queued(self) -> int:
        """Collections waiting for remote write."""
        return self._delivery.queued

    async def flow(self) -> None:
        """Return once this session can take more frames (its remote write queue is
        within bounds, or the session closed)."""
        await self._delivery.room()

    def received(self, nbytes: int) -> None:
        self._pending_bytes += nbytes
        self._ingest.stats.bytes += nbytes
        self._last_received = self._ingest.monotonic()

    def read_done(self) -> None:
        """The frames of one read were handled (ACKs due at once are written)."""
        self.acks.read_done()

    def flush(self) -> None:
        """The connection is about to end: every gathered ACK is written."""
        self.acks.flush()

    def tick(self, now: float) -> None:
        ingest = self._ingest
        self.acks.tick(now)
        if self._delivery.held:  # the gateway is not reading: not the node's silence
            self._last_received = now
            return
        limit = ingest.registry.silent_after(self.node) if self.conn_id is not None else None
        silent = now - self._last_received
        if limit is None or silent <= limit or self.conn_id not in ingest._sessions:
            return
        ingest.stats.silent_closed += 1
        message = (
            f"nothing received for {silent:.1f}s (the limit is {limit:.1f}s: "
            "registry.offline_after_intervals x the agent's interval + margin); "
            "closing the connection, the node is offline until it connects again"
        )
        self.log.warning("%s", message)
        ingest.registry.record_error(self.node, message, ingest.clock())
        ingest.close_connection(self.conn_id, f"silent for {silent:.1f}s")

    def handle(self, frame: Frame) -> None:
        """Apply one frame; what it earns (an ACK) is written by :attr:`acks`."""
        if isinstance(frame, Batch):
            self.acks.received(frame.seq)
            self._batch(frame)
        elif isinstance(frame, Replay):
            self.acks.received(frame.seq)
            self._replay(frame)
        elif isinstance(frame, Declare):
            self._declare(frame)
        elif isinstance(frame, Hello):
            self._hello(frame)
        else:
            raise WireError("frame_type", f"an agent may not send {type(frame).__name__} frames")

    def _hello(self, hello: Hello) -> None:
        ingest = self._ingest
        now = ingest.clock()
        if hello.node != self.node:
            ingest.stats.name_mismatches += 1
            message = (
                f"agent calls itself {hello.node!r} but its certificate is for {self.node!r}; "
                f"publishing as {self.node!r}"
            )
            self.log.warning(message)
            ingest.registry.record_error(self.node, message, now)
        self._arrive(now)
        connected = ingest.registry.connect(self.node, remote=self.remote, hello=hello, now=now)
        self.conn_id = connected.conn_id
        ingest._sessions[connected.conn_id] = self
        if connected.replaced is not None:
            ingest.stats.replaced_connections += 1
            self.log.warning("a newer connection from %s replaces the older one", self.remote)
            ingest.close_connection(
                connected.replaced, f"replaced by a newer connection from {self.remote}"
            )
        self.log.info(
            "connected from %s: agent %r, %d GPU(s), backend %r, domain %r",
            self.remote,
            hello.agent_version,  # what the agent says is quoted: it may hold anything
            len(hello.gpus),
            hello.backend,
            hello.domain or self.node,
        )
        self.acks.hello(hello.ack_delay_seconds, hello.heartbeat_seconds)
        ingest.on_change()

    def _arrive(self, now: float) -> None:
        """Apply ssh.duplicate_connection when the node is connected already (or held):
        refuse this connection (WireError ``conflict``), close the other, or both."""
        ingest, registry = self._ingest, self._ingest.registry
        live = registry.live_connection(self.node)
        current = live[1] if live is not None else None
        verdict = ingest.conflicts.arrive(self.node, current=current, new=self.remote, now=now)
        if verdict.fight:
            ingest.stats.connection_conflicts += 1
            message = (
                f"two connections use this node's certificate: {current} and {self.remote} "
                f"(ssh.duplicate_connection = {ingest.conflicts.policy}); a copied or "
                "stolen certificate? revoke it and issue a new one"
            )
            registry.record_conflict(self.node, message, now)
            if verdict.announce:
                self.log.error("%s", message)
        if verdict.close_old and not verdict.admit and live is not None:
            ingest.close_connection(live[0], verdict.reason)
        if not verdict.admit:
            raise WireError("conflict", verdict.reason)

    def _current(self) -> int:
        if self.conn_id is None:
            raise WireError("order", "the first frame on a connection must be HELLO")
        return self.conn_id

    def _declare(self, decl: Declare) -> None:
        ingest = self._ingest
        try:
            declared = ingest.registry.declare(self.node, self._current(), decl)
        except StaleConnection as exc:
            raise self._replaced() from exc
        for rejected in declared.rejected:
            ingest.stats.rejected_series[rejected.code] += 1
        if declared.rejected:
            first = declared.rejected[0]
            message = f"{len(declared.rejected)} series rejected, e.g. {first.name}: {first.reason}"
            self.log.warning(message)
            ingest.registry.record_error(self.node, message, ingest.clock())
        for loser, why in declared.lost:  # a family retyped by the majority of nodes
            node_log(loser).warning("%s", why)
            ingest.registry.record_error(loser, why, ingest.clock())
        if declared.help_conflicts:
            ingest.stats.help_conflicts += len(declared.help_conflicts)
            names = declared.help_conflicts
            message = (
                f"HELP of {len(names)} famil{'y' if len(names) == 1 else 'ies'} differs from "
                f"the fleet's (kept the first declared), e.g. {names[0]}"
            )
            self.log.info(message)
            ingest.registry.record_error(self.node, message, ingest.clock())

    def _batch(self, batch: Batch) -> None:
        ingest = self._ingest
        started = time.perf_counter()
        conn_id = self._current()
        verdict = self._delivery.judge(batch.seq)
        try:
            applied = ingest.registry.apply(
                self.node,
                conn_id,
                batch,
                now=ingest.clock(),
                size_bytes=self._pending_bytes,
                duplicate=verdict.duplicate,
            )
        except StaleConnection as exc:
            raise self._replaced() from exc
        self._pending_bytes = 0
        stats = ingest.stats
        stats.unknown_values += applied.unknown
        self._acknowledge(
            batch.seq,
            verdict,
            lambda: QueuedCollection(
                seq=batch.seq,
                timestamp_ms=round(batch.timestamp * 1000),
                samples=ingest.registry.samples(self.node),
                replayed=False,
            ),
        )
        stats.batches += 1
        stats.duplicates += verdict.duplicate
        took = time.perf_counter() - started
        stats.batch_seconds += took
        ingest._apply_batch.observe(took)
        ingest.on_change()

    def _acknowledge(
        self,
        seq: int,
        verdict: Verdict,
        collection: Callable[[], QueuedCollection],
        *,
        replay: bool = False,
    ) -> None:
        """After the registry took the frame: settle its seq, and the ACK its verdict
        earns now (later ones come from delivery to :attr:`acks` directly)."""
        forwarded = collection() if verdict is Verdict.FORWARD else None
        self._delivery.settle(seq, verdict, forwarded)
        if verdict.acknowledged_now:  # new, or delivered before: leave the agent's spool
            self.acks.now(seq, replay=replay)
        elif replay:  # FORWARD, or IN_FLIGHT (acknowledged when the first one is)
            self.acks.hold(seq)  # a replay's ACK, when it comes, is urgent

    def _replaced(self) -> WireError:
        """A newer connection of this node took over: close this one, with this error."""
        self._close("replaced by a newer connection")
        return WireError("order", "this connection was replaced by a newer one")

    def _replay(self, replay: Replay) -> None:
        ingest = self._ingest
        started = time.perf_counter()
        conn_id = self._current()
        record = self._records.decode(replay.record)  # WireError if malformed
        verdict = self._delivery.judge(replay.seq)
        try:
            ingest.registry.replay(
                self.node,
                conn_id,
                replay.seq,
                now=ingest.clock(),
                size_bytes=self._pending_bytes,
                duplicate=verdict.duplicate,
            )
        except StaleConnection as exc:
            raise self._replaced() from exc
        self._pending_bytes = 0
        self._acknowledge(
            replay.seq,
            verdict,
            lambda: QueuedCollection(
                seq=replay.seq,
                timestamp_ms=record.timestamp_ms,
                samples=self._replayed_samples(record),
                replayed=True,
            ),
            replay=True,
        )
        ingest.stats.replays += 1
        ingest.stats.duplicates += verdict.duplicate
        took = time.perf_counter() - started
        ingest.stats.replay_seconds += took
        ingest._apply_replay.observe(took)
        ingest.on_change()

    def _replayed_samples(self, record: Record) -> list[tuple[Labels, float]]:
        """A record's samples with the remote write key of each series: its name, its
        labels stamped with the authenticated node; series the registry would refuse
        (reserved names) are left out. The decoder hands out one tuple per series list,
        so the keys of a backlog of the same series are worked out once."""
        if record.series is not self._replay_series:
            keys = self._keys
            row: list[Labels | None] = []
            for cache_key in record.series:
                try:
                    key = keys[cache_key]
                except KeyError:
                    key = self._key(*cache_key)
                    if len(keys) >= _MAX_KEYS:
                        keys.clear()
                    keys[cache_key] = key
                row.append(key)
            self._replay_series, self._replay_keys = record.series, row
        return [
            (key, value)
            for key, value in zip(self._replay_keys, record.values, strict=True)
            if key is not None
        ]

    def _key(self, name: str, labels: Labels) -> Labels | None:
        refusal = self._ingest.registry.refuses(name, labels)
        if refusal is not None:
            self._ingest.stats.rejected_series[refusal.code] += 1
            self.log.warning("replayed series %r left out: %s", name, refusal.message)
            return None
        node_label = self._ingest.registry.config.node_label
        return (("__name__", name), *stamp_node(labels, self.node, node_label))

    def closed(self, reason: str) -> None:
        ingest = self._ingest
        self._delivery.close()
        if self.conn_id is None:
            return
        if ingest._sessions.get(self.conn_id) is self:
            del ingest._sessions[self.conn_id]
        ingest.registry.disconnect(self.node, self.conn_id, now=ingest.clock(), reason=reason)
        self.log.info("disconnected: %s", reason)
        ingest.on_change()
