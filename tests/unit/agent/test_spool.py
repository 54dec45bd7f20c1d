"""The agent's durable spool: ordering, acks, bounds, persistence and disk failures."""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from edge_agent.spool import Spool, SpooledBatch, SpoolLimits
from harness.pipeline import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1_000_000.0)


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "state" / "spool.db"


def seqs(spool: Spool, **kwargs: Any) -> list[int]:
    return [b.seq for b in spool.pending(limit=10_000, **kwargs)]


def test_put_and_pending_oldest_first(db: Path, clock: FakeClock) -> None:
    spool = Spool(db, clock=clock)
    for seq in (1, 2, 3, 5, 4):
        assert spool.put(seq, clock.now + seq, b"p%d" % seq)
    assert seqs(spool) == [1, 2, 3, 4, 5]
    assert spool.pending(limit=2) == [
        SpooledBatch(1, clock.now + 1, b"p1"),
        SpooledBatch(2, clock.now + 2, b"p2"),
    ]
    assert seqs(spool, after_seq=3) == [4, 5]
    assert spool.pending(limit=0) == []
    st = spool.stats()
    assert (st.batches, st.bytes, st.healthy, st.write_errors) == (5, 10, True, 0)
    spool.close()


def test_state_dir_created_0700_and_wal(db: Path, clock: FakeClock) -> None:
    spool = Spool(db, clock=clock)
    assert stat.S_IMODE(db.parent.stat().st_mode) == 0o700
    assert spool.put(1, clock.now, b"x")
    with contextlib.closing(sqlite3.connect(db)) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        cols = [r[1] for r in conn.execute("PRAGMA table_info(batches)")]
        assert cols == ["seq", "ts", "size", "payload"]
    spool.close()


def test_ack_semantics(db: Path, clock: FakeClock) -> None:
    spool = Spool(db, clock=clock)
    for seq in range(1, 11):
        spool.put(seq, clock.now, b"abc")
    assert spool.ack() == 0
    assert spool.ack(3) == 3
    assert seqs(spool) == [4, 5, 6, 7, 8, 9, 10]
    assert spool.ack(seqs=[5, 7, 7, 99]) == 2
    assert seqs(spool) == [4, 6, 8, 9, 10]
    assert spool.ack(6, seqs=[9, 2]) == 3  # 4, 6 and 9
    assert seqs(spool) == [8, 10]
    assert spool.ack(3) == 0
    assert spool.stats().batches == 2
    assert spool.stats().bytes == 6
    assert spool.ack(seqs=range(1, 2000)) == 2  # more seqs than one IN chunk
    assert spool.stats().batches == 0
    spool.close()


def test_persistence_and_next_seq_across_reopen(db: Path, clock: FakeClock) -> None:
    spool = Spool(db, clock=clock)
    assert spool.next_seq() == 1
    for seq in range(1, 6):
        assert spool.put(seq, clock.now + seq, b"payload-%d" % seq)
    assert spool.next_seq() == 6
    spool.ack(2)
    spool.close()

    clock.now -= 3600  # the wall clock stepped back: seqs must not
    spool = Spool(db, clock=clock)
    assert seqs(spool) == [3, 4, 5]
    assert spool.pending(limit=1)[0].payload == b"payload-3"
    assert spool.next_seq() == 6
    assert spool.stats().batches == 3
    spool.ack(5)
    assert spool.next_seq() == 6  # acks never lower it
    spool.close()

    spool = Spool(db, clock=clock)
    assert seqs(spool) == []
    assert spool.next_seq() == 6
    spool.put(spool.next_seq(), clock.now, b"y")
    assert spool.next_seq() == 7
    spool.close()


def test_put_same_seq_replaces(db: Path, clock: FakeClock) -> None:
    spool = Spool(db, clock=clock)
    spool.put(1, clock.now, b"aaaa")
    spool.put(1, clock.now, b"bb")
    assert spool.pending() == [SpooledBatch(1, clock.now, b"bb")]
    assert (spool.stats().batches, spool.stats().bytes) == (1, 2)
    with pytest.raises(ValueError):
        spool.put(0, clock.now, b"x")
    spool.close()


def test_byte_bound_drops_oldest_and_logs_episode(
    db: Path, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="edge_agent.spool")
    spool = Spool(db, clock=clock, limits=SpoolLimits(max_bytes=1000))
    for seq in range(1, 4):
        assert spool.put(seq, clock.now, b"x" * 300)
    assert spool.stats().dropped == {"bytes": 0, "age": 0}
    for seq in range(4, 8):
        clock.now += 1
        assert spool.put(seq, clock.now, b"x" * 300)
    assert seqs(spool) == [5, 6, 7]
    st = spool.stats()
    assert st.dropped["bytes"] == 4
    assert st.bytes == 900
    assert st.batches == 3
    starts = [r for r in caplog.records if "is dropping its oldest" in r.getMessage()]
    assert len(starts) == 1, "one log line per episode, not per drop"
    assert "max_bytes=1000" in starts[0].getMessage()

    # a bigger batch makes room by dropping as many of the oldest as needed
    assert spool.put(8, clock.now, b"y" * 650)
    assert seqs(spool) == [7, 8]
    assert spool.stats().dropped["bytes"] == 6

    # space freed by acks: no more drops; after a quiet minute the episode ends, logged once
    spool.ack(8)
    clock.now += 61
    assert spool.put(9, clock.now, b"z" * 10)
    assert spool.put(10, clock.now, b"z" * 10)
    stops = [r for r in caplog.records if "stopped dropping" in r.getMessage()]
    assert len(stops) == 1
    assert "6 batches dropped" in stops[0].getMessage()
    assert spool.stats().dropped["bytes"] == 6

    # larger than the whole spool: refused, counted, nothing else dropped
    assert not spool.put(11, clock.now, b"w" * 1001)
    assert seqs(spool) == [9, 10]
    assert spool.stats().dropped["bytes"] == 7
    assert spool.next_seq() == 12
    spool.close()


def test_age_bound_drops_oldest(
    db: Path, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="edge_agent.spool")
    t0 = clock.now
    spool = Spool(db, clock=clock, limits=SpoolLimits(max_age_seconds=100))
    for i, seq in enumerate(range(1, 6)):
        clock.now = t0 + 10 * i
        assert spool.put(seq, clock.now, b"abc")
    assert spool.stats().oldest_age_seconds == pytest.approx(40)
    clock.now = t0 + 125  # seqs 1, 2 and 3 (t0, +10, +20) are now older than 100 s
    assert spool.put(6, clock.now, b"abc")
    assert seqs(spool) == [4, 5, 6]
    st = spool.stats()
    assert st.dropped == {"bytes": 0, "age": 3}
    assert st.batches == 3
    assert st.bytes == 9
    assert st.oldest_age_seconds == pytest.approx(95)
    assert sum("age bound reached" in r.getMessage() for r in caplog.records) == 1
    spool.close()
    # the bound also applies to what a previous run left behind
    clock.now = t0 + 1000
    spool = Spool(db, clock=clock, limits=SpoolLimits(max_age_seconds=100))
    assert spool.put(7, clock.now, b"abc")
    assert seqs(spool) == [7]
    assert spool.stats().dropped["age"] == 3
    spool.close()


# -- disk refusing writes -------------------------------------------------------------------


class FlakyConnection(sqlite3.Connection):
    """A connection whose writes fail while ``failing`` says so."""

    failing: dict[str, str | None] = {"error": None}  # noqa: RUF012 -- shared on purpose

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        error = self.failing["error"]
        if error is not None and sql.split(maxsplit=1)[0].upper() in {"INSERT", "UPDATE", "DELETE"}:
            raise sqlite3.OperationalError(error)
        return super().execute(sql, *args)


@pytest.fixture
def flaky() -> Iterator[dict[str, str | None]]:
    FlakyConnection.failing = {"error": None}
    yield FlakyConnection.failing
    FlakyConnection.failing = {"error": None}


def flaky_connect(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(str(path), isolation_level=None, factory=FlakyConnection)


def test_disk_full_put_returns_false_logs_once_and_recovers(
    db: Path,
    clock: FakeClock,
    caplog: pytest.LogCaptureFixture,
    flaky: dict[str, str | None],
) -> None:
    caplog.set_level(logging.INFO, logger="edge_agent.spool")
    spool = Spool(db, clock=clock, connect=flaky_connect)
    assert spool.put(1, clock.now, b"a")
    flaky["error"] = "database or disk is full"
    for seq in range(2, 6):
        assert spool.put(seq, clock.now, b"b") is False
    assert spool.ack(1) == 0
    st = spool.stats()
    assert (st.write_errors, st.healthy, st.batches) == (5, False, 1)
    assert spool.next_seq() == 6, "seqs of batches sent live are not reused"
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert errors[0].getMessage() == (
        f"spool at {db} cannot be written: database or disk is full (during put); "
        "sending live batches without spooling until it recovers"
    )

    flaky["error"] = None
    assert spool.put(6, clock.now, b"c")
    assert seqs(spool) == [1, 6]
    assert spool.stats().healthy
    assert spool.stats().write_errors == 5
    assert any("writable again after 5 failed" in r.getMessage() for r in caplog.records)
    spool.close()
    spool = Spool(db, clock=clock)
    assert spool.next_seq() == 7
    spool.close()


def test_unopenable_at_start_is_retried_by_put(
    db: Path, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    attempts: list[Path] = []

    def connect(path: Path) -> sqlite3.Connection:
        attempts.append(path)
        if len(attempts) <= 2:
            raise sqlite3.OperationalError("attempt to write a readonly database")
        return sqlite3.connect(str(path), isolation_level=None)

    spool = Spool(db, clock=clock, connect=connect)  # must not raise
    assert not spool.stats().healthy
    assert spool.pending() == []
    assert spool.put(1, clock.now, b"a") is False
    assert spool.put(2, clock.now, b"b") is True
    assert seqs(spool) == [2]
    st = spool.stats()
    assert (st.healthy, st.write_errors) == (True, 2)
    assert sum("cannot be written" in r.getMessage() for r in caplog.records) == 1
    spool.close()


def test_real_full_filesystem(
    tiny_fs: Path, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    spool = Spool(tiny_fs / "state" / "spool.db", clock=clock)
    assert spool.put(1, clock.now, b"a" * 1000)
    # fill the filesystem with something else
    filler = tiny_fs / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"\0" * 4096)
    finally:
        os.close(fd)
    seq = 2
    results = []
    while seq < 200:  # the page cache of the WAL absorbs a few; then the disk says no
        results.append(spool.put(seq, clock.now, os.urandom(4000)))
        seq += 1
        if not results[-1]:
            break
    assert results[-1] is False
    st = spool.stats()
    assert not st.healthy
    assert st.write_errors == 1
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "cannot be written: database or disk is full" in errors[0], errors
    assert spool.pending(limit=1)[0].seq == 1
    filler.unlink()
    assert spool.put(seq, clock.now, b"b" * 100)
    assert spool.stats().healthy
    assert 1 in seqs(spool) and seq in seqs(spool)
    spool.close()


# -- corrupt files -------------------------------------------------------------------------


def test_garbage_file_is_moved_aside(
    db: Path, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    db.parent.mkdir(mode=0o700)
    db.write_bytes(b"this is not an sqlite database at all" * 200)
    spool = Spool(db, clock=clock)
    aside = db.with_name(f"spool.db.corrupt-{int(clock.now)}")
    assert aside.read_bytes().startswith(b"this is not")
    assert spool.stats().healthy
    assert spool.put(1, clock.now, b"a")
    assert seqs(spool) == [1]
    assert any("is corrupt" in r.getMessage() for r in caplog.records)
    spool.close()


def test_damaged_pages_are_moved_aside(db: Path, clock: FakeClock) -> None:
    spool = Spool(db, clock=clock)
    for seq in range(1, 200):
        spool.put(seq, clock.now, os.urandom(3000))
    spool.close()  # checkpoints the WAL into the main file
    size = db.stat().st_size
    with db.open("r+b") as f:
        for offset in range(4096, size, 4096 * 3):  # trash every third page after the header
            f.seek(offset)
            f.write(os.urandom(4096))
    spool = Spool(db, clock=clock)
    assert list(db.parent.glob("spool.db.corrupt-*")), "damaged file kept for inspection"
    assert spool.stats().batches == 0
    assert spool.put(spool.next_seq(), clock.now, b"fresh")
    assert len(seqs(spool)) == 1
    spool.close()


def test_persistently_failing_open_never_raises(db: Path, clock: FakeClock) -> None:
    def connect(path: Path) -> sqlite3.Connection:
        raise sqlite3.DatabaseError("file is not a database")

    spool = Spool(db, clock=clock, connect=connect)
    assert spool.put(1, clock.now, b"a") is False
    assert spool.ack(1) == 0
    st = spool.stats()
    assert (st.healthy, st.batches, st.write_errors) == (False, 0, 3)  # init, put, ack
    assert spool.next_seq() == 2
    spool.close()


def test_the_page_cache_is_bounded_small(tmp_path: Path) -> None:
    """SQLite's default page cache (2 MiB) stayed resident after an outage's replay."""
    spool = Spool(tmp_path / "spool.db")
    assert spool._conn is not None
    (size,) = spool._conn.execute("PRAGMA cache_size").fetchone()
    spool.close()
    assert size == -512  # KiB
