"""When a connection's ACKs and HEARTBEATs are written (:class:`Acknowledger`), and how
ACKs are gathered into ACK_RANGES frames (:class:`AckGatherer`).

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
- while ACKs wait, no HEARTBEAT is written: the ACKs, when due, show the gateway is alive;
- the connection is about to end (GOODBYE, or the gateway closes it).

Nothing is lost by waiting: a seq whose ACK never left (the connection died first) is
still in the agent's spool and sent again; the gateway's ledger knows it and
acknowledges the duplicate without applying it twice.

An agent that did not ask for delayed ACKs gets each ACK as soon as its seq is
acknowledged. :class:`AckGatherer` is pure (no I/O, no clocks); :class:`Acknowledger`
writes through the function it is given.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Final, Protocol

from gpurelay.wire import Ack, AckRanges, Frame, Heartbeat
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


class AckCounters(Protocol):
    """Where the frames written are counted (the ingest stage's stats)."""

    ack_frames: int
    heartbeats: int


class Acknowledger:
    """When one connection's ACKs and HEARTBEATs are written: the one place of that rule.

    :mod:`cloud_gateway.ingest.delivery` says *whether* a seq is acknowledged; the session
    tells this object *that* it is, :meth:`now` while its frame is handled or
    :meth:`later` once remote write took it, and this object writes it through ``write``
    (the SSH channel): at once for an agent that did not ask for delayed ACKs, else
    gathered in an :class:`AckGatherer` and written when due (see the module's rules),
    at the end of the read (:meth:`read_done`), on the tick (:meth:`tick`), or before
    the connection ends (:meth:`flush`). A HEARTBEAT goes when the agent asked for them
    in HELLO and nothing was written for that long, unless ACKs wait."""

    __slots__ = (
        "_beat_every",
        "_clock",
        "_counters",
        "_due_after_read",
        "_flush_soon",
        "_gathered",
        "_last_sent",
        "_received",
        "_write",
    )

    def __init__(
        self, write: Callable[[Frame], None], counters: AckCounters, clock: Callable[[], float]
    ) -> None:
        self._write = write
        self._counters = counters
        self._clock = clock  # monotonic: immune to clock steps
        self._gathered: AckGatherer | None = None  # the agent asked for delayed ACKs
        self._beat_every = 0.0  # what the agent asked for in HELLO (0: no heartbeats)
        self._last_sent = clock()
        self._received = 0  # highest BATCH/REPLAY seq received, for HEARTBEAT
        self._due_after_read = False  # gathered ACKs to write when this read is done
        self._flush_soon = False  # a write of due ACKs is scheduled on the loop

    def hello(self, ack_delay: float, heartbeat: float) -> None:
        """What the agent asked for in HELLO; the first HEARTBEAT goes at once, so the
        agent learns we send them."""
        if ack_delay:
            self._gathered = AckGatherer(ack_delay)
        if heartbeat:
            self._beat_every = heartbeat
            self._beat()

    def received(self, seq: int) -> None:
        """A BATCH or REPLAY with ``seq`` arrived (what a HEARTBEAT reports)."""
        self._received = max(self._received, seq)

    def now(self, seq: int, *, replay: bool = False) -> None:
        """``seq`` is acknowledged while its frame is handled."""
        gathered = self._gathered
        if gathered is None:
            self._send_ack(seq)
            return
        gathered.add(seq, self._clock(), replay=replay)
        self._due_after_read = gathered.pressing  # else they wait for the tick

    def hold(self, seq: int) -> None:
        """A REPLAY's ``seq`` is acknowledged :meth:`later`; its ACK is urgent then."""
        if self._gathered is not None:
            self._gathered.hold(seq)

    def later(self, seq: int) -> None:
        """``seq`` is acknowledged after its frame (remote write took it): written now,
        or gathered and, when due, written once this burst of deliveries is in."""
        gathered = self._gathered
        if gathered is None:
            self._send_ack(seq)
            return
        now = self._clock()
        gathered.add(seq, now)
        if gathered.due(now) and not self._flush_soon:
            self._flush_soon = True
            asyncio.get_running_loop().call_soon(self._write_due)

    def read_done(self) -> None:
        """The frames of one read were handled: write the gathered ACKs due at once."""
        if self._due_after_read:
            self._write_gathered(force=False)

    def flush(self) -> None:
        """The connection is about to end: write every gathered ACK."""
        self._write_gathered(force=True)

    def tick(self, now: float) -> None:
        """On the gateway's tick: gathered ACKs when due, else a HEARTBEAT when due. While
        ACKs wait, no HEARTBEAT is written: they go when due (within ``ack_delay``) and
        show the gateway is alive as well. An agent asks for heartbeats no more often than
        its ACK delay (``edge_agent.config.heartbeat_seconds``), so it never waits longer
        than it expects; writing the waiting ACKs at the heartbeat instead would send them
        up to a tick sooner, and change how many a gateway's crash leaves unacknowledged."""
        beat = bool(self._beat_every) and now - self._last_sent >= self._beat_every
        gathered = self._gathered
        if gathered is not None and gathered and (beat or gathered.due(now)):
            self._write_gathered(force=False)
        elif beat:
            self._beat()

    def _write_due(self) -> None:
        self._flush_soon = False
        self._write_gathered(force=False)

    def _write_gathered(self, *, force: bool) -> None:
        gathered = self._gathered
        if gathered is None or not gathered:
            return
        now = self._clock()
        if not (force or gathered.due(now)):
            return
        frames = gathered.take()
        self._due_after_read = False
        self._counters.ack_frames += len(frames)
        self._last_sent = now
        for frame in frames:
            self._write(frame)

    def _send_ack(self, seq: int) -> None:
        self._counters.ack_frames += 1
        self._last_sent = self._clock()
        self._write(Ack(seq=seq))

    def _beat(self) -> None:
        self._counters.heartbeats += 1
        self._last_sent = self._clock()
        self._write(Heartbeat(received=self._received))
