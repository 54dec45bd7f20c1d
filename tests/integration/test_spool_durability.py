"""kill -9 of a process writing to the spool loses nothing committed and corrupts nothing."""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from edge_agent.spool import Spool

WRITER = """
import os, sys, time
from pathlib import Path
from edge_agent.spool import Spool
spool = Spool(Path(sys.argv[1]))
seq = spool.next_seq()
while True:
    if spool.put(seq, time.time(), os.urandom(2000)):
        print(seq, flush=True)
    if seq % 7 == 0:
        spool.ack(seq - 5)
    seq += 1
"""


def _run_and_kill(db: Path, lines_before_kill: int) -> list[int]:
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(db)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo)},
    )
    committed: list[int] = []
    deadline = time.monotonic() + 20
    try:
        assert proc.stdout is not None
        while len(committed) < lines_before_kill and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            committed.append(int(line))
        os.kill(proc.pid, signal.SIGKILL)
        # lines already in the pipe before the kill are committed too (read through the same
        # buffered reader: communicate() could bypass what readline() already buffered)
        committed.extend(int(x) for x in proc.stdout.read().split())
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL
    assert len(committed) >= lines_before_kill, "writer stopped early"
    return committed


def test_kill_9_loses_nothing_committed(tmp_path: Path) -> None:
    db = tmp_path / "state" / "spool.db"
    high = 0
    for round_ in range(3):  # restart and kill again: it resumes where it stopped
        committed = _run_and_kill(db, 400 + 100 * round_)
        assert committed[0] == high + 1, "sequence numbers resume after the last one"
        with contextlib.closing(sqlite3.connect(db)) as conn:
            assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        spool = Spool(db)
        present = {b.seq for b in spool.pending(limit=1_000_000)}
        # the writer acks seq - 5 at every seventh seq: those are expected gone
        acked_up_to = max((s - 5 for s in committed if s % 7 == 0), default=0)
        missing = [s for s in committed if s > acked_up_to and s not in present]
        assert not missing, f"committed but lost after kill -9: {missing[:10]}"
        assert spool.next_seq() > max(committed)
        assert spool.stats().healthy
        high = spool.next_seq() - 1
        spool.close()
