"""``Agent.collect_now``: the running loop collects at once, then keeps its interval."""

from __future__ import annotations

import asyncio
import dataclasses

from edge_agent.app import Agent
from edge_agent.config import SimulateConfig, load
from harness.waiting import wait_for


def collections(agent: Agent) -> float:
    snapshot = agent.published.snapshot
    assert snapshot is not None
    (total,) = (s.value for s in snapshot.samples if s.name == "gpurelay_agent_collections_total")
    return total


async def test_collect_now_collects_once_at_once() -> None:
    cfg = dataclasses.replace(
        load(None, {}),
        listen="127.0.0.1:0",
        interval_seconds=3600.0,
        simulate=SimulateConfig(gpus=1),
    )
    agent = Agent(cfg)
    await agent.startup()
    run = asyncio.create_task(agent.run())
    try:
        assert collections(agent) == 1  # start-up's
        await asyncio.sleep(0.1)  # the loop sleeps until the next interval, an hour away
        agent.collect_now()
        await wait_for(lambda: collections(agent) == 2, 10, "the collection asked for")
        await asyncio.sleep(0.5)
        assert collections(agent) == 2, "one collection, then the interval again"
    finally:
        agent.stop.set()
        await run
        await agent.shutdown()
