"""When a connection's ACKs are written: gathered into ACK_RANGES frames.

An agent that asks for it in HELLO (``ack_delay_seconds`` > 0) is acknowledged with
ACK_RANGES frames (:mod:`gpurelay.wire.ackranges`) instead of one ACK frame per batch: at
a 1 s interval that is one SSH packet and one socket write every few batches instead of
every batch, the largest per-batch cost of the gateway after decoding. What is
acknowledged, and when a seq may be acknowledged at all, stays with
:mod:`cloud_gateway.ingest.delivery`; this module only decides when the ACKs it released are
written. They wait here until one of:

- the oldest has waited ``ack_delay_seconds`` (checked on the gateway's 1 s tick);
- a REPLAY's ACK is among them: written at the end of the read that carried it (or, with
  remote write on, as soon as the receiver took it), because the agent keeps at most
  ``spool.max_in_flight`` replays unacknowledged and a held ACK would slow the backlog;
- :data:`MAX_PENDING_ACKS` wait (half of the agent's default in-flight bound);
- a HEARTBEAT would be due: the ACKs go instead, they show the gateway is alive as well;
- the connection is about to end (GOODBYE, or the gateway closes it).

Nothing is lost by waiting: a seq whose ACK never left (the connection died first) is
still in the agent's spool and sent again; the gateway's ledger knows it and
acknowledges the duplicate without applying it twice.

Pure: no I/O, no clocks (``now`` is passed in).
"""

from __future__ import annotations

from typing import Final

from gpurelay.wire import AckRanges
from gpurelay.wire.ackranges import frames_for

MAX_PENDING_ACKS: Final = 32  # seqs waiting to be acknowledged, at most, per connection


class AckGatherer:
    """One connection's acknowledged seqs that were not written yet."""

    __slots__ = ("_held", "_seqs", "_since", "_urgent", "delay", "pressing")

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self._seqs: list[int] = []
        self._since = 0.0  # when the oldest waiting seq was released
        self._urgent = False  # a REPLAY's ACK waits: write it at the next chance
        self._held: set[int] = set()  # replays whose ACK comes later (remote write)
        self.pressing = False  # due whatever the time: a replay's ACK waits, or too many

    def __len__(self) -> int:
        return len(self._seqs)

    def hold(self, seq: int) -> None:
        """A REPLAY's ``seq`` is acknowledged later (once remote write took it); its ACK
        is urgent when it comes."""
        self._held.add(seq)

    def add(self, seq: int, now: float, *, replay: bool = False) -> None:
        """``seq`` is acknowledged: it waits to be written."""
        if not self._seqs:
            self._since = now
        self._seqs.append(seq)
        if replay or (self._held and seq in self._held):
            self._held.discard(seq)
            self._urgent = True
        self.pressing = self._urgent or len(self._seqs) >= MAX_PENDING_ACKS

    def due(self, now: float) -> bool:
        """Whether the waiting ACKs should be written now."""
        return bool(self._seqs) and (self.pressing or now - self._since >= self.delay)

    def take(self) -> list[AckRanges]:
        """The frames that acknowledge every waiting seq (none when nothing waits)."""
        seqs, self._seqs, self._urgent, self.pressing = self._seqs, [], False, False
        return frames_for(seqs) if seqs else []
