"""Ingest of BATCH and REPLAY frames, with and without remote write: one ACK per seq, sent
only once the seq is safely taken; replays never touch /metrics; back-pressure."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import cramjam
import httpx
import pytest

from cloud_gateway.ingest.delivery import Delivery, DeliverySettings
from cloud_gateway.ingest.session import Ingest, NodeSession
from cloud_gateway.registry.store import Registry
from cloud_gateway.remote_write.client import RemoteWriter
from cloud_gateway.remote_write.config import RemoteWriteConfig
from cloud_gateway.remote_write.prompb import Series
from gpurelay.model import Family, Sample, Snapshot
from gpurelay.record import RecordEncoder
from gpurelay.wire import Ack, Batch, Declare, Frame, Hello, Replay, SeriesDecl, WireError
from tests.unit.gateway.remote_write.test_prompb import decode_write_request

URL = "http://receiver.test/api/v1/write"
T0 = 1_790_000_000.0
NODE = "edge-1"
UTIL = "DCGM_FI_DEV_GPU_UTIL"

# --------------------------------------------------------------------------- helpers


class Receiver:
    """A remote write receiver behind httpx.MockTransport: answers ``status`` (a callable
    of the decoded request, so a test can refuse one collection), waits on ``gate``."""

    def __init__(self) -> None:
        self.requests: list[list[Series]] = []
        self.status: Callable[[list[Series]], int] = lambda series: 204
        self.gate = asyncio.Event()
        self.gate.set()

    async def handler(self, request: httpx.Request) -> httpx.Response:
        await self.gate.wait()
        series = decode_write_request(bytes(cramjam.snappy.decompress_raw(request.content)))
        self.requests.append(series)
        status = self.status(series)
        return httpx.Response(status, text="out of order sample" if status == 400 else "")

    def writer(self) -> RemoteWriter:
        client = httpx.AsyncClient(transport=httpx.MockTransport(self.handler))
        return RemoteWriter(RemoteWriteConfig(url=URL), client=client)

    def timestamps(self) -> set[int]:
        return {ts for req in self.requests for _, points in req for ts, _ in points}


class Agent:
    """One session as the SSH channel drives it: frames in, replies and later ACKs out."""

    def __init__(self, ingest: Ingest) -> None:
        self.acks: list[int] = []  # deferred ones (after the frame was handled), in order
        self._now: list[int] | None = None  # while a frame is handled: its ACKs
        self.session: NodeSession = ingest.open_session(
            NODE, "10.0.0.1:1", lambda reason: None, self._sent
        )
        self.handle(Hello(agent_version="0.1.0", node=NODE, interval_seconds=10.0))
        decls = (
            SeriesDecl(id=0, name=UTIL, type="gauge", help="", labels=(("gpu", "0"),)),
            SeriesDecl(id=1, name=UTIL, type="gauge", help="", labels=(("gpu", "1"),)),
        )
        self.handle(Declare(series=decls))

    def _sent(self, frame: Frame) -> None:
        assert isinstance(frame, Ack)
        (self.acks if self._now is None else self._now).append(frame.seq)

    def handle(self, frame: Frame) -> list[int]:
        """The seqs acknowledged at once (written while the frame was handled)."""
        self._now = []
        try:
            self.session.handle(frame)
            return self._now
        finally:
            self._now = None

    def batch(self, seq: int, *values: tuple[int, float]) -> list[int]:
        return self.handle(Batch(seq=seq, timestamp=T0 + seq, values=values))

    def replay(self, seq: int, values: dict[str, float] | None = None) -> list[int]:
        return self.handle(Replay(seq=seq, record=record(seq, values or {"0": 1.0})))


def record(seq: int, values: dict[str, float]) -> bytes:
    """A spooled collection taken at T0 + seq: GPU_UTIL per gpu."""
    samples = tuple(Sample(UTIL, (("gpu", gpu), ("Hostname", "x")), v) for gpu, v in values.items())
    fam = Family(name=UTIL, type="gauge", help="")
    return RecordEncoder().encode(
        Snapshot(node="x", timestamp=T0 + seq, families=(fam,), samples=samples)
    )


def setup(receiver: Receiver | None = None, **kwargs: object) -> tuple[Registry, Ingest, Agent]:
    registry = Registry()
    ingest = Ingest(
        registry,
        clock=lambda: T0,
        delivery=Delivery(
            DeliverySettings(retry_backoff=(0.01, 0.02), **kwargs),  # type: ignore[arg-type]
            remote_write=receiver.writer() if receiver else None,
        ),
    )
    return registry, ingest, Agent(ingest)


def metrics_lines(registry: Registry) -> list[str]:
    return [
        line for _, bs in registry.family_blocks() for b in bs for line in b.decode().split("\n")
    ]


async def settle(predicate: Callable[[], object], timeout: float = 5.0) -> None:
    async def wait() -> None:
        while not predicate():
            await asyncio.sleep(0.005)

    await asyncio.wait_for(wait(), timeout)


def ms(seq: int) -> int:
    return round((T0 + seq) * 1000)


# --------------------------------------------------------------------------- remote write off


def test_without_remote_write_batches_and_replays_are_acknowledged_at_once() -> None:
    registry, ingest, agent = setup()
    assert agent.batch(10, (0, 50.0), (1, 60.0)) == [10]
    before = metrics_lines(registry)
    assert agent.replay(3, {"0": 99.0}) == [3]
    assert agent.replay(3, {"0": 99.0}) == [3]  # again: a duplicate, acknowledged again
    assert agent.batch(10, (0, 70.0)) == [10]  # a delivered live seq: a duplicate too
    assert metrics_lines(registry) == before  # neither the replay nor the duplicate shows
    assert (ingest.stats.batches, ingest.stats.replays, ingest.stats.duplicates) == (2, 2, 2)
    assert ingest.delivery.is_delivered(NODE, 3) and ingest.delivery.is_delivered(NODE, 10)
    assert agent.acks == []


@pytest.mark.parametrize("with_rw", [False, True])
async def test_a_malformed_replay_is_a_wire_error(with_rw: bool) -> None:
    _, _, agent = setup(Receiver() if with_rw else None)
    with pytest.raises(WireError) as err:
        agent.handle(Replay(seq=1, record=b"GR1 not zlib"))
    assert err.value.code == "malformed"
    agent.session.closed("test")


async def test_replayed_series_are_stamped_and_reserved_names_left_out() -> None:
    receiver = Receiver()
    _, ingest, agent = setup(receiver)
    fam = Family(name="gpurelay_gateway_fake", type="gauge", help="")
    samples = (
        Sample("gpurelay_gateway_fake", (), 1.0),
        Sample(UTIL, (("gpu", "0"), ("Hostname", "someone-else")), 5.0),
    )
    data = RecordEncoder().encode(
        Snapshot(node="x", timestamp=T0, families=(fam,), samples=samples)
    )
    assert agent.handle(Replay(seq=1, record=data)) == []
    await settle(lambda: agent.acks == [1])
    assert receiver.requests == [
        [((("Hostname", NODE), ("__name__", UTIL), ("gpu", "0")), [(round(T0 * 1000), 5.0)])]
    ]
    assert ingest.stats.rejected_series  # the reserved name, counted once
    agent.session.closed("test")


# --------------------------------------------------------------------------- remote write on


async def test_live_batches_are_acknowledged_after_the_receiver_took_their_full_state() -> None:
    receiver = Receiver()
    receiver.gate.clear()
    registry, ingest, agent = setup(receiver)
    assert agent.batch(1, (0, 50.0), (1, 60.0)) == []
    assert agent.batch(2, (0, 55.0)) == []  # only gpu 0 changed; the write has both
    assert f'{UTIL}{{gpu="0",Hostname="{NODE}"}} 55' in metrics_lines(registry)  # at once
    assert ingest.forward_stats.queued == 2 and agent.session.queued == 2
    await asyncio.sleep(0.05)
    assert agent.acks == [] and not ingest.delivery.is_delivered(NODE, 1)
    receiver.gate.set()
    await settle(lambda: agent.acks == [1, 2])
    gpu0 = (("Hostname", NODE), ("__name__", UTIL), ("gpu", "0"))
    gpu1 = (("Hostname", NODE), ("__name__", UTIL), ("gpu", "1"))
    sent = {labels: points for req in receiver.requests for labels, points in req}
    assert sent[gpu0] == [(ms(1), 50.0), (ms(2), 55.0)]
    assert sent[gpu1] == [(ms(1), 60.0), (ms(2), 60.0)]
    assert ingest.delivery.is_delivered(NODE, 1) and ingest.delivery.is_delivered(NODE, 2)
    assert ingest.forward_stats.queued == 0 and ingest.forward_stats.delivered == 2
    agent.session.closed("test")


async def test_nothing_is_acknowledged_while_the_receiver_is_down() -> None:
    receiver = Receiver()
    down = True
    receiver.status = lambda series: 503 if down else 204
    _, ingest, agent = setup(receiver)
    agent.batch(1, (0, 50.0), (1, 60.0))
    agent.replay(0)
    await settle(lambda: ingest.forward_stats.unavailable >= 3)
    assert agent.acks == [] and not ingest.delivery.is_delivered(NODE, 0)
    down = False
    await settle(lambda: agent.acks == [1, 0])
    assert ingest.delivery.is_delivered(NODE, 0) and ingest.forward_stats.dropped == 0
    assert ms(0) in receiver.timestamps() and ms(1) in receiver.timestamps()
    agent.session.closed("test")


async def test_a_refused_collection_is_acknowledged_dropped_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    receiver = Receiver()
    receiver.gate.clear()  # let the three queue up: they go out as one coalesced send
    receiver.status = lambda series: (
        400 if any(ts == ms(2) for _, p in series for ts, _ in p) else 204
    )
    _, ingest, agent = setup(receiver)
    for seq in (1, 2, 3):
        agent.replay(seq)
    receiver.gate.set()
    await settle(lambda: sorted(agent.acks) == [1, 2, 3])
    assert agent.acks == [1, 2, 3]  # in order
    assert ingest.forward_stats.dropped == 1 and ingest.forward_stats.delivered == 2
    # the group was refused, then sent one by one: only seq 2 is lost
    assert [len(r) for r in receiver.requests] == [1, 1, 1, 1]
    assert all(ingest.delivery.is_delivered(NODE, s) for s in (1, 2, 3))
    (refused,) = [r for r in caplog.records if "seq 2" in r.getMessage()]
    assert refused.name.endswith(f"node.{NODE}") and "out of order sample" in refused.getMessage()
    assert ingest.delivery.remote_write is not None
    assert ingest.delivery.remote_write.stats.rejected_requests == 2
    agent.session.closed("test")


async def test_a_duplicate_replay_is_not_sent_again() -> None:
    receiver = Receiver()
    receiver.gate.clear()
    _, ingest, agent = setup(receiver)
    assert agent.replay(5) == []
    assert agent.replay(5) == []  # waiting already: one send, one ACK when it is delivered
    receiver.gate.set()
    await settle(lambda: agent.acks == [5])
    assert agent.replay(5) == [5]  # delivered: acknowledged at once, not sent
    await asyncio.sleep(0.02)
    assert len(receiver.requests) == 1 and agent.acks == [5]
    assert ingest.stats.duplicates == 2 and ingest.stats.replays == 3
    agent.session.closed("test")


async def test_flow_holds_the_channel_while_the_queue_is_over_its_bound() -> None:
    receiver = Receiver()
    receiver.gate.clear()
    _, _, agent = setup(receiver, max_queued_batches=2, max_samples_per_send=1)
    for seq in (1, 2):
        agent.batch(seq, (0, float(seq)))
    await asyncio.wait_for(agent.session.flow(), 0.5)  # at the bound: not held
    agent.batch(3, (0, 3.0))
    held = asyncio.create_task(agent.session.flow())
    await asyncio.sleep(0.05)
    assert not held.done()
    receiver.gate.set()
    await asyncio.wait_for(held, 5)
    await settle(lambda: agent.acks == [1, 2, 3])
    agent.session.closed("test")


async def test_closing_the_session_releases_flow_and_forgets_the_queue() -> None:
    receiver = Receiver()
    receiver.gate.clear()
    _, ingest, agent = setup(receiver, max_queued_batches=1)
    for seq in (1, 2, 3):
        agent.batch(seq, (0, float(seq)))
    held = asyncio.create_task(agent.session.flow())
    await asyncio.sleep(0.02)
    assert not held.done()
    agent.session.closed("agent disconnected")
    await asyncio.wait_for(held, 1)
    assert ingest.forward_stats.queued == 0
    receiver.gate.set()
    await asyncio.sleep(0.05)
    assert agent.acks == [] and not ingest.delivery.is_delivered(NODE, 1)  # the agent sends again
    await ingest.aclose()
