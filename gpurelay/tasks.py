"""Stopping asyncio tasks for sure.

``task.cancel(); await task`` waits forever for a task that lost its cancellation. On
Python 3.11 that happens without any bug of ours: ``asyncio.wait_for`` drops a
cancellation that arrives in the loop iteration where the awaited call finished, and
returns (or raises) that call's result instead; a library doing that under us (asyncssh
and others call it) leaves a reconnect loop running. So our own code bounds calls with
``asyncio.timeout`` (which keeps the cancellation), and what stops a task at shutdown
uses :func:`stop_task`: cancel, and cancel again while it is still running, for a bounded
time, then say which task did not stop and go on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

log = logging.getLogger("gpurelay.tasks")


async def stop_task(
    task: asyncio.Task[object] | asyncio.Task[None],
    *,
    grace: float = 10.0,
    every: float = 0.5,
    what: str | None = None,
) -> bool:
    """Cancel ``task`` until it is done, for at most ``grace`` seconds; True when it is.

    A cancellation it swallowed is repeated every ``every`` seconds. A task still running
    after ``grace`` is logged as an error (naming ``what``, else the task) and left; the
    caller's shutdown goes on. The task's own exception, if any, is not raised here
    (it is retrieved so that asyncio does not log it again)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace
    while not task.done():
        task.cancel()
        left = deadline - loop.time()
        if left <= 0:
            log.error(
                "%s did not stop within %.1f s of being cancelled; left running",
                what or f"task {task.get_name()}",
                grace,
            )
            return False
        await asyncio.wait({task}, timeout=min(every, left))
    if not task.cancelled():
        task.exception()  # retrieved: it ended on its own, its caller logged it or not
    return True


async def stop_tasks(
    tasks: Iterable[asyncio.Task[Any]],
    *,
    grace: float = 10.0,
    every: float = 0.5,
    what: str = "task",
) -> list[asyncio.Task[Any]]:
    """:func:`stop_task` for each of ``tasks`` at the same time (one ``grace`` in all, not
    one each); the tasks still running after it, each logged as ``what`` and its name."""
    pending = list(tasks)
    stopped = await asyncio.gather(
        *(stop_task(t, grace=grace, every=every, what=f"{what} {t.get_name()}") for t in pending)
    )
    return [t for t, ok in zip(pending, stopped, strict=True) if not ok]
