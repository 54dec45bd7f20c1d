"""Agent -> SSH tunnel -> gateway -> /metrics, over real asyncssh on loopback."""

from __future__ import annotations

import argparse
import asyncio
import re
import time
from pathlib import Path

import asyncssh
import httpx
import pytest

from cloud_gateway.commands.nodes import run_nodes
from cloud_gateway.trust import certs
from edge_agent.tunnel import Tunnel
from gpurelay.wire import SUBSYSTEM, ErrorFrame, FrameDecoder
from harness.fleet import (
    TOKEN,
    agent_config,
    auth_failures,
    gateway_config,
    make_pki,
    metrics_text,
    running_agent,
    running_gateway,
    with_port,
)
from harness.pipeline import make_pipeline
from harness.waiting import wait_for
from tests.promtool_support import unexpected_findings


def _series(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(name + "{")]


async def test_agent_pushes_and_gateway_exposes_it_under_the_node_name(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    async with running_gateway(gateway_config(pki)) as gw:
        async with running_agent(agent_config(pki, "edge-a", gw, gpus=2)) as agent:
            await wait_for(lambda: gw.ingest.stats.batches >= 3, what="three batches")
            gw._refresh()
            text = await metrics_text(gw)
            util = _series(text, "DCGM_FI_DEV_FB_USED")
            assert len(util) >= 2 and all('Hostname="edge-a"' in line for line in util)
            procs = _series(text, "DCGM_CUSTOM_PROCESS_MEM_USED")
            assert procs and all('NodeName="edge-a"' in line for line in procs)
            assert 'gpurelay_node_up{Hostname="edge-a"} 1' in text
            assert 'gpurelay_agent_gateway_connected{Hostname="edge-a"} 1' in text
            tunnel = agent.tunnel
            assert tunnel is not None  # ACKs come in ranges, up to [gateway] ack_delay + 1 s late
            await wait_for(lambda: tunnel.stats.acked_seq >= 2, what="two batches acknowledged")
            base = f"http://127.0.0.1:{gw.http_port}"
            async with httpx.AsyncClient(base_url=base) as client:
                assert (await client.get("/api/v1/nodes")).status_code == 401
                wrong = await client.get("/api/v1/nodes", headers={"Authorization": "Bearer no"})
                assert wrong.status_code == 403 and "not accepted" in wrong.json()["error"]
                auth = {"Authorization": f"Bearer {TOKEN}"}
                nodes = (await client.get("/api/v1/nodes", headers=auth)).json()["nodes"]
                assert [(n["name"], n["state"], n["gpu_count"]) for n in nodes] == [
                    ("edge-a", "online", 2)
                ]
                detail = (await client.get("/api/v1/nodes/edge-a", headers=auth)).json()
                assert len(detail["gpus"]) == 2 and detail["series"] > 100
                missing = await client.get("/api/v1/nodes/nope", headers=auth)
                assert missing.status_code == 404
                bie = (await client.get("/v1/collect")).json()
                assert bie["edge-a"]["deviceNum"] == 2
                assert (await client.get("/readyz")).status_code == 200
                spec = (await client.get("/openapi.json")).json()
                assert "/api/v1/nodes/{node}" in spec["paths"]


async def test_nodes_cli_table_and_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pki = make_pki(tmp_path)
    async with running_gateway(gateway_config(pki)) as gw:
        async with running_agent(agent_config(pki, "edge-a", gw)):
            await wait_for(lambda: gw.ingest.stats.batches >= 1)
            gw._refresh()  # the tick that reads the certificate's expiry (EXPIRES)
            url = f"http://127.0.0.1:{gw.http_port}"

            def nodes(**kw: object) -> int:
                args = argparse.Namespace(
                    gateway=url,
                    token=TOKEN,
                    token_file=None,
                    state=None,
                    domain=None,
                    json=False,
                    timeout=5.0,
                )
                for k, v in kw.items():
                    setattr(args, k, v)
                return run_nodes(args)

            assert await asyncio.to_thread(nodes) == 0
            out = capsys.readouterr().out
            assert re.search(
                r"^edge-a\s+online\s+edge-a\s+1\s+\d+s ago\s+0\.1\.0\s+"
                r"\d{4}-\d\d-\d\d \(89d\)\s+edge-a:\d+$",
                out,
                re.M,
            )
            assert await asyncio.to_thread(nodes, token="bad") == 1
            assert "token was not accepted" in capsys.readouterr().err
            assert await asyncio.to_thread(nodes, gateway="http://127.0.0.1:9") == 1
            assert "cannot reach the gateway" in capsys.readouterr().err


async def test_a_node_cannot_publish_as_another_node(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    creds_a = pki.node("edge-a")
    async with running_gateway(gateway_config(pki)) as gw:
        # 1. Logging in as edge-b with edge-a's certificate is refused.
        cfg = agent_config(pki, "edge-b", gw, creds=creds_a)
        async with running_agent(cfg):
            await wait_for(lambda: auth_failures(gw, "principal_mismatch") >= 1)
        assert gw.ingest.stats.batches == 0
        # 2. Logged in as edge-a, the agent claims to be edge-b in hello and in labels.
        pipeline, _sim, _clock = make_pipeline(tmp_path / "b", gpus=1)  # labels say edge-node-1
        try:
            snap = pipeline.collection.collect()
        finally:
            pipeline.close()
        assert any(("Hostname", "edge-node-1") in s.labels for s in snap.samples)
        cfg = agent_config(pki, "edge-a", gw, creds=creds_a)
        from gpurelay.wire import Hello

        tunnel = Tunnel(
            cfg.gateway, node="edge-a", hello=lambda: Hello(agent_version="x", node="edge-node-1")
        )
        tunnel.submit(snap)
        task = asyncio.create_task(tunnel.run())
        try:
            await wait_for(lambda: gw.ingest.stats.batches >= 1)
            gw._refresh()
            text = await metrics_text(gw)
        finally:
            task.cancel()
        assert "edge-node-1" not in text
        assert 'Hostname="edge-a"' in text
        assert gw.ingest.stats.name_mismatches == 1


@pytest.mark.parametrize("case", ["unknown_ca", "expired", "revoked"])
async def test_bad_certificates_are_refused_and_counted(tmp_path: Path, case: str) -> None:
    pki = make_pki(tmp_path)
    if case == "unknown_ca":
        other = certs.init_ca(tmp_path / "other-ca")
        creds = certs.issue_node(other.dir, "edge-a")
    elif case == "expired":
        creds = pki.node("edge-a", days=1, now=time.time() - 3 * 86400)
    else:
        creds = pki.node("edge-a")
        certs.revoke(pki.ca.dir, "edge-a")
    async with running_gateway(gateway_config(pki)) as gw:
        async with running_agent(agent_config(pki, "edge-a", gw, creds=creds)) as agent:
            await wait_for(lambda: auth_failures(gw, case) >= 1, what=f"{case} refusal")
            assert agent.tunnel is not None and not agent.tunnel.stats.connected
            # the agent keeps serving locally while refused
            assert agent.published.snapshot is not None
        gw._refresh()
        text = await metrics_text(gw)
    assert re.search(rf'gpurelay_gateway_auth_failures_total{{reason="{case}"}} [1-9]', text)
    assert gw.ingest.stats.batches == 0


async def test_revoking_a_connected_node_closes_it(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    async with running_gateway(gateway_config(pki)) as gw:
        async with running_agent(agent_config(pki, "edge-a", gw)):
            await wait_for(lambda: gw.ingest.stats.batches >= 1)
            certs.revoke(pki.ca.dir, "edge-a")
            await wait_for(
                lambda: gw.registry.states(time.time()).get("edge-a") == "offline",
                timeout=20,
                what="revoked node disconnected",
            )
            assert auth_failures(gw, "revoked") >= 1


async def test_gateway_restart_agent_reconnects_and_series_return(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    cfg = gateway_config(pki)
    async with running_gateway(cfg) as gw:
        port = gw.ssh_port
        agent_cfg = agent_config(pki, "edge-a", gw)
        async with running_agent(agent_cfg) as agent:
            await wait_for(lambda: gw.ingest.stats.batches >= 1)
            first_connects = agent.tunnel.stats.connects if agent.tunnel else 0
            await gw.shutdown()  # GOODBYE to the agent, close
            async with running_gateway(with_port(cfg, port)) as gw2:
                await wait_for(
                    lambda: gw2.ingest.stats.batches >= 2, timeout=30, what="batches after restart"
                )
                gw2._refresh()
                text = await metrics_text(gw2)
                assert _series(text, "DCGM_FI_DEV_GPU_TEMP")
                assert agent.tunnel is not None and agent.tunnel.stats.connects > first_connects


async def test_second_connection_for_a_node_wins(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    creds = pki.node("edge-a")
    async with running_gateway(gateway_config(pki)) as gw:
        async with running_agent(agent_config(pki, "edge-a", gw, creds=creds)) as first:
            await wait_for(lambda: gw.ingest.stats.batches >= 1)
            async with running_agent(agent_config(pki, "edge-a", gw, creds=creds)):
                await wait_for(lambda: gw.ingest.stats.replaced_connections >= 1)
                assert first.tunnel is not None
                await wait_for(lambda: first.tunnel.stats.connects >= 1)


async def test_garbage_on_the_channel_gets_an_error_and_only_that_node_is_dropped(
    tmp_path: Path,
) -> None:
    pki = make_pki(tmp_path)
    bad = pki.node("edge-bad")
    async with running_gateway(gateway_config(pki)) as gw:
        async with running_agent(agent_config(pki, "edge-good", gw)):
            await wait_for(lambda: gw.ingest.stats.batches >= 1)
            key = asyncssh.read_private_key(str(bad.private_key))
            cert = asyncssh.read_certificate(str(bad.certificate))
            async with asyncssh.connect(
                "127.0.0.1",
                gw.ssh_port,
                username="edge-bad",
                client_keys=[(key, cert)],
                known_hosts=str(pki.ca.known_hosts),
                agent_path=None,
                config=None,
            ) as conn:
                writer, reader, _ = await conn.open_session(subsystem=SUBSYSTEM, encoding=None)
                writer.write(b"\x00\x00\x00\x05\x07\x01abc")  # version 7
                data = await asyncio.wait_for(reader.read(65536), 5)
            (frame,) = FrameDecoder().feed(data)
            assert isinstance(frame, ErrorFrame) and frame.code == "version"
            before = gw.ingest.stats.batches
            await wait_for(lambda: gw.ingest.stats.batches > before, what="good node continues")
            assert gw.ssh is not None and gw.ssh.protocol_errors["version"] == 1


async def test_a_restarted_agent_is_not_mistaken_for_a_replay(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    creds = pki.node("edge-a")
    async with running_gateway(gateway_config(pki)) as gw:
        async with running_agent(agent_config(pki, "edge-a", gw, creds=creds)):
            await wait_for(lambda: gw.ingest.stats.batches >= 2)
        applied = gw.ingest.stats.batches - gw.ingest.stats.duplicates
        async with running_agent(agent_config(pki, "edge-a", gw, creds=creds)):
            await wait_for(
                lambda: gw.ingest.stats.batches - gw.ingest.stats.duplicates >= applied + 2,
                what="new batches applied after restart",
            )
        assert gw.ingest.stats.duplicates == 0


async def test_gateway_metrics_pass_promtool(tmp_path: Path, promtool: Path) -> None:
    pki = make_pki(tmp_path)
    async with running_gateway(gateway_config(pki)) as gw:
        async with running_agent(agent_config(pki, "edge-a", gw, gpus=2)):
            async with running_agent(agent_config(pki, "edge-b", gw)):
                # edge-a may send its 4 batches before edge-b has connected: wait for both
                await wait_for(
                    lambda: (
                        {"edge-a", "edge-b"} <= set(gw.registry.states(time.time()))
                        and gw.ingest.stats.batches >= 4
                    ),
                    what="both agents sending",
                )
                deadline = time.monotonic() + 15
                while True:
                    gw._refresh()
                    text = await metrics_text(gw)
                    if 'Hostname="edge-a"' in text and 'Hostname="edge-b"' in text:
                        break
                    assert time.monotonic() < deadline, "both nodes' series in /metrics"
                    await asyncio.sleep(0.1)
    assert await asyncio.to_thread(unexpected_findings, promtool, text.encode()) == []
