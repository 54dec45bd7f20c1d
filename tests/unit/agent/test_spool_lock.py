"""One agent per spool (issue 23, item 12): two agents on one spool drove
``gpurelay_agent_spool_batches`` negative, left orphan rows and overwrote ``high_seq``.
A second spool on the same database is refused, naming the holder; a count that would go
below zero (the database changed behind the spool's back) is taken again from the database."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sqlite3
from pathlib import Path

import pytest

from edge_agent.errors import AgentError
from edge_agent.spool import Spool
from edge_agent.spool_lock import SpoolInUse
from harness.pipeline import FakeClock


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "state" / "spool.sqlite"


def test_a_second_spool_on_the_same_database_is_refused_naming_the_holder(db: Path) -> None:
    first = Spool(db)
    assert first.put(1, 1.0, b"a")
    with pytest.raises(SpoolInUse) as refused:
        Spool(db)
    message = str(refused.value)
    assert isinstance(refused.value, AgentError)  # the CLI prints it as one line
    assert "\n" not in message
    assert str(db) in message
    assert f"pid {os.getpid()} on {socket.gethostname()}" in message
    assert "since " in message
    # The refused one changed nothing: the first still counts and owns its batch.
    assert first.stats().batches == 1
    assert [b.seq for b in first.pending()] == [1]
    first.close()
    # Closed: the next one opens, and finds the batch.
    again = Spool(db)
    assert [b.seq for b in again.pending()] == [1]
    again.close()


def test_spools_on_two_databases_in_one_directory_do_not_conflict(tmp_path: Path) -> None:
    one, two = Spool(tmp_path / "a.sqlite"), Spool(tmp_path / "b.sqlite")
    assert one.put(1, 1.0, b"a") and two.put(1, 1.0, b"b")
    one.close()
    two.close()


def test_the_lock_file_names_the_holder_and_moving_a_corrupt_database_keeps_it(
    db: Path,
) -> None:
    db.parent.mkdir(mode=0o700)
    db.write_bytes(b"not a database" * 300)
    spool = Spool(db, clock=FakeClock(1_000.0))  # moved aside, a fresh one started
    lock = db.with_name(db.name + ".lock")
    assert f'"pid": {os.getpid()}' in lock.read_text()
    with pytest.raises(SpoolInUse):
        Spool(db)
    spool.close()


def test_the_batch_count_never_goes_negative(db: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Rows written behind the spool's back (an older agent without the lock, a hand-run
    sqlite3) and then acknowledged: the count was put - deleted, i.e. negative."""
    spool = Spool(db)
    assert spool.put(1, 1.0, b"one")
    with contextlib.closing(sqlite3.connect(db, isolation_level=None)) as other:
        for seq in (2, 3, 4):
            other.execute(
                "INSERT INTO batches(seq, ts, size, payload) VALUES (?, 1.0, 5, x'0102030405')",
                (seq,),
            )
    assert spool.ack(4) == 4
    st = spool.stats()
    assert (st.batches, st.bytes) == (0, 0)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "changed behind" in errors[0], errors
    assert spool.put(5, 1.0, b"five")
    assert (spool.stats().batches, spool.stats().bytes) == (1, 4)
    spool.close()
