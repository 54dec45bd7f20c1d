"""The gateways of a cluster in the PostgreSQL directory (``gpurelay_gateways``): one row
per gateway id, with the heartbeat the others judge it by, and the random instance of the
process that holds the id now (:func:`new_instance`, drawn at every start).

Two processes must never run under one id: both would claim the same nodes under one
name, and a start releases every node that names its id (a restart's). So a gateway
takes its row at join (:meth:`PgMembers.try_join`, one transaction under a lock of that
id, the verdict from :func:`cloud_gateway.cluster.join.judge`), and every heartbeat is a
compare-and-set on the instance: a heartbeat that finds another instance on the row
changes nothing and raises :class:`DuplicateGateway`. A clean stop clears the instance
(:meth:`PgMembers.leave`), so the next run of the id takes the row at once; rows written
before instances existed hold ``''`` and are taken as before."""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cloud_gateway.cluster.directory import DirectoryError

if TYPE_CHECKING:
    import asyncpg

JOIN_LOCK = 0x67706A6E  # pg_advisory_xact_lock(JOIN_LOCK, hashtext(id)): "gpjn"

_SEEN = (
    "UPDATE gpurelay_nodes AS n SET last_seen = greatest(n.last_seen, s.t)"
    " FROM unnest($1::text[], $2::float8[]) AS s(name, t)"
    " WHERE n.name = s.name AND n.gateway = $3"
)
_MEMBERS = (
    "SELECT id, advertise, http, nodes, instance,"
    " extract(epoch FROM heartbeat)::float8 AS beat,"
    " extract(epoch FROM now() - heartbeat)::float8 AS age,"
    " extract(epoch FROM now() - started)::float8 AS up"
    " FROM gpurelay_gateways ORDER BY id"
)
# The instance is compare-and-set: '' is a row of an older gateway, or of a clean stop.
_HEARTBEAT = (
    "INSERT INTO gpurelay_gateways AS g (id, advertise, http, started, heartbeat, nodes, instance)"
    " VALUES ($1, $2, $5, now(), now(), $3, $6)"
    " ON CONFLICT (id) DO UPDATE SET advertise = EXCLUDED.advertise,"
    " http = EXCLUDED.http, heartbeat = now(), nodes = EXCLUDED.nodes,"
    " instance = EXCLUDED.instance,"
    " started = CASE WHEN $4 THEN now() ELSE g.started END"
    " WHERE g.instance IN ($6, '')"
)
_HOLDER = (
    "SELECT instance, advertise, extract(epoch FROM heartbeat)::float8 AS beat,"
    " extract(epoch FROM now() - heartbeat)::float8 AS age"
    " FROM gpurelay_gateways WHERE id = $1"
)
_TAKE = (
    "INSERT INTO gpurelay_gateways AS g (id, advertise, started, heartbeat, nodes, instance)"
    " VALUES ($1, $2, now(), now(), 0, $3)"
    " ON CONFLICT (id) DO UPDATE SET advertise = EXCLUDED.advertise, started = now(),"
    " heartbeat = now(), nodes = 0, instance = EXCLUDED.instance"
)


def new_instance() -> str:
    """The random id of one gateway process (one start)."""
    return secrets.token_hex(8)


@dataclass(frozen=True, slots=True)
class Member:
    """A gateway of the cluster, as the directory last heard of it."""

    id: str
    advertise: str  # its peer listener
    heartbeat_age: float  # seconds since its last heartbeat, by the database's clock
    nodes: int  # nodes it owned at that heartbeat
    up_seconds: float  # since it (re)started
    http: str = ""  # host:port of its HTTP listener (/metrics), "" before it is known
    instance: str = ""  # the process holding the id ("": an older gateway, or stopped)
    heartbeat: float = 0.0  # its last heartbeat, unix seconds by the database's clock

    def alive(self, ttl: float) -> bool:
        return self.heartbeat_age < ttl


@dataclass(frozen=True, slots=True)
class Holder:
    """The process that holds a gateway id's row, as found."""

    instance: str
    advertise: str
    heartbeat: float  # unix seconds, by the database's clock: it moves while that one runs
    age: float  # seconds since that heartbeat


class DuplicateGateway(DirectoryError):
    """Another process holds this gateway id (the message says which, and what to do)."""

    def __init__(self, message: str, holder: Holder) -> None:
        super().__init__(message)
        self.holder = holder


Decide = Callable[[Holder | None], str]  # "take", "wait" or "refuse"


class PgMembers:
    """The membership half of :class:`cloud_gateway.cluster.store_pg.PostgresDirectory` (its
    table is in that module's schema)."""

    gateway: str
    instance: str

    async def _run(self, what: str, fn: Callable[[asyncpg.Connection], Awaitable[Any]]) -> Any:
        raise NotImplementedError

    async def try_join(self, advertise: str, decide: Decide) -> tuple[str, Holder | None]:
        """Under a lock of this id (two starts of one id take turns): the row's holder,
        ``decide``'s verdict on it, and the row taken for this instance on ``"take"``."""

        async def run(conn: asyncpg.Connection) -> tuple[str, Holder | None]:
            async with conn.transaction():
                await conn.execute(
                    "SELECT pg_advisory_xact_lock($1, hashtext($2))", JOIN_LOCK, self.gateway
                )
                row = await conn.fetchrow(_HOLDER, self.gateway)
                found = None if row is None else _holder(row)
                verdict = decide(found)
                if verdict == "take":
                    await conn.execute(_TAKE, self.gateway, advertise, self.instance)
            return verdict, found

        result: tuple[str, Holder | None] = await self._run(f"joining as {self.gateway}", run)
        return result

    async def leave(self) -> None:
        """A clean stop: the id's row is free for the next run (while it is this one's)."""

        async def run(conn: asyncpg.Connection) -> None:
            await conn.execute(
                "UPDATE gpurelay_gateways SET instance = '' WHERE id = $1 AND instance = $2",
                self.gateway,
                self.instance,
            )

        await self._run("leaving", run)

    async def heartbeat(
        self,
        *,
        advertise: str,
        nodes: int,
        started: bool = False,
        http: str = "",
        seen: Mapping[str, float] | None = None,
    ) -> list[Member]:
        """Record that this gateway is alive (``started``: it has just (re)started), and
        return every member, this one included; ``seen``: last-seen times written in the
        same transaction (as ``seen``): one transaction per heartbeat. DuplicateGateway,
        nothing written, when another instance holds this id's row."""

        async def run(conn: asyncpg.Connection) -> list[Member]:
            async with conn.transaction():
                if seen:
                    await conn.execute(_SEEN, list(seen), list(seen.values()), self.gateway)
                status = await conn.execute(
                    _HEARTBEAT, self.gateway, advertise, nodes, started, http, self.instance
                )
                members = [_member(row) for row in await conn.fetch(_MEMBERS)]
                if status == "INSERT 0 0":  # rolled back as the exception leaves
                    me = next(m for m in members if m.id == self.gateway)
                    raise DuplicateGateway(
                        f"gateway id {self.gateway!r} is held by instance {me.instance}",
                        Holder(me.instance, me.advertise, me.heartbeat, me.heartbeat_age),
                    )
            return members

        members: list[Member] = await self._run("heartbeat", run)
        return members

    async def members(self) -> list[Member]:
        async def run(conn: asyncpg.Connection) -> list[Member]:
            return [_member(row) for row in await conn.fetch(_MEMBERS)]

        members: list[Member] = await self._run("reading the gateways", run)
        return members


def _member(row: Mapping[str, Any]) -> Member:
    return Member(
        id=row["id"],
        advertise=row["advertise"],
        heartbeat_age=max(0.0, float(row["age"])),
        nodes=int(row["nodes"]),
        up_seconds=max(0.0, float(row["up"])),
        http=row["http"],
        instance=row["instance"],
        heartbeat=float(row["beat"]),
    )


def _holder(row: Mapping[str, Any]) -> Holder:
    return Holder(
        instance=row["instance"],
        advertise=row["advertise"],
        heartbeat=float(row["beat"]),
        age=max(0.0, float(row["age"])),
    )
