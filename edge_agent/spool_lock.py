"""One agent per spool: an exclusive lock on ``<spool>.lock`` beside the database.

Two agents on one spool (a second ``edge-agent run`` beside the service, a second demo on
moved ports) each counted the other's rows as their own, acknowledged them, and overwrote
each other's ``high_seq``. The spool takes this lock before it opens the database and holds
it until it is closed.

It is an ``flock``: the kernel releases it when the process ends, however it ends (``kill
-9``, an OOM kill), so a lock is never stale and nothing is cleaned up after a crash. Not a
POSIX ``fcntl`` lock: those belong to the process, so a second spool in the same process
would not be refused, and closing any descriptor of the file would drop the lock. The
holder writes who it is into the file (pid, host, since when) for the next one to name.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from edge_agent.errors import AgentError

log = logging.getLogger(__name__)
_MAX_RECORD = 4096


class SpoolInUse(AgentError):
    """Another process holds the spool's lock."""


@dataclass(frozen=True, slots=True)
class Holder:
    pid: int
    host: str
    since: float  # when it took the lock (Unix time)

    def __str__(self) -> str:
        when = datetime.datetime.fromtimestamp(self.since).astimezone()
        return f"pid {self.pid} on {self.host}, since {when:%Y-%m-%d %H:%M:%S %Z}"

    def record(self) -> bytes:
        return json.dumps({"pid": self.pid, "host": self.host, "since": self.since}).encode()

    @classmethod
    def parse(cls, data: bytes) -> Holder | None:
        """The holder written in the lock file; None when it is not (yet) readable."""
        try:
            fields = json.loads(data)
            return cls(int(fields["pid"]), str(fields["host"]), float(fields["since"]))
        except (ValueError, TypeError, KeyError):
            return None


def lock_path(database: Path) -> Path:
    return database.with_name(database.name + ".lock")


class SpoolLock:
    """The lock of the spool at ``database``: :meth:`acquire` once, :meth:`release` at
    close (or let the process end)."""

    def __init__(self, database: Path, *, clock: Callable[[], float] = time.time) -> None:
        self.database = database
        self.path = lock_path(database)
        self._clock = clock
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock (nothing to do while held). :class:`SpoolInUse` naming the holder
        when another process has it; ``OSError`` when the file cannot be created."""
        if self._fd is not None:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = Holder.parse(_read(fd))
            os.close(fd)
            who = (
                str(holder) if holder is not None else "a process that has not written its pid yet"
            )
            raise SpoolInUse(
                f"spool {self.database} is in use by another edge-agent: {who} (lock "
                f"{self.path}); one agent per spool: stop that one, or give this one its "
                "own [spool] directory"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        me = Holder(os.getpid(), socket.gethostname(), self._clock())
        try:  # who we are, for the next one; the lock holds without it (a full disk)
            os.ftruncate(fd, 0)
            os.pwrite(fd, me.record() + b"\n", 0)
        except OSError as exc:
            log.warning("spool lock %s: cannot write this agent's pid into it: %s", self.path, exc)

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)  # nobody holds it now
        os.close(fd)  # releases the flock


def _read(fd: int) -> bytes:
    try:
        return os.pread(fd, _MAX_RECORD, 0)
    except OSError:
        return b""
