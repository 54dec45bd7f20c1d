"""Waiting with a deadline: :func:`wait_until` blocks, :func:`wait_for` awaits.

Both poll a predicate until it returns something true, count the transient errors of a
server that is still starting (connection refused, a series not there yet) as "not yet",
stop early with the process's log when a watched process has exited, and otherwise fail
with a :class:`HarnessError` that names what was awaited and the last transient error."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable, Iterable

import httpx

from harness.process import HarnessError, Process

# Raised by a predicate whose server is not up yet, or has not got the data yet.
TRANSIENT = (httpx.HTTPError, OSError, ValueError)


def _timed_out(timeout: float, what: str, last: BaseException | None) -> HarnessError:
    why = f" (last error: {last!r})" if last is not None else ""
    return HarnessError(f"timed out after {timeout:g}s waiting for {what}{why}")


def wait_until(
    predicate: Callable[[], object],
    timeout: float,
    what: str,
    *,
    poll: float = 0.2,
    alive: Iterable[Process] = (),
) -> None:
    """Call ``predicate`` every ``poll`` seconds until it returns something true."""
    watched = tuple(alive)
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        for proc in watched:
            proc.check_alive()
        try:
            if predicate():
                return
        except TRANSIENT as exc:
            last = exc
        if time.monotonic() >= deadline:
            raise _timed_out(timeout, what, last)
        time.sleep(poll)


async def wait_for(
    predicate: Callable[[], object],
    timeout: float = 15.0,
    what: str = "",
    *,
    poll: float = 0.05,
    alive: Iterable[Process] = (),
) -> None:
    """:func:`wait_until` inside an event loop; ``predicate`` may be a coroutine function."""
    watched = tuple(alive)
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        for proc in watched:
            proc.check_alive()
        try:
            result = predicate()
            if inspect.isawaitable(result):
                result = await result
            if result:
                return
        except TRANSIENT as exc:
            last = exc
        if time.monotonic() >= deadline:
            raise _timed_out(timeout, what or repr(predicate), last)
        await asyncio.sleep(poll)
