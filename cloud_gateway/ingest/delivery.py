"""Delivery: whether a seq is new, and when it may be acknowledged.

For each BATCH or REPLAY the session asks :meth:`NodeDelivery.judge` for a
:class:`Verdict`, applies the frame to the registry, and for a new seq calls
:meth:`NodeDelivery.settle`. Delivery never calls back into the session: it returns what
to do, and the ACKs it releases later (remote write on) go to the connection's
:class:`~cloud_gateway.ingest.acks.Acknowledger`, which alone decides when each is written.

- The **ledger**: every seq a node got acknowledged, as merged ranges
  (:class:`~cloud_gateway.ingest.seqranges.SeqRanges`), kept per node for the gateway's
  life so it survives reconnects. A seq in it is a *duplicate* (an agent restarted, an
  ACK was lost): acknowledged again at once, never applied again.
- **In flight**: seqs handed to the node's
  :class:`~cloud_gateway.remote_write.forwarder.Forwarder` and not yet taken by the
  receiver. The same seq arriving again is a duplicate too, and is acknowledged when the
  waiting one is.
- **Settling a new seq**: remote write off, it is marked and acknowledged as soon as it is
  applied; remote write on, its collection goes to the forwarder and it is acknowledged
  (``acknowledge(seq)``) when the forwarder reports it delivered, accepted or refused for
  good. What a closed session held stays unacknowledged: the agent sends it again.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass

from cloud_gateway.ingest.seqranges import DEFAULT_MAX_RANGES, SeqRanges
from cloud_gateway.remote_write.client import Writer
from cloud_gateway.remote_write.config import MAX_QUEUED_BATCHES, RemoteWriteConfig
from cloud_gateway.remote_write.forwarder import (
    MAX_SAMPLES_PER_SEND,
    RETRY_BACKOFF,
    Forwarder,
    ForwardStats,
    QueuedCollection,
)
from gpurelay.tasks import stop_tasks


@dataclass(frozen=True, slots=True, kw_only=True)
class DeliverySettings:
    max_seq_ranges: int = DEFAULT_MAX_RANGES  # delivered seqs kept per node, as ranges
    max_queued_batches: int = MAX_QUEUED_BATCHES  # per node, then back-pressure
    max_samples_per_send: int = MAX_SAMPLES_PER_SEND
    retry_backoff: tuple[float, float] = RETRY_BACKOFF

    @classmethod
    def of(cls, section: RemoteWriteConfig) -> DeliverySettings:
        """The settings ``[remote_write]`` gives (the one place its knobs are read)."""
        return cls(
            max_queued_batches=section.max_queued_batches_per_node,
            retry_backoff=(section.min_backoff_seconds, section.max_backoff_seconds),
        )


class Verdict(enum.Enum):
    """What a BATCH or REPLAY's seq is, judged before it is applied."""

    NEW = "new"  # apply it; delivered once applied: acknowledged now
    FORWARD = "forward"  # apply it; remote write takes it: acknowledged once the receiver did
    DELIVERED = "delivered"  # acknowledged before: apply as a duplicate, acknowledge again now
    IN_FLIGHT = "in_flight"  # remote write holds it: a duplicate, acknowledged with the first

    @property
    def duplicate(self) -> bool:
        return self is Verdict.DELIVERED or self is Verdict.IN_FLIGHT

    @property
    def acknowledged_now(self) -> bool:
        """Its ACK is due as soon as the frame is applied."""
        return self is Verdict.NEW or self is Verdict.DELIVERED


class Delivery:
    """The gateway's delivery state: one ledger per node, one forwarder per session."""

    def __init__(
        self,
        settings: DeliverySettings | None = None,
        *,
        remote_write: Writer | None = None,
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
        acknowledge: Callable[[int], None],
        failed: Callable[[str], None],
    ) -> NodeDelivery:
        """Delivery for one connection of ``node``: ``acknowledge(seq)`` is told of the
        seqs remote write took later, ``failed`` closes the connection (a forwarding bug,
        not the receiver)."""
        session = NodeDelivery(self, node, log=log, acknowledge=acknowledge, failed=failed)
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
        acknowledge: Callable[[int], None],
        failed: Callable[[str], None],
    ) -> None:
        self._delivery = delivery
        self._ledger = delivery.ledger(node)
        self._acknowledge = acknowledge
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

    def judge(self, seq: int) -> Verdict:
        """What ``seq`` is: new (delivered at once, or forwarded), or a duplicate
        (delivered before, or in flight)."""
        if seq in self._in_flight:
            return Verdict.IN_FLIGHT
        if seq in self._ledger:
            return Verdict.DELIVERED
        return Verdict.NEW if self._forwarder is None else Verdict.FORWARD

    def settle(self, seq: int, verdict: Verdict, collection: QueuedCollection | None) -> None:
        """``seq`` was applied: a NEW one is delivered, a FORWARD one's ``collection`` goes
        to the forwarder (``acknowledge(seq)`` comes once the receiver took it); a
        duplicate changes nothing."""
        if verdict is Verdict.NEW:
            self._ledger.add(seq)
        elif verdict is Verdict.FORWARD:
            if collection is None or self._forwarder is None:
                raise ValueError(f"seq {seq} is forwarded: its collection is needed")
            self._in_flight.add(seq)
            self._forwarder.put(collection)

    def close(self) -> asyncio.Task[None] | None:
        """The connection ended: stop forwarding; what waited is forgotten (the agent
        still holds it)."""
        self._delivery._closed(self)
        self._in_flight.clear()
        return None if self._forwarder is None else self._forwarder.close()

    def _delivered(self, seq: int) -> None:
        """The forwarder is done with ``seq``: mark it, and it is acknowledged."""
        self._in_flight.discard(seq)
        self._ledger.add(seq)
        self._acknowledge(seq)
