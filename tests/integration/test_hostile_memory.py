"""Memory a hostile connection made the gateway hold goes back when it closes (issue 24,
attack W17), measured from outside: the gateway process's RSS in /proc.

One node churns 100,000 series ids (declared, valued, retired, 1,000 at a time) and
never reads what the gateway sends; then it disconnects. Python freed everything (the
registry holds nothing of it), yet the process stayed ~15 MiB larger for good (the
issue measured +34 MiB): each 64 KiB read of compressed DECLAREs was decoded whole,
~25,000 small objects at once, and the few that lived on pinned Python's allocator
arenas. With PYTHONMALLOC=malloc the same run kept +4.8 MiB. The gateway now decodes a
read a frame at a time (gpurelay.wire.FrameDecoder.frames): +2.8 MiB while the node is
connected and after, instead of +16."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from bench.hostile_rss import churn_attack, connect, rss_mib, settled_rss
from gpurelay.wire import SUBSYSTEM, FrameEncoder, Hello
from harness.fleet import make_pki
from harness.services import GatewayProc
from harness.waiting import wait_until

GIVEN_BACK_WITHIN = 20.0  # seconds: the connection's end reaches the gateway
KEPT_MIB = 12.0  # what may stay of it (the node's record, tables at their high size)


async def test_a_closed_hostile_connection_gives_its_memory_back(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    gw = GatewayProc(pki, tmp_path, log_level="warning")
    gw.start()
    try:
        wait_until(gw.ready, 60, "gateway ready", alive=[gw])
        before = await settled_rss(gw)
        conn = await connect(pki, gw, "evil-churn")
        writer, _, _ = await conn.open_session(subsystem=SUBSYSTEM, encoding=None)
        enc = FrameEncoder()
        writer.write(enc.encode(Hello(agent_version="0", node="evil-churn")))
        await churn_attack(writer, enc)
        during = await settled_rss(gw)
        conn.close()
        await conn.wait_closed()
        deadline = time.monotonic() + GIVEN_BACK_WITHIN
        after = rss_mib(gw)
        while after > before + KEPT_MIB and time.monotonic() < deadline:
            await asyncio.sleep(1.0)
            after = rss_mib(gw)
        figures = (
            f"gateway RSS {before:.1f} MiB before, {during:.1f} with the churning node, "
            f"{after:.1f} after it closed (kept {after - before:+.1f} MiB, budget {KEPT_MIB:g})"
        )
        print(figures)
        assert after <= before + KEPT_MIB, figures
        assert gw.running(), figures
    finally:
        gw.stop()
