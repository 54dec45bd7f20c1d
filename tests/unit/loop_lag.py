"""How long the running event loop went without running anything: the tool of the
``*_off_loop`` tests, which block a file call for seconds in a worker and check that the
loop never waited for it. A busy machine adds milliseconds; a blocked loop, the seconds
the call was made to take, so the bounds they assert sit far from both."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass


@dataclass
class Lag:
    worst: float = 0.0  # seconds a 10 ms sleep overran, the most


@contextlib.asynccontextmanager
async def loop_lag(step: float = 0.01) -> AsyncIterator[Lag]:
    """Measure the loop's worst lag while the body runs (the body must await sometimes)."""
    lag = Lag()

    async def sleeper() -> None:
        while True:
            started = time.monotonic()
            await asyncio.sleep(step)
            lag.worst = max(lag.worst, time.monotonic() - started - step)

    task = asyncio.create_task(sleeper())
    await asyncio.sleep(0)  # it is asleep before the body runs, so a block shows
    try:
        yield lag
        await asyncio.sleep(2 * step)  # and it wakes once after the body, so a late block shows
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
