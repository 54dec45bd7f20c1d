"""Range ACKs over real SSH (issue 15): an agent at its default ``ack_delay_seconds`` gets
one ACK_RANGES frame every few batches, and an agent that asks for none (0, what an
older agent does) still gets one ACK per batch; both lose nothing."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from harness.fleet import agent_config, gateway_config, make_pki, running_agent, running_gateway
from harness.waiting import wait_for


async def run(tmp_path: Path, delay: float) -> tuple[int, int, int]:
    """(batches the gateway took, ACK frames it wrote, seqs still in the agent's spool that
    the gateway acknowledged): 40 batches at a 0.2 s interval."""
    pki = make_pki(tmp_path)
    async with running_gateway(gateway_config(pki)) as gw:
        cfg = agent_config(pki, "edge-a", gw)
        cfg = dataclasses.replace(
            cfg, gateway=dataclasses.replace(cfg.gateway, ack_delay_seconds=delay)
        )
        async with running_agent(cfg) as agent:
            tunnel = agent.tunnel
            assert tunnel is not None
            await wait_for(lambda: gw.ingest.stats.batches >= 40, what="40 batches")
            await wait_for(lambda: tunnel.stats.acked_seq > 0, what="an acknowledgement")
            stats = gw.ingest.stats
            batches, frames = stats.batches, stats.ack_frames
            spool = tunnel.outbox.spool
            assert spool is not None
            spooled = {b.seq for b in spool.pending(limit=1000)}
            acked = tunnel.stats.acked_seq
            ledger = gw.ingest.delivery.ledger("edge-a")
            kept = {s for s in spooled if s <= acked and s in ledger}
            return batches, frames, len(kept)


async def test_one_range_frame_every_few_batches_and_nothing_acked_is_kept(
    tmp_path: Path,
) -> None:
    batches, frames, kept = await run(tmp_path / "ranges", delay=3.0)
    assert frames * 5 <= batches, (frames, batches)  # 0.2 s interval, 3 s delay: ~1 per 15
    assert kept == 0


async def test_an_agent_that_asks_for_no_delay_gets_an_ack_per_batch(tmp_path: Path) -> None:
    batches, frames, kept = await run(tmp_path / "single", delay=0.0)
    assert frames >= batches - 2, (frames, batches)  # the last ones may be on their way
    assert kept == 0
