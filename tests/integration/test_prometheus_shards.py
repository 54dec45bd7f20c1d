"""A real Prometheus discovers the gateway's /metrics as shards (/api/v1/sd/metrics?shards=3)
and scrapes them as 3 targets: every target up, every node's series scraped exactly once."""

from __future__ import annotations

import contextlib
from pathlib import Path

import httpx

from harness.fleet import (
    TOKEN,
    agent_config,
    gateway_config,
    make_pki,
    running_agent,
    running_gateway,
)
from harness.process import HarnessError
from harness.prometheus import running_prometheus
from harness.waiting import wait_for

NODES = ("edge-1", "edge-2", "edge-3", "edge-4")
DEADLINE = 60.0  # Prometheus start -> every shard scraped (discovery hands targets every 5 s)


async def test_prometheus_scrapes_the_shards_each_node_once(
    tmp_path: Path, prometheus_bin: Path
) -> None:
    pki = make_pki(tmp_path)
    (tmp_path / "token").write_text(TOKEN + "\n")
    async with contextlib.AsyncExitStack() as stack:
        gw = await stack.enter_async_context(running_gateway(gateway_config(pki)))
        for node in NODES:
            await stack.enter_async_context(running_agent(agent_config(pki, node, gw)))
        await wait_for(lambda: len(gw.registry.nodes(gw.clock())) == len(NODES))
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s}\n"
            "scrape_configs:\n"
            "  - job_name: gpurelay\n"
            "    http_sd_configs:\n"
            f"      - url: http://127.0.0.1:{gw.http_port}/api/v1/sd/metrics?shards=3\n"
            "        refresh_interval: 1s\n"
            "        authorization:\n"
            "          type: Bearer\n"
            f"          credentials_file: {tmp_path / 'token'}\n"
        )
        with running_prometheus(prometheus_bin, config, tmp_path) as (url, log):
            async with httpx.AsyncClient(base_url=url, timeout=10) as client:

                async def query(q: str) -> list[dict[str, object]]:
                    r = await client.get("/api/v1/query", params={"query": q})
                    r.raise_for_status()
                    result: list[dict[str, object]] = r.json()["data"]["result"]
                    return result

                async def all_scraped() -> bool:
                    try:
                        up = await query('up{job="gpurelay"} == 1')
                        nodes = await query("count by (Hostname) (gpurelay_node_up)")
                    except httpx.HTTPError:
                        return False
                    return len(up) == 3 and len(nodes) == len(NODES)

                try:
                    await wait_for(all_scraped, timeout=DEADLINE)
                except HarnessError:
                    targets = (await client.get("/api/v1/targets")).text
                    raise AssertionError(f"{targets[:3000]}\n{log.read_text()[-3000:]}") from None
                shards = {r["metric"]["shard"] for r in await query('up{job="gpurelay"}')}  # type: ignore[index]
                assert shards == {"0", "1", "2"}
                per_node = await query("count by (Hostname) (gpurelay_node_up)")
                assert sorted(r["metric"]["Hostname"] for r in per_node) == list(NODES)  # type: ignore[index]
                assert {r["value"][1] for r in per_node} == {"1"}  # type: ignore[index]
                own = await query("count(gpurelay_gateway_info)")
                assert own[0]["value"][1] == "1"  # type: ignore[index]  # shard 0 only
