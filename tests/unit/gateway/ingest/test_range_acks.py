"""Range ACKs on the gateway (issue 15): an agent that asks for ``ack_delay_seconds`` gets
one ACK_RANGES frame every few batches instead of one ACK frame per batch, with a fake
clock and no sockets. Every seq is still acknowledged exactly as before (the same set,
never before delivery says so); replays are acknowledged at the end of their read; the
frames stand in for HEARTBEATs; nothing waits past the delay plus one tick."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from types import SimpleNamespace

import cramjam
import httpx

from cloud_gateway.ingest.acks import MAX_PENDING_ACKS
from cloud_gateway.ingest.delivery import Delivery
from cloud_gateway.ingest.session import Ingest
from cloud_gateway.registry.store import Registry
from cloud_gateway.remote_write.client import RemoteWriter
from cloud_gateway.remote_write.config import RemoteWriteConfig
from cloud_gateway.ssh.server import _TelemetryChannel
from gpurelay.wire import (
    Ack,
    AckRanges,
    Batch,
    Declare,
    Frame,
    FrameDecoder,
    Goodbye,
    Heartbeat,
    Hello,
    Limits,
    Replay,
    SeriesDecl,
)
from tests.unit.gateway.ingest.test_ingest_replay import record

T0 = 1_790_000_000.0
NODE = "edge-1"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Channel:
    """One agent's session as the SSH channel drives it: every frame written to the agent
    (replies, the end-of-read flush, and frames sent later), in order, with the time."""

    def __init__(
        self,
        ingest: Ingest,
        clock: Clock,
        *,
        delay: float,
        heartbeat: float,
        write: Callable[[Frame], None] | None = None,
    ) -> None:
        self.clock = clock
        self.written: list[tuple[float, Frame]] = []
        self.session = ingest.open_session(
            NODE, "10.0.0.1:1", lambda reason: None, write or self._later
        )
        hello = Hello(
            agent_version="0",
            node=NODE,
            interval_seconds=1.0,
            heartbeat_seconds=heartbeat,
            ack_delay_seconds=delay,
        )
        self.read(hello)
        decl = SeriesDecl(id=0, name="DCGM_FI_DEV_GPU_UTIL", type="gauge", help="", labels=())
        self.read(Declare(series=(decl,)))
        self.sent_at: dict[int, float] = {}

    def _later(self, frame: Frame) -> None:
        self.written.append((self.clock.t, frame))

    def read(self, *frames: Frame) -> None:
        """One chunk read from the channel, carrying ``frames`` (what ssh_server does)."""
        self.session.received(100)
        for frame in frames:
            self.session.handle(frame)
        self.session.read_done()

    def batch(self, seq: int) -> None:
        self.sent_at[seq] = self.clock.t
        self.read(Batch(seq=seq, timestamp=T0 + seq, values=((0, float(seq)),)))

    def ack_frames(self) -> list[Frame]:
        return [f for _, f in self.written if isinstance(f, Ack | AckRanges)]

    def acked(self) -> list[int]:
        """Every seq acknowledged, in the order the agent learns it (repeats kept)."""
        out: list[int] = []
        for frame in self.ack_frames():
            if isinstance(frame, Ack):
                out.append(frame.seq)
            else:
                assert isinstance(frame, AckRanges)
                out += [s for first, last in frame.ranges for s in range(first, last + 1)]
        return out

    def ack_times(self) -> dict[int, float]:
        times: dict[int, float] = {}
        for t, frame in self.written:
            if isinstance(frame, AckRanges):
                for first, last in frame.ranges:
                    for s in range(first, last + 1):
                        times.setdefault(s, t)
            elif isinstance(frame, Ack):
                times.setdefault(frame.seq, t)
        return times


def gateway(clock: Clock, remote_write: RemoteWriter | None = None) -> Ingest:
    return Ingest(
        Registry(),
        clock=lambda: T0 + clock.t,
        monotonic=clock,
        delivery=Delivery(remote_write=remote_write),
    )


def run_steady(delay: float, heartbeat: float, batches: int) -> tuple[Ingest, Channel]:
    """A batch every second, half-way between two of the gateway's 1 s ticks."""
    clock = Clock()
    ingest = gateway(clock)
    channel = Channel(ingest, clock, delay=delay, heartbeat=heartbeat)
    for seq in range(1, batches + 1):
        clock.t += 0.5
        channel.batch(seq)
        clock.t += 0.5
        ingest.sweep()
    return ingest, channel


def test_range_acks_write_one_frame_every_few_batches_instead_of_one_per_batch() -> None:
    n = 60
    ingest, old = run_steady(delay=0.0, heartbeat=1.0, batches=n)  # what an agent asks today
    assert len(old.ack_frames()) == n and ingest.stats.ack_frames == n
    assert old.acked() == list(range(1, n + 1))

    ingest, new = run_steady(delay=3.0, heartbeat=3.0, batches=n)  # what it asks now
    frames = new.ack_frames()
    assert all(isinstance(f, AckRanges) for f in frames)
    assert len(frames) <= n // 3, len(frames)  # 15 here: one per 4 batches
    assert ingest.stats.ack_frames == len(frames)
    # the same seqs as before, each once, in order; each within the delay + one tick
    acked = new.acked()
    assert acked == list(range(1, len(acked) + 1)) and len(acked) >= n - 4  # some still wait
    rest = [AckRanges(ranges=((len(acked) + 1, n),))] if len(acked) < n else []
    before = len(new.written)
    new.session.flush()
    assert [f for _, f in new.written[before:]] == rest
    waited = [t - new.sent_at[s] for s, t in new.ack_times().items()]
    assert min(waited) >= 0.0 and max(waited) <= 3.0 + 1.0
    # ACKs stand in for HEARTBEATs: none after the first, right after HELLO
    beats = [f for _, f in new.written if isinstance(f, Heartbeat)]
    assert len(beats) == 1 and ingest.stats.heartbeats == 1
    # the gateway writes something at least every heartbeat period (+ one tick)
    times = [t for t, _ in new.written]
    assert max(b - a for a, b in itertools.pairwise(times)) <= 3.0 + 1.0


def test_a_quiet_connection_still_gets_heartbeats_at_its_period() -> None:
    clock = Clock()
    ingest = gateway(clock)
    channel = Channel(ingest, clock, delay=3.0, heartbeat=3.0)
    channel.batch(1)
    for _ in range(12):
        clock.t += 1.0
        channel.session.received(0)
        ingest.sweep()
    kinds = [type(f).__name__ for _, f in channel.written]
    assert kinds == ["Heartbeat", "AckRanges", "Heartbeat", "Heartbeat", "Heartbeat"]
    assert channel.acked() == [1]


def test_replays_are_acknowledged_at_the_end_of_their_read() -> None:
    """The agent holds at most ``max_in_flight`` replays unacknowledged: their ACKs must
    not wait for the delay, or a backlog would crawl."""
    clock = Clock()
    ingest = gateway(clock)
    channel = Channel(ingest, clock, delay=3.0, heartbeat=3.0)
    channel.batch(100)  # a live batch waits for its delay ...
    assert channel.ack_frames() == []
    replays = [Replay(seq=s, record=record(s, {"0": float(s)})) for s in range(10, 20)]
    channel.read(*replays[:6])  # ... until a read carrying replays: one frame for all
    channel.read(*replays[6:])
    assert channel.ack_frames() == [
        AckRanges(ranges=((10, 15), (100, 100))),
        AckRanges(ranges=((16, 19),)),
    ]
    channel.read(Replay(seq=12, record=record(12, {"0": 1.0})))  # a duplicate: at once too
    assert channel.ack_frames()[-1] == AckRanges(ranges=((12, 12),))
    assert ingest.stats.duplicates == 1


def test_at_most_a_bounded_number_of_acks_wait() -> None:
    clock = Clock()
    ingest = gateway(clock)
    channel = Channel(ingest, clock, delay=60.0, heartbeat=60.0)
    for seq in range(1, 2 * MAX_PENDING_ACKS + 1):  # a fast interval, no tick in between
        channel.batch(seq)
    assert channel.ack_frames() == [
        AckRanges(ranges=((1, MAX_PENDING_ACKS),)),
        AckRanges(ranges=((MAX_PENDING_ACKS + 1, 2 * MAX_PENDING_ACKS),)),
    ]


def test_everything_waiting_is_written_before_the_connection_ends() -> None:
    clock = Clock()
    ingest = gateway(clock)
    channel = Channel(ingest, clock, delay=3.0, heartbeat=3.0)
    for seq in (1, 2, 4):
        channel.batch(seq)
    assert channel.ack_frames() == []  # not due yet
    channel.session.read_done()
    assert channel.ack_frames() == []  # a read's end writes only ACKs due at once
    channel.session.flush()
    assert channel.ack_frames() == [AckRanges(ranges=((1, 2), (4, 4)))]
    channel.session.flush()
    assert channel.ack_frames() == [AckRanges(ranges=((1, 2), (4, 4)))]  # each once


def test_an_older_agent_gets_one_ack_frame_per_batch_at_once() -> None:
    _, channel = run_steady(delay=0.0, heartbeat=0.0, batches=5)
    assert [f for _, f in channel.written] == [Ack(seq=s) for s in range(1, 6)]


async def test_with_remote_write_acks_wait_for_the_receiver_then_for_their_turn() -> None:
    """Remote write on: nothing is acknowledged before the receiver took it (as with
    single ACKs); then a live batch's ACK waits for the delay, a replay's goes at once."""
    gate = asyncio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        cramjam.snappy.decompress_raw(request.content)
        await gate.wait()
        return httpx.Response(204)

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    writer = RemoteWriter(RemoteWriteConfig(url="http://rw.test/api/v1/write"), client=client)
    clock = Clock()
    ingest = gateway(clock, remote_write=writer)
    channel = Channel(ingest, clock, delay=3.0, heartbeat=3.0)
    try:
        channel.batch(1)
        channel.batch(2)
        for _ in range(5):
            await asyncio.sleep(0)
        clock.t += 5.0
        ingest.sweep()  # due by age, but the receiver has not taken them: nothing to write
        assert channel.ack_frames() == []
        gate.set()
        for _ in range(20):
            await asyncio.sleep(0)
        assert channel.ack_frames() == []  # taken now, and waiting for their delay
        clock.t += 3.0
        ingest.sweep()
        assert channel.ack_frames() == [AckRanges(ranges=((1, 2),))]
        channel.read(Replay(seq=5, record=record(5, {"0": 1.0})))
        assert len(channel.ack_frames()) == 1  # the receiver has it, no ACK yet
        for _ in range(20):
            await asyncio.sleep(0)
        assert channel.ack_frames()[-1] == AckRanges(ranges=((5, 5),))  # no tick needed
    finally:
        await ingest.aclose()
        await writer.close()


class FakeConnection:
    def __init__(self) -> None:
        self.closed = 0

    def get_owner(self) -> None:
        return None

    def close(self) -> None:
        self.closed += 1


class FakeProcess:
    """What _TelemetryChannel uses of an asyncssh server process: stdout, the connection."""

    def __init__(self) -> None:
        self.conn = FakeConnection()
        self.stdout = self
        self.written = bytearray()

    def get_extra_info(self, name: str) -> object:
        return self.conn

    def write(self, data: bytes) -> None:
        self.written += data

    def frames(self) -> list[Frame]:
        return FrameDecoder().feed(bytes(self.written))


def test_goodbye_and_close_write_the_waiting_acks_first() -> None:
    """What is acknowledged but not written yet leaves before GOODBYE (gateway shutdown)
    and before the gateway closes a connection, so the agent need not send it again."""
    for end in ("goodbye", "close"):
        clock = Clock()
        ingest = gateway(clock)
        process = FakeProcess()
        server = SimpleNamespace(_limits=Limits())
        ssh = _TelemetryChannel(server, process, NODE, "10.0.0.1:1")  # type: ignore[arg-type]
        channel = Channel(ingest, clock, delay=3.0, heartbeat=3.0, write=ssh._send)
        ssh._session = channel.session
        channel.batch(1)
        channel.batch(2)
        assert process.frames() == [Heartbeat(received=0)]  # HELLO's; the ACKs wait
        if end == "goodbye":
            ssh.goodbye("gateway shutting down")
            assert process.frames()[1:] == [
                AckRanges(ranges=((1, 2),)),
                Goodbye(reason="gateway shutting down"),
            ]
        else:
            ssh.close("silent for 9s")
            assert process.frames()[1:] == [AckRanges(ranges=((1, 2),))]
            assert process.conn.closed == 1
