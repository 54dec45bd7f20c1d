"""The node label setting end to end: a gateway with ``[registry] node_label =
"hostname"`` (dcgm-exporter's name from its PR #655 on), one agent set the same way and
one left at ``Hostname``, and a real Prometheus running the shipped
``deploy/prometheus/prometheus.yml`` unchanged (both jobs).

* Unified job: every device series of both nodes carries ``hostname`` and ``NodeName``
  (the gateway's setting wins over the second agent's), never ``Hostname``, and the
  shipped relabelling copies the node into ``instance``; so do ``gpurelay_node_up``
  and the agents' own series.
* Proxied job (each agent's own exporter, through its tunnel): each agent's own label,
  rewritten to the node the tunnel vouches for, and ``instance`` the node.
"""

from __future__ import annotations

import dataclasses
import time
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
from harness.prometheus import running_prometheus
from harness.waiting import wait_for
from tests.integration.test_prometheus_e2e import (
    DEPLOY,
    FAST,
    GATEWAY,
    PROXIED_JOB,
    SCRAPE_DEADLINE,
    TOKEN_FILE,
    UNIFIED_JOB,
    PromQL,
    substituted,
)

AGENTS = {"edge-a": "hostname", "edge-b": "Hostname"}  # node -> the agent's node_label
GPUS = 2


def wrong_labels(series: list[dict[str, str]], node_label: str, other: str) -> list[str]:
    """Why each series does not name its node the expected way ('' when it does)."""
    problems = []
    for s in series:
        node = s.get("instance", "")
        if node not in AGENTS or s.get(node_label) != node or other in s:
            problems.append(f"{s}: want {node_label}=instance=node, no {other}")
    return problems


async def test_hostname_setting_through_a_real_prometheus(
    prometheus_bin: Path, tmp_path: Path
) -> None:
    pki = make_pki(tmp_path)
    token_file = tmp_path / "edge-gpu-relay.token"
    token_file.write_text(TOKEN + "\n")
    cfg = gateway_config(pki)
    cfg = dataclasses.replace(
        cfg, registry=dataclasses.replace(cfg.registry, node_label="hostname")
    )
    async with running_gateway(cfg) as gw:
        agents = [
            dataclasses.replace(agent_config(pki, node, gw, gpus=GPUS), node_label=label)
            for node, label in AGENTS.items()
        ]
        async with running_agent(agents[0]), running_agent(agents[1]):
            await wait_for(
                lambda: (
                    gw.endpoints.count() == 2
                    and set(AGENTS) <= set(gw.registry.states(time.time()))
                ),
                what="both agents to connect and publish",
            )
            config = tmp_path / "prometheus.yml"
            config.write_text(
                substituted(
                    (DEPLOY / "prometheus.yml").read_text(),
                    {GATEWAY: f"127.0.0.1:{gw.http_port}", TOKEN_FILE: str(token_file), **FAST},
                )
            )
            with running_prometheus(prometheus_bin, config, tmp_path) as (url, log):
                async with httpx.AsyncClient(base_url=url, timeout=5, trust_env=False) as http:
                    prom = PromQL(http, log)
                    await check_labels(prom)


async def check_labels(prom: PromQL) -> None:
    async def unified() -> str:
        device = await prom.query(f'DCGM_FI_DEV_GPU_UTIL{{job="{UNIFIED_JOB}"}}')
        labels = [s["metric"] for s in device]
        if len(labels) != GPUS * len(AGENTS):
            return f"{len(labels)} unified GPU series, want {GPUS * len(AGENTS)}"
        problems = wrong_labels(labels, "hostname", "Hostname")
        problems += [f"{s}: NodeName" for s in labels if s.get("NodeName") != s["instance"]]
        for name in ("gpurelay_node_up", "gpurelay_agent_info", "gpurelay_agent_collections_total"):
            found = [s["metric"] for s in await prom.query(f'{name}{{job="{UNIFIED_JOB}"}}')]
            if {s.get("instance") for s in found} != set(AGENTS):
                return f"{name}: instances {sorted(s.get('instance', '') for s in found)}"
            problems += wrong_labels(found, "hostname", "Hostname")
        return "\n".join(problems)

    async def proxied() -> str:
        device = await prom.query(f'DCGM_FI_DEV_GPU_UTIL{{job="{PROXIED_JOB}"}}')
        labels = [s["metric"] for s in device]
        if len(labels) != GPUS * len(AGENTS):
            return f"{len(labels)} proxied GPU series, want {GPUS * len(AGENTS)}"
        problems = []
        for node, label in AGENTS.items():
            other = {"Hostname": "hostname", "hostname": "Hostname"}[label]
            mine = [s for s in labels if s.get("instance") == node]
            problems += wrong_labels(mine, label, other)
            problems += [f"{s}: NodeName" for s in mine if s.get("NodeName") != node]
        return "\n".join(problems)

    end = time.monotonic() + SCRAPE_DEADLINE
    await prom.until("the unified job's labels", unified, end)
    await prom.until("the proxied job's labels", proxied, end)
