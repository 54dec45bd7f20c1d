"""A connection PostgreSQL left mid-operation (asyncpg's InternalClientError "cannot
switch to state ...; another operation is in progress", seen in .ci/run when PostgreSQL
was stopped under a heartbeat) is a directory error like any other, and the connection is
dropped, not handed out again: it killed a gateway before."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from cloud_gateway.directory import DirectoryError
from cloud_gateway.directory_pg import PostgresDirectory


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
