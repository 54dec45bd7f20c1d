"""A connection PostgreSQL left mid-operation (asyncpg's InternalClientError "cannot
switch to state ...; another operation is in progress", seen in .ci/run when PostgreSQL
was stopped under a heartbeat) is a directory error like any other, and the connection is
dropped, not handed out again: it killed a gateway before."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from cloud_gateway.cluster.directory import DirectoryError
from cloud_gateway.cluster.store_pg import PoolLogThrottle, PostgresDirectory


class Conn:
    terminated = False

    def terminate(self) -> None:
        self.terminated = True


class Pool:
    def __init__(self) -> None:
        self.conn = Conn()

    @contextlib.asynccontextmanager
    async def acquire(self) -> AsyncIterator[Conn]:
        yield self.conn


async def test_a_connection_left_mid_operation_is_a_directory_error_and_dropped() -> None:
    directory = PostgresDirectory("postgresql://nowhere/db", gateway="gw-a")
    pool = Pool()
    directory._pool = pool  # type: ignore[assignment]

    async def heartbeat(conn: Any) -> None:
        raise asyncpg.InternalClientError("cannot switch to state 15; another operation (2)")

    with pytest.raises(DirectoryError, match="heartbeat: cannot switch to state"):
        await directory._run("heartbeat", heartbeat)
    assert pool.conn.terminated


def test_asyncpgs_pool_lines_are_one_line_each_and_throttled() -> None:
    """PoolLogThrottle on asyncpg's "Failed to restore the pool connection floor" (logged
    with a traceback after every failed acquire while PostgreSQL is away)."""
    now = [0.0]
    throttle = PoolLogThrottle(every=60.0, clock=lambda: now[0])

    def record() -> logging.LogRecord:
        try:
            raise ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 5432)")
        except OSError:
            exc_info = sys.exc_info()
        return logging.LogRecord(
            "asyncpg.pool", logging.WARNING, "pool.py", 571,
            "Failed to restore the pool connection floor; retrying", None, exc_info,
        )  # fmt: skip

    first = record()
    assert throttle.filter(first)
    assert first.exc_info is None and first.exc_text is None
    assert first.getMessage() == (
        "PostgreSQL node directory: asyncpg: Failed to restore the pool connection floor; "
        "retrying: ConnectionRefusedError: [Errno 111] Connect call failed ('127.0.0.1', 5432)"
    )
    now[0] = 2.0
    assert not throttle.filter(record())
    now[0] = 59.0
    assert not throttle.filter(record())
    now[0] = 60.0
    again = record()
    assert throttle.filter(again)
    assert again.getMessage().endswith("5432) (2 more in the last 60s)")
