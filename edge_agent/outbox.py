"""The outbox: sequence numbers, the spool, and what the tunnel sends next.

Every collection gets the next sequence number and is committed to the spool (as an
:mod:`gpurelay.record`) *before* the tunnel sends it; it leaves the spool when the gateway
acknowledges that seq. Per connection, a :class:`Dispatch` decides what goes out next:

* the newest collection first, as a live BATCH (fresh data never waits behind a backlog);
* then, between live batches, the backlog oldest first as REPLAY frames: every spooled seq
  below the newest live one that is not already in flight on this connection (batches of a
  lost connection, collections superseded while the link was busy, the spool of a previous
  run of the agent);
* at most ``max_in_flight`` unacknowledged replays (live batches are never held back), so a
  slow gateway or TSDB slows the replay instead of being flooded; the tunnel also paces
  replays to ``replay_batches_per_second``.

Sequence numbers continue from the spool's persisted high-water mark, and never start below
the wall clock in milliseconds: an agent whose spool was lost (a new disk, a corrupt file
moved aside) is still not mistaken by the gateway for a replay of batches it already has.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from edge_agent.spool import DROP_REASONS, Spool, SpooledBatch
from gpurelay.model import Family, SampleSink, Snapshot
from gpurelay.record import RecordEncoder
from gpurelay.wire.ackranges import covered

log = logging.getLogger(__name__)

_PENDING_CHUNK = 64

SPOOL_FAMILIES = (
    Family(
        name="gpurelay_agent_spool_batches",
        type="gauge",
        help="Batches in the durable spool (not yet acknowledged by the gateway).",
    ),
    Family(
        name="gpurelay_agent_spool_bytes",
        type="gauge",
        help="Payload bytes in the durable spool.",
    ),
    Family(
        name="gpurelay_agent_spool_oldest_age_seconds",
        type="gauge",
        help="Age of the oldest batch in the spool (0 when empty).",
    ),
    Family(
        name="gpurelay_agent_spool_dropped_batches_total",
        type="counter",
        help="Batches dropped unsent: spool bound reached (bytes, age) or too large to send.",
    ),
    Family(
        name="gpurelay_agent_spool_write_errors_total",
        type="counter",
        help="Spool operations that failed (full or read-only disk, I/O error).",
    ),
    Family(
        name="gpurelay_agent_spool_healthy",
        type="gauge",
        help="1 while the spool can be written; 0 while live batches go out unspooled.",
    ),
    Family(
        name="gpurelay_agent_spool_unspooled_batches_total",
        type="counter",
        help="Collections the spool could not take (sent live only, if the link was up).",
    ),
)


class Outbox:
    def __init__(
        self,
        spool: Spool | None,
        *,
        max_in_flight: int = 64,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.spool = spool
        self.max_in_flight = max_in_flight
        first = int(wall_clock() * 1000)
        self._next_seq = max(first, spool.next_seq()) if spool is not None else first
        self._records = RecordEncoder()
        self.latest: tuple[int, Snapshot] | None = None
        self.unspooled = 0  # collections the spool did not take (disk full, read-only)
        self.replayed = 0  # REPLAY frames written, all connections
        self.discarded = 0  # spooled batches that can never be sent (over the frame limit)

    def put(self, snapshot: Snapshot) -> int:
        """Number a collection and spool it; it becomes the next live batch."""
        seq = self._next_seq
        self._next_seq += 1
        if self.spool is not None and not self.spool.put(
            seq, snapshot.timestamp, self._records.encode(snapshot)
        ):
            self.unspooled += 1
        self.latest = (seq, snapshot)
        return seq

    def metrics(self, sink: SampleSink) -> None:
        """The spool's series (``gpurelay_agent_spool_*``), added to every collection."""
        spool = self.spool
        if spool is None:
            return
        for fam in SPOOL_FAMILIES:
            sink.declare(fam)
        ss = spool.stats()
        sink.add("gpurelay_agent_spool_batches", (), ss.batches)
        sink.add("gpurelay_agent_spool_bytes", (), ss.bytes)
        sink.add("gpurelay_agent_spool_oldest_age_seconds", (), round(ss.oldest_age_seconds, 3))
        dropped = dict(ss.dropped)
        dropped["oversize"] = self.discarded
        for reason in (*DROP_REASONS, "oversize"):
            n = dropped.get(reason, 0)
            sink.add("gpurelay_agent_spool_dropped_batches_total", (("reason", reason),), n)
        sink.add("gpurelay_agent_spool_write_errors_total", (), ss.write_errors)
        sink.add("gpurelay_agent_spool_healthy", (), 1.0 if ss.healthy else 0.0)
        sink.add("gpurelay_agent_spool_unspooled_batches_total", (), self.unspooled)

    def dispatch(self) -> Dispatch:
        """What to send on a new connection."""
        return Dispatch(self)

    def close(self) -> None:
        if self.spool is not None:
            self.spool.close()


class Dispatch:
    """One connection's progress: the newest live seq sent, the replay cursor, in flight."""

    def __init__(self, outbox: Outbox) -> None:
        self._outbox = outbox
        self.live_seq = -1  # newest live batch sent on this connection
        self.in_flight: set[int] = set()  # sent here, not acknowledged yet
        self._replaying: set[int] = set()  # the REPLAY part of in_flight
        self._cursor = 0  # every spooled seq <= cursor was looked at
        self._buffer: deque[SpooledBatch] = deque()

    def next_live(self) -> tuple[int, Snapshot] | None:
        latest = self._outbox.latest
        if latest is None or latest[0] <= self.live_seq:
            return None
        return latest

    def sent_live(self, seq: int) -> None:
        self.live_seq = seq
        self.in_flight.add(seq)

    def room(self) -> bool:
        return len(self._replaying) < self._outbox.max_in_flight

    def next_replay(self) -> SpooledBatch | None:
        """The oldest spooled batch to send again on this connection, if any."""
        spool = self._outbox.spool
        if spool is None:
            return None
        while True:
            if not self._buffer:
                self._buffer.extend(spool.pending(after_seq=self._cursor, limit=_PENDING_CHUNK))
                if not self._buffer:
                    return None
            batch = self._buffer[0]
            if batch.seq >= self.live_seq:  # the live one, or newer: wait for it to be live
                self._buffer.clear()
                return None
            self._buffer.popleft()
            self._cursor = batch.seq
            if batch.seq not in self.in_flight:
                return batch

    def sent_replay(self, seq: int) -> None:
        self.in_flight.add(seq)
        self._replaying.add(seq)
        self._outbox.replayed += 1

    def discard(self, seq: int) -> None:
        """A spooled batch that can never be sent: take it out of the spool."""
        self._outbox.discarded += 1
        if self._outbox.spool is not None:
            self._outbox.spool.ack(seqs=(seq,))

    def acked_ranges(self, ranges: Sequence[tuple[int, int]]) -> None:
        """An ACK_RANGES frame: the same as one ACK for each seq sent here that it covers
        (a range may be vast; only this connection's in-flight seqs are looked up)."""
        if ranges:
            self.acked(covered(ranges, self.in_flight))

    def acked(self, seqs: Iterable[int]) -> None:
        done = set(seqs)
        self.in_flight -= done
        self._replaying -= done
        if self._outbox.spool is not None and done:
            self._outbox.spool.ack(seqs=done)
