"""Delivery: which seqs a node got acknowledged, which wait, and when to send each ACK.

Every decision about a BATCH or REPLAY's sequence number is made here, once per frame;
ingest calls :meth:`NodeDelivery.take` and sends what it returns. The pipeline is
``ssh_server → ingest → delivery → registry`` (and ``→ forwarding → remote_write`` when
remote write is on).

- The **ledger**: every seq a node got acknowledged, as merged ranges
  (:class:`~cloud_gateway.ingest.seqranges.SeqRanges`), kept per node for the gateway's life so
  it survives reconnects. A seq in it is a *duplicate* (an agent restarted, an ACK was
  lost): acknowledged again at once, never applied again.
- **In flight**: seqs handed to the node's :class:`~cloud_gateway.remote_write.forwarder.Forwarder`
  and not yet taken by the receiver. The same seq arriving again is a duplicate too, and
  is acknowledged when the waiting one is.
- **The ACK decision**: remote write off, a new seq is marked and acknowledged as soon as
  it is applied; remote write on, its collection goes to the forwarder and the ACK goes
  out (through ``send``) when the forwarder reports it delivered, accepted or refused for
  good. What a closed session held stays unacknowledged: the agent sends it again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from cloud_gateway.ingest.seqranges import DEFAULT_MAX_RANGES, SeqRanges
from cloud_gateway.remote_write.client import RemoteWriter
from cloud_gateway.remote_write.config import MAX_QUEUED_BATCHES
from cloud_gateway.remote_write.forwarder import (
    MAX_SAMPLES_PER_SEND,
    RETRY_BACKOFF,
    Forwarder,
    ForwardStats,
    QueuedCollection,
)
from gpurelay.tasks import stop_tasks
from gpurelay.wire import Ack, Frame

NO_ACKS: Final[tuple[Frame, ...]] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class DeliverySettings:
    max_seq_ranges: int = DEFAULT_MAX_RANGES  # delivered seqs kept per node, as ranges
    max_queued_batches: int = MAX_QUEUED_BATCHES  # per node, then back-pressure
    max_samples_per_send: int = MAX_SAMPLES_PER_SEND
    retry_backoff: tuple[float, float] = RETRY_BACKOFF


@dataclass(frozen=True, slots=True)
class Taken:
    """What became of one BATCH or REPLAY: ``duplicate`` (delivered before, or waiting),
    and the ACKs to send now (none while remote write holds it)."""

    duplicate: bool
    acks: tuple[Frame, ...]


class Delivery:
    """The gateway's delivery state: one ledger per node, one forwarder per session."""

    def __init__(
        self,
        settings: DeliverySettings | None = None,
        *,
        remote_write: RemoteWriter | None = None,
    ) -> None:
        self.settings = settings or DeliverySettings()
        self.remote_write = remote_write
        self.forward_stats = ForwardStats()
        self._ledgers: dict[str, SeqRanges] = {}
        self._sessions: set[NodeDelivery] = set()

    def is_delivered(self, node: str, seq: int) -> bool:
        ledger = self._ledgers.get(node)
        return ledger is not None and seq in ledger

    def ledger(self, node: str) -> SeqRanges:
        ledger = self._ledgers.get(node)
        if ledger is None:
            ledger = self._ledgers[node] = SeqRanges(self.settings.max_seq_ranges)
        return ledger

    def open(
        self,
        node: str,
        *,
        log: logging.Logger,
        send: Callable[[Frame], None],
        failed: Callable[[str], None],
    ) -> NodeDelivery:
        """Delivery for one connection of ``node``: ``send`` carries the ACKs that come
        later, ``failed`` closes the connection (a forwarding bug, not the receiver)."""
        session = NodeDelivery(self, node, log=log, send=send, failed=failed)
        self._sessions.add(session)
        return session

    async def aclose(self) -> None:
        """Stop every forwarder (before the remote writer closes); what they held stays
        unacknowledged, so the agents send it again."""
        tasks = [t for s in list(self._sessions) if (t := s.close()) is not None]
        # Bounded, cancelled again if a send lost its cancellation (gpurelay.tasks), and
        # not `suppress(CancelledError): await task`, which swallows our caller's too.
        await stop_tasks(tasks, what="remote write forwarder")

    def _closed(self, session: NodeDelivery) -> None:
        self._sessions.discard(session)


class NodeDelivery:
    """Delivery for one connection: the node's ledger, this session's in-flight seqs and
    its forwarder (remote write on)."""

    def __init__(
        self,
        delivery: Delivery,
        node: str,
        *,
        log: logging.Logger,
        send: Callable[[Frame], None],
        failed: Callable[[str], None],
    ) -> None:
        self._delivery = delivery
        self._ledger = delivery.ledger(node)
        self._send = send
        self._in_flight: set[int] = set()
        self._forwarder: Forwarder | None = None
        settings = delivery.settings
        if delivery.remote_write is not None:
            self._forwarder = Forwarder(
                delivery.remote_write,
                log=log,
                delivered=self._delivered,
                failed=failed,
                stats=delivery.forward_stats,
                max_queued=settings.max_queued_batches,
                max_samples_per_send=settings.max_samples_per_send,
                backoff=settings.retry_backoff,
            )

    @property
    def queued(self) -> int:
        """Collections waiting for remote write."""
        return 0 if self._forwarder is None else len(self._forwarder)

    @property
    def held(self) -> bool:
        """The remote write queue is full: the channel stops reading until :meth:`room`."""
        return self._forwarder is not None and self._forwarder.full

    async def room(self) -> None:
        """Return once this session may take more frames (its remote write queue is within
        bounds, or the session closed)."""
        if self._forwarder is not None:
            await self._forwarder.room()

    def take(
        self,
        seq: int,
        *,
        apply: Callable[[bool], None],
        collection: Callable[[], QueuedCollection],
    ) -> Taken:
        """One BATCH or REPLAY with ``seq``: classify it, let ``apply(duplicate)`` record it
        (in the registry), then decide its ACK. ``collection`` is called only when remote
        write is on and the seq is new, after ``apply``."""
        duplicate = seq in self._ledger or seq in self._in_flight
        apply(duplicate)
        if duplicate:
            # delivered: acknowledge again; in flight: acknowledged when the first one is
            acks = NO_ACKS if seq in self._in_flight else (Ack(seq=seq),)
            return Taken(duplicate=True, acks=acks)
        if self._forwarder is None:
            self._ledger.add(seq)
            return Taken(duplicate=False, acks=(Ack(seq=seq),))
        self._in_flight.add(seq)
        self._forwarder.put(collection())
        return Taken(duplicate=False, acks=NO_ACKS)

    def close(self) -> asyncio.Task[None] | None:
        """The connection ended: stop forwarding; what waited is forgotten (the agent
        still holds it)."""
        self._delivery._closed(self)
        self._in_flight.clear()
        return None if self._forwarder is None else self._forwarder.close()

    def _delivered(self, seq: int) -> None:
        """The forwarder is done with ``seq``: mark it and send its ACK."""
        self._in_flight.discard(seq)
        self._ledger.add(seq)
        self._send(Ack(seq=seq))
