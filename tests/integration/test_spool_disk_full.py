"""A full disk under the agent's spool: a clear error, live data keeps flowing, no crash,
and spooling resumes when space comes back (a real 4 MiB tmpfs)."""

from __future__ import annotations

import errno
import logging
import time
from pathlib import Path

import pytest

from edge_agent import app
from harness.fleet import agent_config, gateway_config, make_pki, running_agent, running_gateway
from harness.waiting import wait_for
from tests.conftest import small_tmpfs


def fill(path: Path) -> int:
    """Write into ``path`` until the filesystem is full; bytes written."""
    written = 0
    chunk = b"\0" * 65536
    with path.open("wb", buffering=0) as f:
        while True:
            try:
                written += f.write(chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                break
    # and the last few bytes, so not even one page is left
    with path.open("ab", buffering=0) as f:
        for _ in range(4096):
            try:
                f.write(b"\0" * 512)
                written += 512
            except OSError:
                break
    return written


async def test_full_disk_keeps_live_data_flowing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(app, "SPOOL_RECOVERY_SECONDS", 8.0)
    pki = make_pki(tmp_path)
    with small_tmpfs(tmp_path / "small", "4m") as mnt:
        async with running_gateway(gateway_config(pki)) as gw:
            cfg = agent_config(pki, "edge-a", gw, spool_dir=mnt / "state")
            async with running_agent(cfg) as agent:
                assert agent.tunnel is not None
                outbox = agent.tunnel.outbox
                spool = outbox.spool
                assert spool is not None

                def batches() -> int:
                    view = gw.registry.node("edge-a", now=time.time())
                    return view.batches_received if view else 0

                await wait_for(lambda: batches() >= 3, what="first batches")
                filler = mnt / "filler"
                fill(filler)
                await wait_for(lambda: not spool.stats().healthy, what="spool failing")
                # live data keeps flowing while nothing can be spooled
                before, unspooled = batches(), outbox.unspooled
                await wait_for(lambda: batches() >= before + 5, what="live batches")
                assert outbox.unspooled > unspooled
                assert spool.stats().write_errors > 0
                body = agent.published.snapshot
                assert body is not None
                errors = [
                    r.getMessage() for r in caplog.records if "cannot be written" in r.getMessage()
                ]
                assert len(errors) == 1, errors  # once per episode, not once per batch
                assert "sending live batches without spooling" in errors[0]
                # space comes back: spooling resumes, logged once
                filler.unlink()
                await wait_for(lambda: spool.stats().healthy, what="spool recovered")
                unspooled = outbox.unspooled
                await wait_for(lambda: batches() >= before + 10, what="more batches")
                assert outbox.unspooled == unspooled
                assert any("writable again" in r.getMessage() for r in caplog.records)

                def exported(name: str) -> float | None:
                    snap = agent.published.snapshot
                    values = [x.value for x in snap.samples if x.name == name] if snap else []
                    return values[0] if values else None

                await wait_for(
                    lambda: exported("gpurelay_agent_spool_healthy") == 1.0, what="healthy 1"
                )
                errors_total = exported("gpurelay_agent_spool_write_errors_total")
                assert errors_total is not None and errors_total > 0
