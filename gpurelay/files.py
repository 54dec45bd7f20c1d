"""Files both binaries replace whole: a node's key and certificate on the agent, the CA's
serial counter, certificates and known_hosts on the gateway's side; and file calls that
may hang, kept off the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def write_atomic(path: Path, data: bytes, mode: int) -> None:
    """Replace ``path`` by ``data`` with ``mode`` so that a reader sees the old file or the
    new one, never half of either, even across a crash: a temporary file in the same
    directory (``mode`` from its first byte), fsync, rename, fsync of the directory.

    The temporary name is random and made with ``O_EXCL | O_NOFOLLOW``: with a name
    guessable from the pid and no ``O_EXCL`` (issue 24), anyone who could write the
    directory could plant a link there and have the key or certificate written through
    it, wherever it pointed; now such a name is a fresh file or an error, and a name
    taken is tried again."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
        try:
            fd = os.open(tmp, flags, mode)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(f"no free temporary name beside {path}")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fchmod(handle.fileno(), mode)  # O_CREAT's mode passed through the umask
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    sync_dir(path.parent)


def sync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (best effort where a directory cannot be
    opened for that)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def in_daemon_thread(call: Callable[[], T], *, name: str) -> asyncio.Future[T]:
    """``call()`` in a daemon thread of its own, as a future of the running loop.

    For a file call that may hang (a hung NFS mount, a Secret volume being swapped):
    unlike ``asyncio.to_thread`` it takes none of the threads of the loop's default
    executor, which everything else shares, and does not hold up the process's exit
    (``asyncio.run`` waits for that executor, on Python 3.11 without a bound). The caller
    bounds its wait and makes sure it starts one such call at a time, not one per wait."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(outcome: tuple[T] | BaseException) -> None:
        if future.done():  # cancelled meanwhile
            return
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome[0])

    def work() -> None:
        outcome: tuple[T] | BaseException
        try:
            outcome = (call(),)
        except BaseException as exc:  # handed to the loop, raised where it is awaited
            outcome = exc
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
            loop.call_soon_threadsafe(settle, outcome)

    threading.Thread(target=work, name=name, daemon=True).start()
    return future
