"""Durable on-disk spool of telemetry batches, so an edge-link outage loses nothing.

Every batch is written here before it is sent and leaves only when the gateway acknowledged
it. The store is one SQLite database in WAL mode (all SQL of the agent's spool lives in this
module):

* ``batches(seq INTEGER PRIMARY KEY, ts REAL, size INTEGER, payload BLOB)``, plus an index on
  ``ts`` so the age bound and the oldest age are cheap;
* ``meta(key TEXT PRIMARY KEY, value INTEGER)`` holding ``high_seq``, the highest sequence
  number ever spooled, so ``next_seq()`` keeps increasing across restarts and acks even when
  the wall clock steps back.

Guarantees (``journal_mode=WAL``, ``synchronous=NORMAL``):

* A process crash (``kill -9``, OOM kill, panic) at any moment loses no batch whose ``put``
  returned True and never corrupts the database: each ``put``/``ack`` is one transaction,
  and a commit is in the WAL (the OS page cache) before ``put`` returns.
* Power loss or a kernel crash keeps the database consistent (never corrupt, given storage
  that honours fsync), but may roll back the most recent commits: in WAL mode with
  ``synchronous=NORMAL`` the WAL is fsynced only at checkpoints, so the batches committed
  since the last checkpoint (at most ~1000 pages, i.e. a few MiB) can be lost. Those batches
  were normally already sent live; ``synchronous=FULL`` would close the gap at the cost of an
  fsync per batch.
* Bounds: ``max_bytes`` bounds the sum of payload sizes (the file is a little larger: page
  and index overhead, plus a WAL capped at ``_JOURNAL_SIZE_LIMIT`` after checkpoints);
  batches collected more than ``max_age_seconds`` ago are dropped. Either way the OLDEST
  (lowest seq) go first, each is counted in ``stats().dropped[reason]`` and the episode is
  logged once when it starts and once when it stops.
* A full or read-only disk never raises: ``put`` returns False, ``write_errors`` counts it,
  one error line per episode, and every later ``put`` retries (recovery is logged once
  ``recovery_seconds`` passed without a failure: a nearly full disk lets some writes
  through, and the episode should not flap). The
  caller sends such batches live without spooling.
* One spool, one process: the spool holds an exclusive lock on ``<name>.lock`` beside the
  database (:mod:`edge_agent.spool_lock`) from its first open to ``close``. A second spool
  on the same database raises :class:`~edge_agent.spool_lock.SpoolInUse` naming the holder;
  the kernel releases the lock when the holder dies, however it dies. Should the database
  still change behind the spool's back (an older agent without the lock, a hand-run
  ``sqlite3``), a count that would go below zero is logged and taken again from the
  database: ``stats()`` never reports a negative number of batches or bytes.
* A corrupt database at open (or detected later) is moved aside to
  ``<name>.corrupt-<unix-ts>`` and a fresh one started. The high-water sequence number is
  then lost; if the agent restarts after that, sequence numbers start again at 1 (or
  continue from memory if the process keeps running).

No threads: the agent calls it from its event loop; every operation is one small
transaction.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from edge_agent import spool_sql
from edge_agent.spool_lock import SpoolInUse, SpoolLock

log = logging.getLogger(__name__)

DROP_BYTES = "bytes"
DROP_AGE = "age"
DROP_REASONS = (DROP_BYTES, DROP_AGE)

# A dropping episode ends after this long without a drop for that reason, so a spool that
# sits at its bound does not flap between "dropping" and "stopped" on every put.
_EPISODE_QUIET_SECONDS = 60.0
_JOURNAL_SIZE_LIMIT = 8 * 1024 * 1024
# SQLite's page cache (2 MiB by default) stays resident once an outage's replay filled it;
# the steady put/ack of one batch touches a few pages, and replay reads hit the OS cache.
_CACHE_KIB = 512
Connect = Callable[[Path], sqlite3.Connection]


@dataclass(frozen=True, kw_only=True)
class SpoolLimits:
    max_bytes: int = 256 * 1024 * 1024
    max_age_seconds: float = 24 * 3600

    def __post_init__(self) -> None:
        if self.max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {self.max_bytes}")
        if self.max_age_seconds <= 0:
            raise ValueError(f"max_age_seconds must be positive, got {self.max_age_seconds}")


@dataclass(frozen=True, slots=True)
class SpooledBatch:
    seq: int
    timestamp: float  # when the values were collected
    payload: bytes  # opaque to the spool (the caller serialises a snapshot)


@dataclass(frozen=True, slots=True)
class SpoolStats:
    batches: int
    bytes: int  # sum of payload sizes
    oldest_age_seconds: float  # 0.0 when empty
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> batches dropped
    write_errors: int = 0
    healthy: bool = True  # False while the database cannot be opened or written


class Spool:
    """A bounded, durable FIFO of batches keyed by sequence number."""

    def __init__(
        self,
        path: Path,
        *,
        limits: SpoolLimits = SpoolLimits(),  # frozen, so sharing is safe
        clock: Callable[[], float] = time.time,
        connect: Connect = spool_sql.default_connect,
        recovery_seconds: float = 0.0,
    ) -> None:
        self.path = Path(path)
        # A nearly full disk lets some writes through (SQLite reuses freed pages): a failing
        # episode ends only after this long without a failure, so the log does not flap.
        self._recovery_seconds = recovery_seconds
        self._ok_since: float | None = None
        self.limits = limits
        self._clock = clock
        self._connect = connect
        self._conn: sqlite3.Connection | None = None
        self._check_on_open = True  # integrity-check the first open and after corruption
        self._high = 0  # highest seq ever seen (persisted in meta when writable)
        self._count = 0
        self._bytes = 0
        self._dropped = dict.fromkeys(DROP_REASONS, 0)
        self._episode_drops = dict.fromkeys(DROP_REASONS, 0)
        self._last_drop: dict[str, float | None] = dict.fromkeys(DROP_REASONS)
        self._write_errors = 0
        self._failing_since_errors: int | None = None  # write_errors when the episode began
        self._closed = False
        self._lock = SpoolLock(self.path, clock=clock)
        self._open()  # SpoolInUse when another process has this spool

    # -- public API -------------------------------------------------------------------------

    def put(self, seq: int, timestamp: float, payload: bytes) -> bool:
        """Spool one batch; True once it is committed.

        False when it was not spooled: the disk refused it (full, read-only, I/O error:
        counted in ``write_errors``, logged once per episode, retried on later puts) or the
        payload alone exceeds ``max_bytes`` (counted as dropped for ``bytes``). Never raises
        for OSError or sqlite3 errors. Putting an existing seq replaces that batch.
        """
        if seq < 1:
            raise ValueError(f"seq must be >= 1, got {seq}")
        self._high = max(self._high, seq)  # next_seq() must not reuse it even if not spooled
        size = len(payload)
        now = self._clock()
        if size > self.limits.max_bytes:
            self._note_drops({DROP_BYTES: 1}, now)
            log.warning(
                "batch %d (%d bytes) is larger than the whole spool (max_bytes=%d): not spooled",
                seq,
                size,
                self.limits.max_bytes,
            )
            return False
        conn = self._writable_conn()
        if conn is None:
            return False
        try:
            conn.execute("BEGIN IMMEDIATE")
            age_n, age_bytes = spool_sql.drop_older_than(conn, now - self.limits.max_age_seconds)
            row = conn.execute("SELECT size FROM batches WHERE seq = ?", (seq,)).fetchone()
            replaced = int(row[0]) if row is not None else None
            excess = self._bytes - age_bytes - (replaced or 0) + size - self.limits.max_bytes
            bytes_n, bytes_bytes = (
                (0, 0) if excess <= 0 else spool_sql.drop_oldest(conn, excess, seq)
            )
            conn.execute(
                "INSERT INTO batches(seq, ts, size, payload) VALUES (?, ?, ?, ?)"
                " ON CONFLICT(seq) DO UPDATE SET"
                " ts = excluded.ts, size = excluded.size, payload = excluded.payload",
                (seq, float(timestamp), size, payload),
            )
            conn.execute(
                "UPDATE meta SET value = max(value, ?) WHERE key = 'high_seq'", (self._high,)
            )
            conn.execute("COMMIT")
        except (sqlite3.Error, OSError) as exc:
            self._failed(conn, "put", exc)
            return False
        self._counted(
            conn,
            1 - age_n - bytes_n - (1 if replaced is not None else 0),
            size - age_bytes - bytes_bytes - (replaced or 0),
        )
        self._recovered()
        self._note_drops({DROP_AGE: age_n, DROP_BYTES: bytes_n}, now)
        return True

    def ack(self, up_to_seq: int | None = None, *, seqs: Iterable[int] = ()) -> int:
        """Delete acknowledged batches (all ``seq <= up_to_seq`` and/or the given seqs).

        Returns how many were deleted. On a storage error nothing is deleted and 0 is
        returned (the batches will be sent again; the gateway applies a seq once).
        """
        wanted = sorted(set(seqs))
        if up_to_seq is None and not wanted:
            return 0
        conn = self._writable_conn()
        if conn is None:
            return 0
        n = freed = 0
        try:
            conn.execute("BEGIN IMMEDIATE")
            if up_to_seq is not None:
                c, b = spool_sql.delete(conn, "seq <= ?", (up_to_seq,))
                n, freed = n + c, freed + b
                wanted = [s for s in wanted if s > up_to_seq]
            for i in range(0, len(wanted), spool_sql.IN_CHUNK):
                chunk = wanted[i : i + spool_sql.IN_CHUNK]
                marks = ",".join("?" * len(chunk))
                c, b = spool_sql.delete(conn, f"seq IN ({marks})", tuple(chunk))
                n, freed = n + c, freed + b
            conn.execute("COMMIT")
        except (sqlite3.Error, OSError) as exc:
            self._failed(conn, "ack", exc)
            return 0
        self._counted(conn, -n, -freed)
        self._recovered()
        return n

    def pending(self, *, after_seq: int = 0, limit: int = 100) -> list[SpooledBatch]:
        """Up to ``limit`` spooled batches with ``seq > after_seq``, oldest (lowest seq) first."""
        conn = self._readable_conn()
        if conn is None or limit <= 0:
            return []
        try:
            rows = conn.execute(
                "SELECT seq, ts, payload FROM batches WHERE seq > ? ORDER BY seq LIMIT ?",
                (after_seq, limit),
            ).fetchall()
        except (sqlite3.Error, OSError) as exc:
            self._failed(conn, "read", exc)
            return []
        return [SpooledBatch(int(s), float(t), bytes(p)) for s, t, p in rows]

    def next_seq(self) -> int:
        """1 + the highest seq ever spooled (persisted; survives restarts and acks)."""
        return self._high + 1

    def stats(self) -> SpoolStats:
        oldest_age = 0.0
        conn = self._conn
        if conn is not None and self._count > 0:
            try:
                row = conn.execute("SELECT min(ts) FROM batches").fetchone()
            except (sqlite3.Error, OSError):
                row = None
            if row is not None and row[0] is not None:
                oldest_age = max(0.0, self._clock() - float(row[0]))
        return SpoolStats(
            batches=self._count,
            bytes=self._bytes,
            oldest_age_seconds=oldest_age,
            dropped=dict(self._dropped),
            write_errors=self._write_errors,
            healthy=self._conn is not None and self._failing_since_errors is None,
        )

    def close(self) -> None:
        self._closed = True
        self._close_conn()
        self._lock.release()

    def _counted(self, conn: sqlite3.Connection, batches: int, size: int) -> None:
        """Add what a committed put or ack changed to the counts. Below zero, the database
        changed behind this spool's back: logged, and counted again from the database."""
        self._count += batches
        self._bytes += size
        if self._count >= 0 and self._bytes >= 0:
            return
        log.error(
            "spool at %s was changed behind this agent's back (its count went to %d batches,"
            " %d bytes): another process writes to it; counting again from the database",
            self.path,
            self._count,
            self._bytes,
        )
        try:
            count, total = conn.execute(
                "SELECT count(*), coalesce(sum(size), 0) FROM batches"
            ).fetchone()
        except (sqlite3.Error, OSError):
            count = total = 0
        self._count, self._bytes = max(int(count), 0), max(int(total), 0)

    # -- opening and recovery ---------------------------------------------------------------

    def _open(self, *, may_move_aside: bool = True) -> bool:
        """Open (or create) the database; False, logged and counted, when that fails."""
        try:
            self._make_state_dir()
            self._lock.acquire()  # before the database: one process per spool
            conn = self._connect(self.path)
        except (sqlite3.Error, OSError) as exc:
            self._failed(None, "open", exc)
            return False
        try:
            self._prepare(conn)
        except (sqlite3.Error, OSError, spool_sql.Corrupt) as exc:
            with contextlib.suppress(sqlite3.Error):
                conn.close()
            if not (may_move_aside and spool_sql.is_corruption(exc)):
                self._failed(None, "open", exc)
                return False
            if not self._move_aside(exc):
                return False
            return self._open(may_move_aside=False)
        self._conn = conn
        self._check_on_open = False
        return True

    def _make_state_dir(self) -> None:
        state_dir = self.path.parent
        if not state_dir.is_dir():
            state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(state_dir, 0o700)  # mkdir's mode is masked by the umask

    def _prepare(self, conn: sqlite3.Connection) -> None:
        if self._check_on_open:
            row = conn.execute("PRAGMA quick_check").fetchone()
            if row is None or row[0] != "ok":
                raise spool_sql.Corrupt(f"quick_check: {row[0] if row else 'no result'}")
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()
        if mode is None or str(mode[0]).lower() != "wal":
            log.warning("spool at %s: WAL mode not available (journal_mode=%s)", self.path, mode)
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute(f"PRAGMA journal_size_limit={_JOURNAL_SIZE_LIMIT}")
        conn.execute(f"PRAGMA cache_size={-_CACHE_KIB}")
        conn.execute("BEGIN IMMEDIATE")
        try:
            for statement in spool_sql.SCHEMA:
                conn.execute(statement)
            conn.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            raise
        count, total, max_seq = conn.execute(
            "SELECT count(*), coalesce(sum(size), 0), coalesce(max(seq), 0) FROM batches"
        ).fetchone()
        (high,) = conn.execute("SELECT value FROM meta WHERE key = 'high_seq'").fetchone()
        self._count, self._bytes = int(count), int(total)
        self._high = max(self._high, int(high), int(max_seq))

    def _move_aside(self, exc: BaseException) -> bool:
        stamp = int(self._clock())
        target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        n = 1
        while target.exists():
            target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}.{n}")
            n += 1
        try:
            if self.path.exists():
                os.replace(self.path, target)
            for suffix in ("-wal", "-shm"):
                side = Path(f"{self.path}{suffix}")
                if side.exists():
                    os.replace(side, Path(f"{target}{suffix}"))
        except OSError as move_exc:
            self._failed(None, "open", move_exc)
            return False
        log.error(
            "spool at %s is corrupt (%s): moved it aside to %s and started a new, empty spool",
            self.path,
            exc,
            target,
        )
        self._count = self._bytes = 0
        self._check_on_open = False
        return True

    def _writable_conn(self) -> sqlite3.Connection | None:
        if self._closed:
            raise RuntimeError("spool is closed")
        if self._conn is None:
            try:
                self._open()
            except SpoolInUse as exc:  # taken while the lock file could not be made
                self._failed(None, "open", exc)
        return self._conn

    def _readable_conn(self) -> sqlite3.Connection | None:
        if self._closed:
            raise RuntimeError("spool is closed")
        return self._conn

    def _close_conn(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(sqlite3.Error):
                conn.close()

    # -- episodes ---------------------------------------------------------------------------

    def _failed(self, conn: sqlite3.Connection | None, what: str, exc: BaseException) -> None:
        if conn is not None:
            with contextlib.suppress(sqlite3.Error):
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
        self._write_errors += 1
        self._ok_since = None
        if self._failing_since_errors is None:
            self._failing_since_errors = self._write_errors - 1
            log.error(
                "spool at %s cannot be written: %s (during %s); "
                "sending live batches without spooling until it recovers",
                self.path,
                exc,
                what,
            )
        if conn is not None and spool_sql.is_corruption(exc):
            # Reopen on the next put, integrity-check, move the damaged file aside.
            self._check_on_open = True
            self._close_conn()

    def _recovered(self) -> None:
        if self._failing_since_errors is None:
            return
        now = self._clock()
        if self._ok_since is None or now < self._ok_since:
            self._ok_since = now
        if now - self._ok_since < self._recovery_seconds:
            return
        self._ok_since = None
        failed = self._write_errors - self._failing_since_errors
        self._failing_since_errors = None
        log.warning(
            "spool at %s is writable again after %d failed operations; spooling resumed",
            self.path,
            failed,
        )

    def _note_drops(self, drops: dict[str, int], now: float) -> None:
        for reason, n in drops.items():
            last = self._last_drop[reason]
            if n > 0:
                self._dropped[reason] += n
                if last is None:
                    log.warning(
                        "spool at %s is dropping its oldest batches: %s bound reached (%s); "
                        "counted in dropped[%s]",
                        self.path,
                        reason,
                        self._bound_text(reason),
                        reason,
                    )
                self._episode_drops[reason] += n
                self._last_drop[reason] = now
            elif last is not None and (now - last >= _EPISODE_QUIET_SECONDS or now < last):
                log.warning(
                    "spool at %s stopped dropping for the %s bound: %d batches dropped",
                    self.path,
                    reason,
                    self._episode_drops[reason],
                )
                self._episode_drops[reason] = 0
                self._last_drop[reason] = None

    def _bound_text(self, reason: str) -> str:
        if reason == DROP_BYTES:
            return f"max_bytes={self.limits.max_bytes}"
        return f"max_age_seconds={self.limits.max_age_seconds:g}"
