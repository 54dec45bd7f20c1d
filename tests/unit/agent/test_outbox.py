"""The outbox: sequence numbers from the spool, live first, backlog oldest first."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from edge_agent.outbox import Outbox
from edge_agent.spool import Spool
from gpurelay.model import Family, Sample, Snapshot
from gpurelay.record import decode_record

NOW = time.time()


def snap(i: float) -> Snapshot:
    return Snapshot(
        node="edge-a",
        timestamp=NOW + i,
        families=(Family(name="temp", type="gauge", help="t"),),
        samples=(Sample("temp", (("gpu", "0"),), float(i)),),
    )


def test_seq_continues_from_the_spool_and_never_below_the_wall_clock(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s.sqlite")
    box = Outbox(spool, wall_clock=lambda: 1000.0)  # 1_000_000 ms
    assert [box.put(snap(i)) for i in range(3)] == [1_000_000, 1_000_001, 1_000_002]
    spool.close()
    # Restarted with a clock that stepped back: continues after the spooled high-water mark.
    again = Outbox(Spool(tmp_path / "s.sqlite"), wall_clock=lambda: 10.0)
    assert again.put(snap(3)) == 1_000_003
    # A lost spool: the wall clock still keeps seqs above anything sent before.
    fresh = Outbox(Spool(tmp_path / "other.sqlite"), wall_clock=lambda: 2000.0)
    assert fresh.put(snap(4)) == 2_000_000


def test_live_first_then_backlog_oldest_first(tmp_path: Path) -> None:
    box = Outbox(Spool(tmp_path / "s.sqlite"), wall_clock=lambda: 0.001)  # seqs from 1
    for i in range(5):
        box.put(snap(i))  # the link is down: all five wait in the spool
    d = box.dispatch()
    live = d.next_live()
    assert live is not None and live[0] == 5 and live[1].timestamp == snap(4).timestamp
    d.sent_live(5)
    assert d.next_live() is None
    replays = []
    while (b := d.next_replay()) is not None:
        replays.append(b.seq)
        d.sent_replay(b.seq)
    assert replays == [1, 2, 3, 4]
    assert decode_record(box.spool.pending(limit=1)[0].payload).values[0] == 0.0  # type: ignore[union-attr]
    # Two more collections while busy: the newest goes live, the superseded one is replayed.
    box.put(snap(5))
    box.put(snap(6))
    live = d.next_live()
    assert live is not None and live[0] == 7
    d.sent_live(7)
    b = d.next_replay()
    assert b is not None and b.seq == 6
    d.sent_replay(6)
    assert d.next_replay() is None
    # Acknowledged batches leave the spool; the rest stay for the next connection.
    d.acked([1, 2, 5, 7])
    assert box.spool is not None
    assert [b.seq for b in box.spool.pending()] == [3, 4, 6]
    again = box.dispatch()
    again.sent_live(8)  # pretend a new collection went out live on the new connection
    seqs = []
    while (b := again.next_replay()) is not None:
        seqs.append(b.seq)
        again.sent_replay(b.seq)
    assert seqs == [3, 4, 6]


def test_in_flight_window_bounds_replays_not_live(tmp_path: Path) -> None:
    box = Outbox(Spool(tmp_path / "s.sqlite"), max_in_flight=2, wall_clock=lambda: 0.001)
    for i in range(6):
        box.put(snap(i))
    d = box.dispatch()
    d.sent_live(6)
    for _ in range(2):
        b = d.next_replay()
        assert b is not None
        d.sent_replay(b.seq)
    assert not d.room()
    box.put(snap(6))
    assert d.next_live() is not None  # live is never held back by the window
    d.acked([1])
    assert d.room()


def test_full_disk_keeps_live_batches_flowing(tmp_path: Path) -> None:
    def broken(path: Path) -> sqlite3.Connection:
        raise sqlite3.OperationalError("database or disk is full")

    box = Outbox(Spool(tmp_path / "s.sqlite", connect=broken), wall_clock=lambda: 0.001)
    seq = box.put(snap(0))
    assert box.unspooled == 1
    d = box.dispatch()
    assert d.next_live() == (seq, snap(0))
    d.sent_live(seq)
    assert d.next_replay() is None
    d.acked([seq])  # acking against a broken spool does not raise


def test_without_a_spool_only_live_batches(tmp_path: Path) -> None:
    box = Outbox(None, wall_clock=lambda: 5.0)
    assert box.put(snap(0)) == 5000
    d = box.dispatch()
    d.sent_live(5000)
    assert d.next_replay() is None
