"""A throwaway PostgreSQL server for tests and benches: Debian's binaries, ``initdb`` in a
temporary directory, one server on a free loopback port, trust authentication for one
role, no durability (``fsync=off``: the data is thrown away with the directory).

PostgreSQL refuses to run as root. As root (CI), the data directory is made in a fresh
``/tmp`` directory owned by the ``postgres`` account that the Debian package creates, and
the server runs as that account; otherwise it runs as the caller. Either way it listens on
127.0.0.1 only and its Unix socket lives in its own directory.

    server = PostgresServer.find()          # HarnessError when the binaries are missing
    with server.running() as dsn:           # postgresql://relay@127.0.0.1:PORT/relay
        ...                                  # server.stop() / server.kill9() / server.start()
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from harness.ports import free_ports
from harness.process import HarnessError, Process

ROLE = "relay"  # the superuser initdb makes, and the database the tests use
SEARCH = ("/usr/lib/postgresql",)  # Debian keeps the server binaries off PATH, by version
READY_TIMEOUT = 30.0


def find_bindir() -> Path | None:
    """The newest ``.../bin`` with initdb and postgres: PATH first, then Debian's layout."""
    initdb = shutil.which("initdb")
    if initdb is not None:  # resolved: some machines link initdb alone into /usr/local/bin
        bindir = Path(initdb).resolve().parent
        if (bindir / "postgres").exists() and (bindir / "pg_isready").exists():
            return bindir
    for base in SEARCH:
        root = Path(base)
        if not root.is_dir():
            continue
        versions = sorted(
            (p for p in root.iterdir() if (p / "bin" / "initdb").exists()),
            key=lambda p: [int(x) if x.isdigit() else 0 for x in p.name.split(".")],
        )
        if versions:
            return versions[-1] / "bin"
    return None


async def create_database(dsn: str, name: str) -> str:
    """Create database ``name`` on the server of ``dsn``; the DSN that reaches it."""
    import asyncpg

    admin = await asyncpg.connect(dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    return dsn.rsplit("/", 1)[0] + f"/{name}"


class _Server(Process):
    """The postmaster in the foreground (so kill -9 reaches it), as ``user`` when given."""

    def __init__(self, argv: list[str], log: Path, user: str | None) -> None:
        super().__init__("postgres", argv, log)
        self.user = user

    def start(self) -> None:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                self.argv,
                cwd="/",
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                user=self.user,
                group=self.user,
                extra_groups=[] if self.user else None,
                start_new_session=True,
            )

    stop_signal = signal.SIGINT  # PostgreSQL's fast shutdown: clients are disconnected


class PostgresServer:
    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.user: str | None = None
        if os.geteuid() == 0:
            try:
                pwd.getpwnam("postgres")
            except KeyError:
                raise HarnessError(
                    "running as root, and there is no `postgres` account to run PostgreSQL "
                    "as (the Debian package `postgresql` creates it)"
                ) from None
            self.user = "postgres"
        self.dir = Path(tempfile.mkdtemp(prefix="gpurelay-pg-"))
        if self.user is not None:
            shutil.chown(self.dir, self.user, self.user)
        self.data = self.dir / "data"
        self.port = free_ports(1)[0]
        self.dsn = f"postgresql://{ROLE}@127.0.0.1:{self.port}/{ROLE}"
        self.server: _Server | None = None
        self._initialized = False
        self._created = False

    @classmethod
    def find(cls) -> PostgresServer:
        bindir = find_bindir()
        if bindir is None:
            raise HarnessError("PostgreSQL's initdb not found (Debian package `postgresql`)")
        return cls(bindir)

    def _run(self, *argv: str) -> None:
        proc = subprocess.run(
            [str(self.bindir / argv[0]), *argv[1:]],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            cwd="/",
            user=self.user,
            group=self.user,
            extra_groups=[] if self.user else None,
        )
        if proc.returncode != 0:
            raise HarnessError(f"{argv[0]} failed ({proc.returncode}): {proc.stderr.strip()}")

    def initdb(self) -> None:
        self._run(
            "initdb", "-D", str(self.data), "-U", ROLE, "--auth=trust", "-E", "UTF8",
            "--no-sync", "--no-instructions",
        )  # fmt: skip
        self._initialized = True

    def start(self) -> None:
        """Start the server (initdb first, the first time) and wait until it takes
        connections; the database ``relay`` exists afterwards."""
        if not self._initialized:
            self.initdb()
        argv = [
            str(self.bindir / "postgres"), "-D", str(self.data), "-p", str(self.port),
            "-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={self.dir}",
            "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
            "-c", "max_connections=200", "-c", "shared_buffers=32MB",
        ]  # fmt: skip
        self.server = _Server(argv, self.dir / "postgres.log", self.user)
        self.server.start()
        self._wait_ready()
        if not self._created:
            self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", ROLE, ROLE)
            self._created = True

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            assert self.server is not None
            self.server.check_alive()
            proc = subprocess.run(
                [str(self.bindir / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port),
                 "-U", ROLE, "-t", "1"],
                capture_output=True, timeout=10, check=False,
            )  # fmt: skip
            if proc.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise HarnessError(
                    f"PostgreSQL did not take connections within {READY_TIMEOUT:g}s\n"
                    + self.server.tail()
                )
            time.sleep(0.1)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()

    def kill9(self) -> None:
        """SIGKILL to the postmaster and all its backends at once (a crashed machine); the
        next :meth:`start` recovers from the WAL."""
        if self.server is not None and self.server.running():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.server.pid, signal.SIGKILL)
            assert self.server.proc is not None
            self.server.proc.wait(timeout=10)

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    @contextlib.contextmanager
    def running(self) -> Iterator[str]:
        try:
            self.start()
            yield self.dsn
        finally:
            self.remove()
