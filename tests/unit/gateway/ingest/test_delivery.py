"""Delivery: the seq ledger, duplicates, in-flight seqs and the ACK decision, in one place."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from cloud_gateway.ingest.delivery import Delivery, DeliverySettings, NodeDelivery, Verdict
from cloud_gateway.remote_write.forwarder import QueuedCollection
from gpurelay.wire import Ack, Frame

LOG = logging.getLogger("test.delivery")


class Node:
    """One connection's delivery, with what it applied and what it sent later."""

    def __init__(self, delivery: Delivery, name: str = "n") -> None:
        self.applied: list[tuple[int, bool]] = []
        self.sent: list[Frame] = []
        self.closed: list[str] = []
        self.session: NodeDelivery = delivery.open(
            name, log=LOG, acknowledge=self._acknowledge, failed=self.closed.append
        )

    def _acknowledge(self, seq: int) -> None:
        self.sent.append(Ack(seq=seq))

    def take(self, seq: int) -> tuple[bool, Sequence[Frame]]:
        """What the session does with one BATCH: judge, apply, settle; (duplicate, the
        ACKs due now)."""
        verdict = self.session.judge(seq)
        self.applied.append((seq, verdict.duplicate))
        collection = QueuedCollection(
            seq=seq, timestamp_ms=seq, samples=[((("__name__", "x"),), 1.0)], replayed=False
        )
        self.session.settle(seq, verdict, collection if verdict is Verdict.FORWARD else None)
        return verdict.duplicate, (Ack(seq=seq),) if verdict.acknowledged_now else ()


def test_a_new_seq_is_applied_and_acknowledged_at_once_without_remote_write() -> None:
    delivery = Delivery()
    node = Node(delivery)
    assert node.take(5) == (False, (Ack(seq=5),))
    assert node.applied == [(5, False)] and delivery.is_delivered("n", 5)


def test_a_delivered_seq_is_a_duplicate_even_on_a_later_connection() -> None:
    delivery = Delivery()
    first = Node(delivery)
    first.take(5)
    first.session.close()
    second = Node(delivery)
    assert second.take(5) == (True, (Ack(seq=5),))  # acknowledged again: leave the spool
    assert second.applied == [(5, True)]  # the registry is told, to fill and count only


def test_duplicates_are_per_seq_not_below_a_high_water_mark() -> None:
    delivery = Delivery()
    node = Node(delivery)
    node.take(7)
    assert node.take(3) == (False, (Ack(seq=3),))
    assert not delivery.is_delivered("other", 3)


def test_the_ledger_is_bounded_by_ranges() -> None:
    delivery = Delivery(DeliverySettings(max_seq_ranges=2))
    node = Node(delivery)
    for seq in (1, 3, 5):  # three separate ranges: the oldest is forgotten
        node.take(seq)
    assert not delivery.is_delivered("n", 1) and delivery.is_delivered("n", 5)


class HeldWriter:
    """A remote writer that holds every send until released (what the forwarder awaits)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.sends = 0

    async def send(self, series: object) -> None:
        self.sends += 1
        await self.release.wait()


async def test_with_remote_write_the_ack_waits_and_an_in_flight_seq_is_a_duplicate() -> None:
    writer = HeldWriter()
    delivery = Delivery(remote_write=writer)  # type: ignore[arg-type]
    node = Node(delivery)
    assert node.take(1) == (False, ())
    assert node.session.queued == 1 and not delivery.is_delivered("n", 1)
    assert node.take(1) == (True, ())  # sent again while waiting: acknowledged once, later
    writer.release.set()
    for _ in range(100):
        if node.sent:
            break
        await asyncio.sleep(0.01)
    assert node.sent == [Ack(seq=1)] and delivery.is_delivered("n", 1)
    assert writer.sends == 1 and delivery.forward_stats.delivered == 1
    await delivery.aclose()


async def test_closing_forgets_what_waited_so_the_agent_sends_it_again() -> None:
    writer = HeldWriter()
    delivery = Delivery(remote_write=writer)  # type: ignore[arg-type]
    node = Node(delivery)
    node.take(1)
    node.session.close()
    writer.release.set()
    await asyncio.sleep(0.02)
    assert node.sent == [] and not delivery.is_delivered("n", 1)
    again = Node(delivery)
    assert again.take(1) == (False, ())  # not a duplicate: it was never delivered
    await delivery.aclose()
