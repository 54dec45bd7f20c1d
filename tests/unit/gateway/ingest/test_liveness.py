"""Protocol liveness on the gateway (issue 13), with a fake clock and no sockets: the
sweep closes a connection that has received nothing for the node's silent threshold, does
not blame the node while the gateway itself holds reading, and sends HEARTBEATs to agents
that asked for them whenever it has sent them nothing for their period."""

from __future__ import annotations

import asyncio

import cramjam
import httpx

from cloud_gateway.ingest.delivery import Delivery, DeliverySettings
from cloud_gateway.ingest.session import Ingest
from cloud_gateway.registry.config import LivenessPolicy
from cloud_gateway.registry.store import Registry, StoreConfig
from cloud_gateway.remote_write.client import RemoteWriter
from cloud_gateway.remote_write.config import RemoteWriteConfig
from gpurelay.wire import Ack, Batch, Declare, Frame, Heartbeat, Hello, SeriesDecl

T0 = 1_790_000_000.0
NODE = "edge-1"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Link:
    """One agent's session as the SSH channel drives it."""

    def __init__(self, ingest: Ingest, *, interval: float = 1.0, heartbeat: float = 0.0) -> None:
        self.sent: list[Frame] = []
        self.closed: list[str] = []
        self.session = ingest.open_session(NODE, "10.0.0.1:1", self._close, self.sent.append)
        hello = Hello(
            agent_version="0", node=NODE, interval_seconds=interval, heartbeat_seconds=heartbeat
        )
        self.session.handle(hello)
        decl = SeriesDecl(id=0, name="DCGM_FI_DEV_GPU_UTIL", type="gauge", help="", labels=())
        self.session.handle(Declare(series=(decl,)))
        self.seq = 0

    def _close(self, reason: str) -> None:
        self.closed.append(reason)
        self.session.closed(reason)  # what the SSH channel does once it is closed

    def batch(self) -> None:
        self.seq += 1
        self.session.received(40)
        self.session.handle(Batch(seq=self.seq, timestamp=T0, values=((0, 1.0),)))


def gateway(clock: Clock, *, remote_write: RemoteWriter | None = None) -> Ingest:
    registry = Registry(StoreConfig(liveness=LivenessPolicy(margin_seconds=2)))
    return Ingest(
        registry,
        clock=lambda: T0 + clock.t,
        monotonic=clock,
        delivery=Delivery(DeliverySettings(max_queued_batches=1), remote_write=remote_write),
    )


def test_a_connection_silent_past_its_threshold_is_closed_and_the_node_is_offline() -> None:
    clock = Clock()
    ingest = gateway(clock)
    link = Link(ingest, interval=1.0)
    for _ in range(5):
        clock.t += 1.0
        link.batch()
        ingest.sweep()
    assert link.closed == []
    clock.t += 7.9  # 6 intervals + the 2 s margin = 8 s
    ingest.sweep()
    assert link.closed == []
    assert ingest.registry.node(NODE, now=T0 + clock.t).state == "stale"  # type: ignore[union-attr]
    clock.t += 0.2
    ingest.sweep()
    assert link.closed == ["silent for 8.1s"]
    assert ingest.stats.silent_closed == 1
    view = ingest.registry.node(NODE, now=T0 + clock.t)
    assert view is not None and view.state == "offline"
    assert "nothing received for 8.1s" in view.recent_errors[-1].message
    ingest.sweep()
    assert len(link.closed) == 1  # closed once


def test_any_bytes_count_as_heard_even_in_the_middle_of_a_large_frame() -> None:
    clock = Clock()
    ingest = gateway(clock)
    link = Link(ingest, interval=1.0)
    for _ in range(20):  # a big REPLAY trickling in over a slow link: 20 s, no whole frame
        clock.t += 1.0
        link.session.received(1400)
        ingest.sweep()
    assert link.closed == []


async def test_the_node_is_not_blamed_while_the_gateway_holds_reading() -> None:
    """Remote write down and the node's queue full: the SSH channel stops reading, so
    nothing is received; that silence is the gateway's, not the node's."""
    gate = asyncio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        cramjam.snappy.decompress_raw(request.content)
        await gate.wait()
        return httpx.Response(204)

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    writer = RemoteWriter(RemoteWriteConfig(url="http://rw.test/api/v1/write"), client=client)
    clock = Clock()
    ingest = gateway(clock, remote_write=writer)
    link = Link(ingest, interval=1.0, heartbeat=1.0)
    for _ in range(3):
        link.batch()
        await asyncio.sleep(0)
    assert ingest._sessions[1]._delivery.held
    for _ in range(30):
        clock.t += 1.0
        ingest.sweep()
    assert link.closed == []
    # ... and the agent kept hearing from us all along: heartbeats, since no ACK went out
    beats = [f for f in link.sent if isinstance(f, Heartbeat)]
    assert len(beats) >= 30 and beats[-1] == Heartbeat(received=3)
    assert not any(isinstance(f, Ack) for f in link.sent)
    gate.set()
    await ingest.aclose()
    await writer.close()


def test_heartbeats_go_only_to_agents_that_asked_and_only_when_quiet() -> None:
    clock = Clock()
    ingest = gateway(clock)
    old = Link(ingest, interval=1.0)  # an older agent: no heartbeat_seconds in HELLO
    for _ in range(5):
        clock.t += 1.0
        old.batch()
        ingest.sweep()
    assert not any(isinstance(f, Heartbeat) for f in old.sent)

    ingest = gateway(clock)
    link = Link(ingest, interval=1.0, heartbeat=2.0)
    assert isinstance(link.sent[0], Heartbeat)  # at once, after HELLO
    start = len(link.sent)
    for _ in range(6):  # a batch (and its ACK) every second: no heartbeat needed
        clock.t += 1.0
        link.batch()
        ingest.sweep()
    assert not any(isinstance(f, Heartbeat) for f in link.sent[start:])
    clock.t += 2.0  # nothing sent for 2 s
    link.session.received(10)
    ingest.sweep()
    assert link.sent[-1] == Heartbeat(received=6)
    assert ingest.stats.heartbeats == 2
