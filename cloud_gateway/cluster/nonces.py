"""Single-use enrollment tokens: where the node directory's stores record the nonces of
tokens used (issue 17). The SQLite store keeps them in its own file
(:mod:`cloud_gateway.cluster.store_sqlite`); the PostgreSQL one shares them with the whole
cluster through :class:`PgNonces`; a gateway without a directory keeps them in memory
(:class:`MemoryNonces`, forgotten at a restart).

A use is one atomic insert on the nonce's primary key: of two gateways using the same
token at once, exactly one wins. Nonces of tokens expired a day ago are dropped then."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import asyncpg

KEEP_SECONDS = 86400  # a used token's nonce is kept this long after the token expired

_USED = "SELECT 1 FROM gpurelay_enrollment_nonces WHERE nonce = $1"
_USE = f"""
WITH purge AS (DELETE FROM gpurelay_enrollment_nonces WHERE exp < $4 - {KEEP_SECONDS})
INSERT INTO gpurelay_enrollment_nonces (nonce, node, exp, used_at)
VALUES ($1, $2, $3, $4) ON CONFLICT (nonce) DO NOTHING
"""


class PgNonces:
    """The nonce half of :class:`cloud_gateway.cluster.store_pg.PostgresDirectory` (its table
    is in that module's schema)."""

    async def _run(self, what: str, fn: Callable[[asyncpg.Connection], Awaitable[Any]]) -> Any:
        raise NotImplementedError

    async def enrollment_nonce_used(self, nonce: str) -> bool:
        found = await self._run(
            "reading an enrollment token's use", lambda c: c.fetchval(_USED, nonce)
        )
        return found is not None

    async def use_enrollment_nonce(self, nonce: str, node: str, exp: int, *, now: float) -> bool:
        status = await self._run(
            f"recording node {node!r}'s enrollment token",
            lambda c: c.execute(_USE, nonce, node, exp, now),
        )
        return bool(status == "INSERT 0 1")


class MemoryNonces:
    """A gateway without a node directory: used nonces are kept until it restarts."""

    def __init__(self) -> None:
        self._used: dict[str, int] = {}

    async def enrollment_nonce_used(self, nonce: str) -> bool:
        return nonce in self._used

    async def use_enrollment_nonce(self, nonce: str, node: str, exp: int, *, now: float) -> bool:
        self._used = {n: e for n, e in self._used.items() if e >= now - KEEP_SECONDS}
        if nonce in self._used:
            return False
        self._used[nonce] = exp
        return True
