"""The outbox: sequence numbers, the spool, and what the tunnel sends next.

Every collection gets the next sequence number and is committed to the spool (as an
:mod:`gpurelay.record`) *before* the tunnel sends it; it leaves the spool when the gateway
acknowledges that seq. Per connection, a :class:`Delivery` decides what goes out next:

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
from collections.abc import Callable, Iterable

from edge_agent.spool import Spool, SpooledBatch
from gpurelay.model import Snapshot
from gpurelay.record import RecordEncoder

log = logging.getLogger(__name__)

_PENDING_CHUNK = 64


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

    def delivery(self) -> Delivery:
        """What to send on a new connection."""
        return Delivery(self)

    def close(self) -> None:
        if self.spool is not None:
            self.spool.close()


class Delivery:
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

    def acked(self, seqs: Iterable[int]) -> None:
        done = set(seqs)
        self.in_flight -= done
        self._replaying -= done
        if self._outbox.spool is not None and done:
            self._outbox.spool.ack(seqs=done)
