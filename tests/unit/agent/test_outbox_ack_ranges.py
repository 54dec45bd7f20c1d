"""The agent's side of ACK_RANGES (issue 15): a range frame does exactly what one ACK per
covered seq would, and only to seqs sent on this connection; nothing leaves the spool
before it is acknowledged."""

from __future__ import annotations

from pathlib import Path

from edge_agent.config import MAX_ACK_DELAY_SECONDS, heartbeat_seconds, load, silence_timeout
from edge_agent.outbox import Dispatch, Outbox
from edge_agent.spool import Spool
from gpurelay.wire import Ack, AckRanges, Frame, FrameEncoder
from gpurelay.wire.frames import MAX_ACK_DELAY_SECONDS as WIRE_MAX_ACK_DELAY
from gpurelay.wire.frames import MAX_SEQ
from tests.unit.agent.test_outbox import snap
from tests.unit.agent.test_tunnel_backoff import tunnel


def sent(tmp_path: Path, name: str) -> tuple[Outbox, Dispatch]:
    """Seqs 1..10 spooled; 10 sent live, 1..9 as replays (window 9)."""
    box = Outbox(Spool(tmp_path / name), max_in_flight=9, wall_clock=lambda: 0.001)
    for i in range(10):
        box.put(snap(i))
    d = box.dispatch()
    d.sent_live(10)
    while (b := d.next_replay()) is not None:
        d.sent_replay(b.seq)
    assert d.in_flight == set(range(1, 11)) and not d.room()
    return box, d


def spooled(box: Outbox) -> list[int]:
    assert box.spool is not None
    return [b.seq for b in box.spool.pending(limit=100)]


def test_a_range_frame_acknowledges_like_the_same_single_acks(tmp_path: Path) -> None:
    ranges = [(2, 4), (7, 7), (10, 10)]
    single_box, single = sent(tmp_path, "single.sqlite")
    single.acked([2, 3, 4, 7, 10])
    range_box, ranged = sent(tmp_path, "ranges.sqlite")
    ranged.acked_ranges(ranges)
    assert ranged.in_flight == single.in_flight == {1, 5, 6, 8, 9}
    assert spooled(range_box) == spooled(single_box) == [1, 5, 6, 8, 9]
    assert ranged.room()  # acknowledged replays free the window, as single ACKs do


def test_a_vast_range_costs_no_more_than_the_seqs_in_flight(tmp_path: Path) -> None:
    box, d = sent(tmp_path, "s.sqlite")
    d.acked_ranges([(0, MAX_SEQ)])  # would take forever to expand
    assert d.in_flight == set() and spooled(box) == []
    d.acked_ranges([])
    d.acked_ranges([(5, 6)])  # acknowledged again: nothing changes
    assert spooled(box) == []


def test_seqs_not_sent_on_this_connection_stay_in_the_spool(tmp_path: Path) -> None:
    box = Outbox(Spool(tmp_path / "s.sqlite"), max_in_flight=2, wall_clock=lambda: 0.001)
    for i in range(5):
        box.put(snap(i))
    d = box.dispatch()
    d.sent_live(5)
    d.acked_ranges([(1, 5)])  # 1..4 were never sent here: not this connection's to drop
    assert spooled(box) == [1, 2, 3, 4]


class OneRead:
    """A channel that delivers ``frames`` in one read, then the gateway closes it."""

    def __init__(self, *frames: Frame) -> None:
        encoder = FrameEncoder()
        self.data = [b"".join(encoder.encode(f) for f in frames), b""]

    async def read(self, n: int) -> bytes:
        return self.data.pop(0)


async def test_the_tunnel_applies_every_range_frame_of_a_read(tmp_path: Path) -> None:
    """Two ACK_RANGES frames and a single ACK in one read: each frame's ranges are applied
    on their own (together they are not one ascending list)."""
    box, d = sent(tmp_path, "s.sqlite")
    t = tunnel(tmp_path / "pki")
    t._dispatch = d
    reader = OneRead(
        AckRanges(ranges=((3, 4), (9, 9))), AckRanges(ranges=((1, 1), (6, 7))), Ack(seq=10)
    )
    await t._inbound().run(reader, 5.0)  # type: ignore[arg-type]
    assert spooled(box) == [2, 5, 8]
    assert d.in_flight == {2, 5, 8}
    assert t.stats.acked_seq == 10 and t._acked_this_session


def test_the_agent_asks_for_range_acks_and_hears_from_the_gateway_once_per_delay() -> None:
    """The heartbeat period asked is never shorter than the ACK delay (else HEARTBEATs
    would replace the ACK frames saved), and the silence timeout follows it."""
    default = load(None, {}).gateway
    assert default.ack_delay_seconds == 3.0
    assert heartbeat_seconds(1.0, default.ack_delay_seconds) == 3.0
    assert silence_timeout(default, 1.0) == 14.0  # 3 x 3 s + 5 s
    assert silence_timeout(default, 10.0) == 20.0  # 3 x 5 s + 5 s, as before
    # issue 26: at 10 s a heartbeat every 10 s (not 5 s), dropped after the same 20 s
    assert heartbeat_seconds(10.0, 3.0, silence_timeout(default, 10.0)) == 10.0
    assert heartbeat_seconds(60.0, 3.0, 20.0) == 10.0
    assert heartbeat_seconds(10.0, 3.0, 8.0) == 4.0  # half a short silence timeout
    assert heartbeat_seconds(5.0, 3.0, 20.0) == 5.0  # the interval, as before
    old = load(None, {"EDGE_AGENT_GATEWAY_ACK_DELAY_SECONDS": "0"}).gateway
    assert heartbeat_seconds(1.0, old.ack_delay_seconds) == 1.0
    assert silence_timeout(old, 1.0) == 8.0  # issue 13's figure, one ACK per batch
    assert MAX_ACK_DELAY_SECONDS == WIRE_MAX_ACK_DELAY
