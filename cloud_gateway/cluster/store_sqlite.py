"""The embedded node directory: one SQLite file next to the gateway (the default store).

One gateway owns the file, so a claim is an upsert; the epoch still grows with every claim
so that entries move unchanged into a shared PostgreSQL directory. Statements run on one
worker thread (SQLite's writes wait on the disk; the event loop must not), in autocommit
mode with explicit transactions; the schema version is ``PRAGMA user_version``, migrated
forward by :data:`MIGRATIONS` and refused when a newer gateway wrote it."""

from __future__ import annotations

import asyncio
import fcntl
import os
import sqlite3
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from cloud_gateway.cluster.directory import Claim, DirectoryError, NodeEntry, NodeFacts
from cloud_gateway.cluster.nonces import KEEP_SECONDS

T = TypeVar("T")
BUSY_TIMEOUT_SECONDS = 5.0

# MIGRATIONS[k] takes the schema from version k to k + 1.
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        "CREATE TABLE nodes ("
        " name TEXT PRIMARY KEY,"
        " gateway TEXT NOT NULL,"
        " epoch INTEGER NOT NULL,"
        " first_seen REAL NOT NULL,"
        " last_seen REAL NOT NULL,"
        " facts TEXT NOT NULL,"
        " connected INTEGER NOT NULL,"
        " last_disconnect_reason TEXT NOT NULL DEFAULT '')",
    ),
    (  # 2: single-use enrollment tokens (issue 17)
        "CREATE TABLE enrollment_nonces ("
        " nonce TEXT PRIMARY KEY,"
        " node TEXT NOT NULL,"
        " exp INTEGER NOT NULL,"
        " used_at REAL NOT NULL)",
    ),
)
VERSION = len(MIGRATIONS)

_COLUMNS = "name, gateway, epoch, first_seen, last_seen, facts, connected, last_disconnect_reason"


class SqliteDirectory:
    def __init__(self, path: Path, *, gateway: str) -> None:
        self.path = path
        self.gateway = gateway
        self._conn: sqlite3.Connection | None = None
        self._lock_fd: int | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="directory")

    async def _call(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        def run() -> T:
            if self._conn is None:
                raise DirectoryError(f"node directory {self.path} is not open")
            try:
                return fn(self._conn)
            except sqlite3.Error as exc:
                raise DirectoryError(f"node directory {self.path}: {exc}") from exc

        return await asyncio.get_running_loop().run_in_executor(self._pool, run)

    async def open(self) -> Sequence[NodeEntry]:
        def connect() -> None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._lock()
                conn = sqlite3.connect(
                    str(self.path),
                    timeout=BUSY_TIMEOUT_SECONDS,
                    isolation_level=None,
                    check_same_thread=False,
                )
            except (OSError, sqlite3.Error) as exc:
                raise DirectoryError(f"cannot open node directory {self.path}: {exc}") from exc
            self._conn = conn

        await asyncio.get_running_loop().run_in_executor(self._pool, connect)
        await self._call(self._migrate)
        await self._call(self._restarted)
        return await self.entries()

    def _lock(self) -> None:
        """One gateway per file: a second one would claim the same nodes behind the first
        one's back (several gateways need the PostgreSQL directory)."""
        lock = self.path.with_name(self.path.name + ".lock")
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DirectoryError(
                f"node directory {self.path} is in use by another gateway process (lock "
                f"{lock}); several gateways share a PostgreSQL directory ([cluster] database)"
            ) from None
        self._lock_fd = fd

    def _restarted(self, conn: sqlite3.Connection) -> None:
        """Connections this gateway held before it stopped are gone with it."""
        conn.execute(
            "UPDATE nodes SET connected = 0, last_disconnect_reason = 'gateway restarted'"
            " WHERE gateway = ? AND connected = 1",
            (self.gateway,),
        )

    def _migrate(self, conn: sqlite3.Connection) -> None:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("BEGIN IMMEDIATE")
        try:
            version = int(conn.execute("PRAGMA user_version").fetchone()[0])
            if version > VERSION:
                raise DirectoryError(
                    f"node directory {self.path} has schema version {version}, written by a "
                    f"newer gateway (this one knows up to {VERSION}); upgrade this gateway "
                    "or point [cluster] directory elsewhere"
                )
            for statements in MIGRATIONS[version:]:
                for statement in statements:
                    conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {VERSION}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    async def claim(self, node: str, facts: NodeFacts, *, now: float) -> Claim:
        def run(conn: sqlite3.Connection) -> Claim:
            conn.execute("BEGIN IMMEDIATE")
            try:
                row = conn.execute("SELECT gateway, epoch FROM nodes WHERE name = ?", (node,))
                old = row.fetchone()
                if old is None:
                    epoch, previous = 1, None
                    conn.execute(
                        f"INSERT INTO nodes ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, 1, '')",
                        (node, self.gateway, epoch, now, now, facts.to_json()),
                    )
                else:
                    epoch = int(old[1]) + 1
                    previous = None if old[0] == self.gateway else str(old[0])
                    conn.execute(
                        "UPDATE nodes SET gateway = ?, epoch = ?, last_seen = ?, facts = ?,"
                        " connected = 1 WHERE name = ?",
                        (self.gateway, epoch, now, facts.to_json(), node),
                    )
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            return Claim(epoch, previous)

        return await self._call(run)

    async def seen(self, last_seen: Mapping[str, float]) -> None:
        if not last_seen:
            return
        rows = [(t, node, self.gateway) for node, t in last_seen.items()]

        def run(conn: sqlite3.Connection) -> None:
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.executemany(
                    "UPDATE nodes SET last_seen = max(last_seen, ?) WHERE name = ? AND gateway = ?",
                    rows,
                )
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise

        await self._call(run)

    async def release(self, node: str, epoch: int, *, reason: str, now: float) -> bool:
        def run(conn: sqlite3.Connection) -> bool:
            cur = conn.execute(
                "UPDATE nodes SET connected = 0, last_seen = max(last_seen, ?),"
                " last_disconnect_reason = ? WHERE name = ? AND gateway = ? AND epoch = ?",
                (now, reason, node, self.gateway, epoch),
            )
            return cur.rowcount == 1

        return await self._call(run)

    async def entries(self) -> Sequence[NodeEntry]:
        def run(conn: sqlite3.Connection) -> list[NodeEntry]:
            rows = conn.execute(f"SELECT {_COLUMNS} FROM nodes ORDER BY name").fetchall()
            return [_entry(row, self.path) for row in rows]

        return await self._call(run)

    async def enrollment_nonce_used(self, nonce: str) -> bool:
        def run(conn: sqlite3.Connection) -> bool:
            sql = "SELECT 1 FROM enrollment_nonces WHERE nonce = ?"
            return conn.execute(sql, (nonce,)).fetchone() is not None

        return await self._call(run)

    async def use_enrollment_nonce(self, nonce: str, node: str, exp: int, *, now: float) -> bool:
        def run(conn: sqlite3.Connection) -> bool:
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.execute("DELETE FROM enrollment_nonces WHERE exp < ?", (now - KEEP_SECONDS,))
                cur = conn.execute(
                    "INSERT INTO enrollment_nonces (nonce, node, exp, used_at)"
                    " VALUES (?, ?, ?, ?) ON CONFLICT (nonce) DO NOTHING",
                    (nonce, node, exp, now),
                )
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            return cur.rowcount == 1

        return await self._call(run)

    async def close(self) -> None:
        def run() -> None:
            conn, self._conn = self._conn, None
            if conn is not None:
                conn.close()
            fd, self._lock_fd = self._lock_fd, None
            if fd is not None:
                os.close(fd)  # releases the lock

        await asyncio.get_running_loop().run_in_executor(self._pool, run)
        self._pool.shutdown(wait=True)


def _entry(row: tuple[object, ...], where: Path) -> NodeEntry:
    name, gateway, epoch, first_seen, last_seen, facts, connected, reason = row
    try:
        parsed = NodeFacts.from_json(str(facts))
    except DirectoryError as exc:
        raise DirectoryError(f"node directory {where}, node {name!r}: {exc}") from None
    return NodeEntry(
        node=str(name),
        gateway=str(gateway),
        epoch=int(epoch),  # type: ignore[call-overload]
        first_seen=float(first_seen),  # type: ignore[arg-type]
        last_seen=float(last_seen),  # type: ignore[arg-type]
        facts=parsed,
        connected=bool(connected),
        last_disconnect_reason=str(reason),
    )
