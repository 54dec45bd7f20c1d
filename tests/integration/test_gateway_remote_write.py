"""The gateway forwards every collection by remote write over real asyncssh on loopback:
a real agent, a real gateway, and a small aiohttp receiver that decodes what it gets.
ACKs follow the receiver's 2xx; while it answers 503 nothing is acknowledged (the agent
keeps it), and everything arrives once it recovers."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import cramjam
import pytest
from aiohttp import web

from cloud_gateway.remote_write.config import RemoteWriteConfig
from edge_agent.config import SpoolConfig
from harness.fleet import (
    agent_config,
    gateway_config,
    make_pki,
    metrics_text,
    running_agent,
    running_gateway,
)
from harness.waiting import wait_for
from tests.promtool_support import unexpected_findings
from tests.unit.gateway.remote_write.test_prompb import decode_write_request

NODE = "edge-rw"


class FakeReceiver:
    """Answers ``status``; keeps every accepted series, by labels."""

    def __init__(self) -> None:
        self.status = 204
        self.accepted: dict[tuple[tuple[str, str], ...], set[int]] = {}
        self.refused = 0
        self.url = ""

    async def write(self, request: web.Request) -> web.Response:
        assert request.headers["Content-Encoding"] == "snappy"
        body = bytes(cramjam.snappy.decompress_raw(await request.read()))
        if self.status >= 300:
            self.refused += 1
            return web.Response(status=self.status, text="try later")
        for labels, points in decode_write_request(body):
            self.accepted.setdefault(labels, set()).update(ts for ts, _ in points)
        return web.Response(status=self.status)

    def timestamps(self, name: str) -> set[int]:
        return {
            ts
            for labels, tss in self.accepted.items()
            if ("__name__", name) in labels
            for ts in tss
        }


@asynccontextmanager
async def fake_receiver() -> AsyncIterator[FakeReceiver]:
    receiver = FakeReceiver()
    app = web.Application()
    app.router.add_post("/api/v1/write", receiver.write)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    receiver.url = f"http://127.0.0.1:{port}/api/v1/write"
    try:
        yield receiver
    finally:
        await runner.cleanup()


def rw_section(url: str) -> RemoteWriteConfig:
    return RemoteWriteConfig(url=url, min_backoff_seconds=0.01, max_backoff_seconds=0.05)


async def test_samples_arrive_with_their_timestamps_and_acks_follow(
    tmp_path: Path, promtool: Path
) -> None:
    pki = make_pki(tmp_path)
    async with fake_receiver() as receiver:
        cfg = dataclasses.replace(gateway_config(pki), remote_write=rw_section(receiver.url))
        async with running_gateway(cfg) as gw:
            acfg = dataclasses.replace(
                agent_config(pki, NODE, gw, gpus=2),
                spool=SpoolConfig(directory=tmp_path / "spool"),
            )
            async with running_agent(acfg) as agent:
                await wait_for(lambda: len(receiver.timestamps("DCGM_FI_DEV_GPU_UTIL")) >= 3)
                assert agent.tunnel is not None
                await wait_for(lambda: agent.tunnel.stats.acked_seq >= 3)  # type: ignore[union-attr]
                gw._refresh()
                text = await metrics_text(gw)
    util = [
        labels for labels in receiver.accepted if ("__name__", "DCGM_FI_DEV_GPU_UTIL") in labels
    ]
    assert len(util) == 2 and all(("Hostname", NODE) in labels for labels in util)
    assert "gpurelay_gateway_remote_write_sent_samples_total" in text
    assert "gpurelay_gateway_remote_write_queued_batches" in text
    assert await asyncio.to_thread(unexpected_findings, promtool, text.encode()) == []


async def test_nothing_is_acknowledged_while_the_receiver_is_down(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    async with fake_receiver() as receiver:
        receiver.status = 503
        cfg = dataclasses.replace(gateway_config(pki), remote_write=rw_section(receiver.url))
        async with running_gateway(cfg) as gw:
            acfg = dataclasses.replace(
                agent_config(pki, NODE, gw),
                spool=SpoolConfig(directory=tmp_path / "spool"),
            )
            async with running_agent(acfg) as agent:
                assert agent.tunnel is not None
                await wait_for(lambda: gw.ingest.stats.batches >= 5, what="live batches")
                assert receiver.refused >= 1
                assert agent.tunnel.stats.acked_seq == 0
                waiting = gw.ingest.forward_stats.queued
                assert waiting >= 4
                receiver.status = 204
                last = gw.ingest.stats.batches
                await wait_for(
                    lambda: (
                        gw.ingest.forward_stats.queued == 0 and gw.ingest.stats.batches > last + 2
                    ),
                    timeout=30,
                    what="the backlog delivered after recovery",
                )
                await wait_for(lambda: agent.tunnel.stats.acked_seq >= last)  # type: ignore[union-attr]
    assert len(receiver.timestamps("DCGM_FI_DEV_GPU_UTIL")) >= last
    assert gw.ingest.forward_stats.dropped == 0
    # One retry loop: every 503 is one request of one send, sent again by the forwarder.
    assert gw.remote_write is not None
    assert gw.remote_write.stats.retried_requests == receiver.refused
    assert gw.ingest.forward_stats.unavailable == receiver.refused


async def test_an_old_config_with_max_retries_starts_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pki = make_pki(tmp_path)
    rw = dataclasses.replace(rw_section("http://127.0.0.1:9/api/v1/write"), max_retries=10)
    cfg = dataclasses.replace(gateway_config(pki), remote_write=rw)
    with caplog.at_level(logging.WARNING, logger="cloud_gateway"):
        async with running_gateway(cfg):
            pass
    (line,) = [r.getMessage() for r in caplog.records if "max_retries" in r.getMessage()]
    assert line.startswith("remote_write.max_retries is deprecated and ignored")


async def test_a_held_channel_still_notices_the_agent_leaving(tmp_path: Path) -> None:
    """Over its queue bound the gateway stops reading the channel (SSH flow control holds
    the agent); when the agent goes meanwhile, the session ends all the same."""
    pki = make_pki(tmp_path)
    async with fake_receiver() as receiver:
        receiver.status = 503
        rw = dataclasses.replace(rw_section(receiver.url), max_queued_batches_per_node=1)
        cfg = dataclasses.replace(gateway_config(pki), remote_write=rw)
        async with running_gateway(cfg) as gw:
            acfg = dataclasses.replace(
                agent_config(pki, NODE, gw),
                spool=SpoolConfig(directory=tmp_path / "spool"),
            )
            async with running_agent(acfg):
                await wait_for(lambda: gw.ingest.forward_stats.queued >= 2, what="held")
                held = gw.ingest.forward_stats.queued
                await asyncio.sleep(0.5)  # two collections more at the agent
                assert gw.ingest.forward_stats.queued == held  # nothing more read meanwhile
            assert gw.ssh is not None
            await wait_for(lambda: gw.ssh.channels == 0, what="the channel to end")  # type: ignore[union-attr]
            await wait_for(lambda: gw.ingest.forward_stats.queued == 0, what="queue forgotten")
            view = gw.registry.node(NODE, now=gw.clock())
            assert view is not None and view.state == "offline"
