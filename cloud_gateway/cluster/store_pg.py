"""The shared node directory in PostgreSQL (``[cluster] database``), through asyncpg.

Several gateways use one database. A claim is one statement that bumps the node's epoch
whoever owned it, returns the previous owner, and notifies every gateway (``NOTIFY
gpurelay_claims``) in the same transaction, so the previous owner learns that it lost the
node as soon as the new owner knows it won. Releases and last-seen updates only touch the
row while this gateway still holds the epoch it claimed (compare-and-set), so a late
write from a gateway that lost a node never undoes the new owner's state.

The schema is created and migrated by the gateways themselves under an advisory lock (two
gateways starting at once do not both migrate); its version lives in
``gpurelay_schema``, and a database migrated by a newer gateway is refused with a clear
error. Each gateway id's row holds the instance of the process running under it
(:mod:`cloud_gateway.cluster.members`: two processes with one id are refused, or fenced).
asyncpg is imported only when this module is used: a single gateway never needs it.

While PostgreSQL is away asyncpg's pool tries to restore its minimum size after every
failed acquire and logs each failure (``asyncpg.pool``) with a full traceback: one every
heartbeat, beside the gateway's own line about the same outage. :class:`PoolLogThrottle`
makes that one line, the exception's type and message, at most once a
:data:`POOL_LOG_SECONDS`, saying how many it held back."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from cloud_gateway.cluster.directory import Claim, DirectoryError, NodeEntry, NodeFacts
from cloud_gateway.cluster.members import _SEEN, Member, PgMembers, new_instance
from cloud_gateway.cluster.nonces import PgNonces

if TYPE_CHECKING:
    import asyncpg

# Member stays importable from here, where it was defined before directory_members
__all__ = ["CHANNEL", "LEADER_LOCK", "MIGRATIONS", "VERSION", "Member", "PostgresDirectory"]

CHANNEL = "gpurelay_claims"
MIGRATION_LOCK = 0x67707572656C6179  # pg_advisory_xact_lock key: "gpurelay"
LEADER_LOCK = 0x67707572656C6164  # pg_try_advisory_lock key of the leader: "gpurelad"
CONNECT_TIMEOUT_SECONDS = 5.0
COMMAND_TIMEOUT_SECONDS = 10.0
POOL_LOG_SECONDS = 60.0  # asyncpg's pool logs one line at most this often

# MIGRATIONS[k] takes the schema from version k to k + 1.
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        "CREATE TABLE gpurelay_nodes ("
        " name text PRIMARY KEY,"
        " gateway text NOT NULL,"
        " epoch bigint NOT NULL,"
        " first_seen double precision NOT NULL,"
        " last_seen double precision NOT NULL,"
        " facts jsonb NOT NULL,"
        " connected boolean NOT NULL,"
        " last_disconnect_reason text NOT NULL DEFAULT '',"
        " published text[] NOT NULL DEFAULT '{}',"
        " previous_gateway text)",  # the owner before the last claim (RETURNed by it)
        "CREATE INDEX gpurelay_nodes_gateway ON gpurelay_nodes (gateway)",
        # heartbeat and started are the database's clock: the members' clocks may differ
        "CREATE TABLE gpurelay_gateways ("
        " id text PRIMARY KEY,"
        " advertise text NOT NULL,"
        " http text NOT NULL DEFAULT '',"  # host:port of its /metrics, for http_sd
        " started timestamptz NOT NULL,"
        " heartbeat timestamptz NOT NULL,"
        " nodes integer NOT NULL)",
        # single-use enrollment tokens (issue 17): the primary key decides every race
        "CREATE TABLE gpurelay_enrollment_nonces (nonce text PRIMARY KEY, node text NOT NULL,"
        " exp bigint NOT NULL, used_at double precision NOT NULL)",
    ),
    # the process holding each gateway id ("": a row of an older gateway, or a clean stop)
    ("ALTER TABLE gpurelay_gateways ADD COLUMN instance text NOT NULL DEFAULT ''",),
)
VERSION = len(MIGRATIONS)

_COLUMNS = "name, gateway, epoch, first_seen, last_seen, facts, connected, last_disconnect_reason"

# One round trip: bump the epoch (insert at 1), return the previous owner, notify. The
# previous owner is taken from the row the upsert locked (a column, since RETURNING sees
# only new values before PostgreSQL 18), not from the statement's snapshot, which a
# concurrent claim can have made stale.
_CLAIM = f"""
WITH upsert AS (
    INSERT INTO gpurelay_nodes ({_COLUMNS})
    VALUES ($1, $2, 1, $3, $3, $4::jsonb, true, '')
    ON CONFLICT (name) DO UPDATE SET
        previous_gateway = gpurelay_nodes.gateway,
        gateway = EXCLUDED.gateway, epoch = gpurelay_nodes.epoch + 1,
        last_seen = EXCLUDED.last_seen, facts = EXCLUDED.facts, connected = true,
        published = '{{}}'
    RETURNING epoch, previous_gateway
)
SELECT epoch, previous_gateway AS previous,
       pg_notify('{CHANNEL}', json_build_object('node', $1::text, 'gateway', $2::text,
                                                'epoch', epoch)::text)
FROM upsert
"""

# An entry released to nobody (gateway ""): the owner before goes to previous_gateway,
# the reason is written only when the node was still connected (else its own stays).
_UNOWN = """
    SET gateway = '', previous_gateway = n.gateway, connected = false, published = '{}',
        last_disconnect_reason = CASE WHEN n.connected THEN {reason}
                                      ELSE n.last_disconnect_reason END
"""
_NOTIFY_EACH = (
    f"SELECT u.name, pg_notify('{CHANNEL}', json_build_object('node', u.name, 'gateway', '',"
    " 'epoch', u.epoch)::text)"
)
_RELEASE_LEFT = f"""
WITH u AS (
    UPDATE gpurelay_nodes AS n {_UNOWN.replace("{reason}", "$4")}
    FROM unnest($1::text[], $2::bigint[]) AS s(name, epoch)
    WHERE n.name = s.name AND n.epoch = s.epoch AND n.gateway = $3
    RETURNING n.name, n.epoch
)
{_NOTIFY_EACH} FROM u
"""
_FORGOTTEN = "'gateway ' || n.gateway || ' forgotten (silent too long)'"
# Members silent for $1 seconds leave; the nodes naming them are released as above (a
# member that heartbeats meanwhile is not deleted: the row is re-checked under its lock).
_FORGET = f"""
WITH gone AS (
    DELETE FROM gpurelay_gateways
    WHERE heartbeat < now() - make_interval(secs => $1) AND id <> $2
    RETURNING id
), u AS (
    UPDATE gpurelay_nodes AS n
    {_UNOWN.replace("{reason}", _FORGOTTEN)}
    FROM gone WHERE n.gateway = gone.id
    RETURNING n.name, n.epoch, gone.id
)
SELECT gone.id, u.name FROM gone LEFT JOIN u ON u.id = gone.id
"""

ClaimListener = Callable[[str, str, int], None]  # node, new owner, epoch


def _error(what: str, exc: BaseException) -> DirectoryError:
    return DirectoryError(f"PostgreSQL node directory: {what}: {exc}")


class PoolLogThrottle(logging.Filter):
    """On the ``asyncpg.pool`` logger: each record one line (no traceback: the
    exception's type and message instead), at most one per ``every`` seconds."""

    def __init__(
        self, every: float = POOL_LOG_SECONDS, clock: Callable[[], float] = time.monotonic
    ):
        super().__init__()
        self.every = every
        self.clock = clock
        self._next = float("-inf")  # when the next line may go out
        self._held = 0  # lines held back since the last one

    def filter(self, record: logging.LogRecord) -> bool:
        now = self.clock()
        if now < self._next:
            self._held += 1
            return False
        exc = record.exc_info[1] if record.exc_info else None
        why = f": {type(exc).__name__}: {exc}" if exc is not None else ""
        held = f" ({self._held} more in the last {self.every:g}s)" if self._held else ""
        text = f"PostgreSQL node directory: asyncpg: {record.getMessage()}{why}{held}"
        record.msg, record.args = " ".join(text.split()), None
        record.exc_info = record.exc_text = record.stack_info = None
        self._next, self._held = now + self.every, 0
        return True


def _throttle_pool_log() -> None:
    """Install :class:`PoolLogThrottle` on asyncpg's pool logger, once per process."""
    pool_log = logging.getLogger("asyncpg.pool")
    if not any(isinstance(f, PoolLogThrottle) for f in pool_log.filters):
        pool_log.addFilter(PoolLogThrottle())


def _failures() -> tuple[type[BaseException], ...]:
    import asyncpg  # what the driver raises when PostgreSQL, or the way to it, fails

    return (asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.InternalClientError, OSError)


class PostgresDirectory(PgMembers, PgNonces):
    """One connection pool; a separate connection LISTENs for claims (``on_claim``)."""

    def __init__(
        self,
        dsn: str,
        *,
        gateway: str,
        on_claim: ClaimListener | None = None,
        instance: str = "",
    ) -> None:
        self.dsn = dsn
        self.gateway = gateway
        self.instance = instance or new_instance()  # this process (this start) of the id
        self.on_claim = on_claim
        self._pool: asyncpg.Pool | None = None
        self._listener: asyncpg.Connection | None = None
        self._leader: asyncpg.Connection | None = None  # holds LEADER_LOCK while leading
        self.leading = False
        self.released: list[str] = []  # at open: the nodes an earlier run held (release_left)

    async def _run(self, what: str, fn: Callable[[asyncpg.Connection], Awaitable[Any]]) -> Any:
        import asyncpg

        if self._pool is None:
            raise DirectoryError("PostgreSQL node directory is not open")
        try:
            async with self._pool.acquire() as conn:
                try:
                    return await fn(conn)
                except asyncpg.InternalClientError:  # left mid-operation: not to be reused
                    conn.terminate()
                    raise
        except _failures() as exc:
            raise _error(what, exc) from exc

    async def open(self, *, release: bool = True) -> Sequence[NodeEntry]:
        """Connect, migrate, listen; ``release``: :meth:`release_earlier` too (a cluster
        member releases only once it holds its id: cloud_gateway.cluster.join)."""
        import asyncpg

        _throttle_pool_log()
        try:
            self._pool = await asyncpg.create_pool(
                self.dsn,
                min_size=1,
                max_size=4,
                timeout=CONNECT_TIMEOUT_SECONDS,
                command_timeout=COMMAND_TIMEOUT_SECONDS,
                reset=_keep_session,
            )
        except _failures() as exc:
            raise _error(f"cannot connect ({_safe(self.dsn)})", exc) from exc
        await self._run("migrating the schema", self._migrate)
        if self.on_claim is not None:
            await self._listen()
        return await self.release_earlier() if release else await self.entries()

    async def release_earlier(self) -> Sequence[NodeEntry]:
        """Release the entries an earlier run of this id left (:meth:`release_left`, the
        names in ``released``); every entry after."""
        entries = await self.entries()
        left = {e.node: e.epoch for e in entries if e.gateway == self.gateway}
        if not left:
            return entries
        self.released = await self.release_left(left, reason=f"gateway {self.gateway} restarted")
        return await self.entries()

    async def _migrate(self, conn: asyncpg.Connection) -> None:
        async with conn.transaction():
            await conn.execute(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK})")
            await conn.execute("CREATE TABLE IF NOT EXISTS gpurelay_schema (version int NOT NULL)")
            version = await conn.fetchval("SELECT max(version) FROM gpurelay_schema")
            version = int(version or 0)
            if version > VERSION:
                raise DirectoryError(
                    f"PostgreSQL node directory has schema version {version}, migrated by a "
                    f"newer gateway (this one knows up to {VERSION}): upgrade this gateway"
                )
            for k, statements in enumerate(MIGRATIONS[version:], start=version + 1):
                for statement in statements:
                    await conn.execute(statement)
                await conn.execute("INSERT INTO gpurelay_schema (version) VALUES ($1)", k)

    async def ensure_listening(self) -> bool:
        """Listen again if the listening connection died (the database restarted); True
        when it had to (notifications may have been missed: re-read the entries)."""
        if self.on_claim is None or (self._listener is not None and not self._listener.is_closed()):
            return False
        await self._listen()
        return True

    async def _listen(self) -> None:
        import asyncpg

        old, self._listener = self._listener, None
        if old is not None:
            old.terminate()
        try:
            self._listener = await asyncpg.connect(self.dsn, timeout=CONNECT_TIMEOUT_SECONDS)
            await self._listener.add_listener(CHANNEL, self._notified)
        except _failures() as exc:
            raise _error("cannot listen for claims", exc) from exc

    def _notified(self, _conn: object, _pid: int, _channel: str, payload: str) -> None:
        if self.on_claim is None:
            return
        try:
            msg = json.loads(payload)
            node, gateway, epoch = str(msg["node"]), str(msg["gateway"]), int(msg["epoch"])
        except (ValueError, KeyError, TypeError):
            return  # not ours: another program on the same channel
        self.on_claim(node, gateway, epoch)

    async def claim(self, node: str, facts: NodeFacts, *, now: float) -> Claim:
        async def run(conn: asyncpg.Connection) -> Claim:
            row = await conn.fetchrow(_CLAIM, node, self.gateway, now, facts.to_json())
            previous = row["previous"]
            mine = previous in (None, "", self.gateway)  # "": released, nobody's
            return Claim(int(row["epoch"]), None if mine else previous)

        result: Claim = await self._run(f"claiming node {node!r}", run)
        return result

    async def seen(self, last_seen: Mapping[str, float]) -> None:
        if not last_seen:
            return
        names, times = list(last_seen), list(last_seen.values())

        async def run(conn: asyncpg.Connection) -> None:
            await conn.execute(_SEEN, names, times, self.gateway)

        await self._run(f"writing last-seen times of {len(names)} node(s)", run)

    async def release(self, node: str, epoch: int, *, reason: str, now: float) -> bool:
        async def run(conn: asyncpg.Connection) -> bool:
            status = await conn.execute(
                "UPDATE gpurelay_nodes SET connected = false,"
                " last_seen = greatest(last_seen, $1), last_disconnect_reason = $2"
                " WHERE name = $3 AND gateway = $4 AND epoch = $5",
                now,
                reason,
                node,
                self.gateway,
                epoch,
            )
            return bool(status == "UPDATE 1")

        released: bool = await self._run(f"releasing node {node!r}", run)
        return released

    async def release_left(self, epochs: Mapping[str, int], *, reason: str) -> list[str]:
        """Let go of nodes that an earlier run of this gateway (same id) held (at
        :meth:`open`, before the gateway accepts agents: this run does not hold them, and
        the leader does not answer for a live gateway's nodes, so they would be in no
        gateway's /metrics until their agents return): each entry
        still naming this gateway at the epoch in ``epochs`` (read before: compare-and-set,
        so a claim made since, here or elsewhere, stays) names no gateway any more, so the
        leader answers for it until its agent is back. Notified like a claim (same epoch),
        so the others re-read the fleet now. The names released."""
        if not epochs:
            return []
        names, numbers = list(epochs), list(epochs.values())

        async def run(conn: asyncpg.Connection) -> list[str]:
            rows = await conn.fetch(_RELEASE_LEFT, names, numbers, self.gateway, reason)
            return sorted(row["name"] for row in rows)

        released: list[str] = await self._run(f"releasing {len(names)} node(s) left over", run)
        return released

    async def forget_gateways(self, older_than: float) -> list[str]:
        """Delete the members whose heartbeat is ``older_than`` seconds old (by the
        database's clock; never this gateway), and clear the owner of the nodes they
        still name (as :meth:`release_left`). The ids forgotten."""

        async def run(conn: asyncpg.Connection) -> list[str]:
            rows = await conn.fetch(_FORGET, older_than, self.gateway)
            return sorted({row["id"] for row in rows})

        forgotten: list[str] = await self._run("forgetting dead gateways", run)
        return forgotten

    async def publish(self, node: str, epoch: int, targets: Sequence[str]) -> bool:
        """The node's published endpoints, while this gateway still holds ``epoch``."""

        async def run(conn: asyncpg.Connection) -> bool:
            # notified like a claim (same epoch), so the others re-read the fleet now
            row = await conn.fetchrow(
                "WITH u AS (UPDATE gpurelay_nodes SET published = $1"
                " WHERE name = $2 AND gateway = $3 AND epoch = $4 RETURNING epoch)"
                f" SELECT pg_notify('{CHANNEL}', json_build_object('node', $2::text,"
                " 'gateway', $3::text, 'epoch', u.epoch)::text) FROM u",
                list(targets),
                node,
                self.gateway,
                epoch,
            )
            return row is not None

        done: bool = await self._run(f"writing node {node!r}'s published endpoints", run)
        return done

    async def entries(self) -> Sequence[NodeEntry]:
        async def run(conn: asyncpg.Connection) -> list[NodeEntry]:
            rows = await conn.fetch(
                f"SELECT {_COLUMNS.replace('facts', 'facts::text AS facts')}, published"
                " FROM gpurelay_nodes ORDER BY name"
            )
            return [_entry(row) for row in rows]

        entries: list[NodeEntry] = await self._run("reading the nodes", run)
        return entries

    async def lead(self) -> bool:
        """Whether this gateway is the cluster's leader: it holds ``LEADER_LOCK``, a
        session advisory lock on a connection of its own, so the lock goes with that
        connection (this gateway dead, or cut off: the server ends its session). Called
        on every heartbeat: checks the connection it leads on, or tries to take the lock
        (on the same connection, kept open: no connection per try)."""
        import asyncpg

        errors = _failures()
        conn = self._leader
        if self.leading and conn is not None and not conn.is_closed():
            try:
                await conn.fetchval("SELECT 1", timeout=COMMAND_TIMEOUT_SECONDS)
                return True
            except errors:
                pass  # the session (and the lock with it) is gone: try again below
        if self.leading or conn is None or conn.is_closed():
            self.step_down()  # else: try again on the connection kept open
        try:
            if self._leader is None:
                self._leader = await asyncpg.connect(self.dsn, timeout=CONNECT_TIMEOUT_SECONDS)
            self.leading = bool(
                await self._leader.fetchval(
                    "SELECT pg_try_advisory_lock($1)", LEADER_LOCK, timeout=COMMAND_TIMEOUT_SECONDS
                )
            )
        except errors as exc:
            self.step_down()
            raise _error("the leader lock", exc) from exc
        return self.leading

    def step_down(self) -> None:
        """Stop leading (or trying to): the lock goes with its connection."""
        conn, self._leader, self.leading = self._leader, None, False
        if conn is not None:
            conn.terminate()

    async def close(self) -> None:
        self.step_down()
        listener, self._listener = self._listener, None
        if listener is not None:
            await listener.close(timeout=CONNECT_TIMEOUT_SECONDS)
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()


async def _keep_session(_conn: asyncpg.Connection) -> None:
    """The pool's reset on release. asyncpg's default (``pg_advisory_unlock_all(); CLOSE
    ALL; UNLISTEN *; RESET ALL``) is one more transaction per statement (5 per heartbeat
    measured, not 3); asyncpg still rolls back a transaction left open. Nothing else needs
    undoing: pooled connections never LISTEN (the listener has its own), take session
    advisory locks (the leader has its own connection; the migration's is a transaction
    lock), SET anything or keep cursors."""


def _entry(row: Mapping[str, Any]) -> NodeEntry:
    try:
        facts = NodeFacts.from_json(row["facts"])
    except DirectoryError as exc:
        raise DirectoryError(f"PostgreSQL node directory, node {row['name']!r}: {exc}") from None
    return NodeEntry(
        node=row["name"],
        gateway=row["gateway"],
        epoch=int(row["epoch"]),
        first_seen=float(row["first_seen"]),
        last_seen=float(row["last_seen"]),
        facts=facts,
        connected=bool(row["connected"]),
        last_disconnect_reason=row["last_disconnect_reason"],
        published=tuple(row["published"]),
    )


def _safe(dsn: str) -> str:
    """The DSN without its password, for messages and logs."""
    scheme, sep, rest = dsn.partition("://")
    if not sep or "@" not in rest:
        return dsn if sep else "<dsn>"
    userinfo, _, host = rest.rpartition("@")
    user = userinfo.split(":", 1)[0]
    return f"{scheme}://{user}@{host}"
