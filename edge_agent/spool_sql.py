"""The spool's SQLite statements, connection and error classification.

:mod:`edge_agent.spool` owns the transactions and the episodes; the functions here run
inside the caller's transaction and know the schema."""

from __future__ import annotations

import sqlite3
from pathlib import Path

BUSY_TIMEOUT_SECONDS = 2.0
IN_CHUNK = 500  # well under SQLITE_MAX_VARIABLE_NUMBER on every SQLite version
# Primary result codes (the low byte of the extended code) meaning the file is damaged.
SQLITE_CORRUPT = 11
SQLITE_NOTADB = 26


SCHEMA = (
    "CREATE TABLE IF NOT EXISTS batches ("
    " seq INTEGER PRIMARY KEY, ts REAL NOT NULL, size INTEGER NOT NULL, payload BLOB NOT NULL)",
    "CREATE INDEX IF NOT EXISTS batches_ts ON batches(ts)",
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL)",
    "INSERT OR IGNORE INTO meta(key, value) VALUES ('high_seq', 0)",
)


def default_connect(path: Path) -> sqlite3.Connection:
    """Autocommit connection: the spool issues its own BEGIN IMMEDIATE/COMMIT."""
    return sqlite3.connect(str(path), timeout=BUSY_TIMEOUT_SECONDS, isolation_level=None)


class Corrupt(Exception):
    """The database file is damaged; it should be moved aside."""


def is_corruption(exc: BaseException) -> bool:
    if isinstance(exc, Corrupt):
        return True
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(code, int):
        return (code & 0xFF) in (SQLITE_CORRUPT, SQLITE_NOTADB)
    # No result code (e.g. raised by a connection factory): a DatabaseError that is not an
    # operational error (full, read-only, I/O, locked) is the file's fault.
    return isinstance(exc, sqlite3.DatabaseError) and not isinstance(
        exc, sqlite3.OperationalError | sqlite3.IntegrityError | sqlite3.ProgrammingError
    )


def delete(conn: sqlite3.Connection, where: str, params: tuple[int, ...]) -> tuple[int, int]:
    count, freed = conn.execute(
        f"SELECT count(*), coalesce(sum(size), 0) FROM batches WHERE {where}", params
    ).fetchone()
    if count:
        conn.execute(f"DELETE FROM batches WHERE {where}", params)
    return int(count), int(freed)


def drop_older_than(conn: sqlite3.Connection, cutoff: float) -> tuple[int, int]:
    count, freed = conn.execute(
        "SELECT count(*), coalesce(sum(size), 0) FROM batches WHERE ts < ?", (cutoff,)
    ).fetchone()
    if count:
        conn.execute("DELETE FROM batches WHERE ts < ?", (cutoff,))
    return int(count), int(freed)


def drop_oldest(conn: sqlite3.Connection, excess: int, keep_seq: int) -> tuple[int, int]:
    """Delete the lowest seqs until at least ``excess`` payload bytes are freed."""
    cursor = conn.execute("SELECT seq, size FROM batches WHERE seq != ? ORDER BY seq", (keep_seq,))
    freed = 0
    victims: list[int] = []
    try:
        while freed < excess:
            rows = cursor.fetchmany(256)
            if not rows:
                break
            for seq, size in rows:
                victims.append(int(seq))
                freed += int(size)
                if freed >= excess:
                    break
    finally:
        cursor.close()
    for i in range(0, len(victims), IN_CHUNK):
        chunk = victims[i : i + IN_CHUNK]
        conn.execute(f"DELETE FROM batches WHERE seq IN ({','.join('?' * len(chunk))})", chunk)
    return len(victims), freed
