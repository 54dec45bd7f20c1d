"""The shipped Prometheus configs (deploy/prometheus/) against a real Prometheus.

A real ``prometheus`` binary (Debian package ``prometheus``) on loopback scrapes a real
gateway both ways: the unified ``/metrics`` (job ``edge-gpu``) and every published edge
endpoint discovered through ``/api/v1/sd`` and scraped through the gateway as
``proxy_url`` (job ``edge-gpu-proxied``). Two agents with simulated GPUs push to the
gateway; one also publishes a sibling machine's exporter under its own node name.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from edge_agent.config import PublishConfig
from harness.fleet import (
    TOKEN,
    agent_config,
    fake_exporter,
    gateway_config,
    make_pki,
    running_agent,
    running_gateway,
)
from harness.prometheus import running_prometheus
from harness.waiting import wait_for

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
# Every Prometheus config shipped there goes through `promtool check config` below; rule
# files (*.rules.yml) through `promtool check rules` in their own tests.
# Prometheus configurations, not rule files (a rule file's top level is ``groups:``;
# tests/unit/deploy/test_alert_rules.py and test_exporter_compat_rules.py check those).
SHIPPED = tuple(
    sorted(
        p.name
        for p in DEPLOY.glob("*.yml")
        if not any(line.startswith("groups:") for line in p.read_text().splitlines())
    )
)

# What the shipped files say, and what the tests put there instead.
GATEWAY = "gateway.example.com:9410"
TOKEN_FILE = "/etc/prometheus/edge-gpu-relay.token"
FAST = {
    "scrape_interval: 15s": "scrape_interval: 1s",
    "evaluation_interval: 15s": "evaluation_interval: 1s",
    "refresh_interval: 30s": "refresh_interval: 1s",
}

UNIFIED_JOB = "edge-gpu"
PROXIED_JOB = "edge-gpu-proxied"
SIBLING = "edge-cam-1"
SIBLING_BODY = "node_load1 0.5\n"
# Bounds, not expectations: the first scrapes come ~6 s after start (Prometheus hands
# discovered targets to its scrapers every 5 s); a stopped node is down ~1 s after.
SCRAPE_DEADLINE = 60.0  # Prometheus start -> every series of both paths seen
DOWN_DEADLINE = 30.0  # agent stopped -> its target down, gpurelay_node_up 0


def substituted(text: str, replacements: dict[str, str]) -> str:
    """``text`` with every key replaced; each key must occur (the shipped file drifted
    otherwise, and the test would silently test something else)."""
    for old, new in replacements.items():
        assert old in text, f"{old!r} not found in the shipped config"
        text = text.replace(old, new)
    return text


def scrape_jobs(text: str) -> str:
    """The text of a config after its ``scrape_configs:`` line."""
    _, sep, jobs = text.partition("\nscrape_configs:\n")
    assert sep, "no top-level scrape_configs: line"
    return jobs


# --- the shipped files, statically ------------------------------------------------------------


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_config_passes_promtool(name: str, promtool: Path, tmp_path: Path) -> None:
    token = tmp_path / "edge-gpu-relay.token"
    token.write_text(TOKEN + "\n")
    text = (DEPLOY / name).read_text()
    replacements = {TOKEN_FILE: str(token)} if TOKEN_FILE in text else {}
    config = tmp_path / name
    config.write_text(substituted(text, replacements))
    proc = subprocess.run(
        [str(promtool), "check", "config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_documented_config_is_checked() -> None:
    expected = {"unified.yml", "proxied.yml", "prometheus.yml", "remote-write-receiver.yml"}
    assert expected <= set(SHIPPED)
    assert not list(DEPLOY.glob("*.yaml")), "name Prometheus configs *.yml, so they are checked"


def test_combined_example_is_the_two_jobs_verbatim() -> None:
    unified = scrape_jobs((DEPLOY / "unified.yml").read_text())
    proxied = scrape_jobs((DEPLOY / "proxied.yml").read_text())
    combined = scrape_jobs((DEPLOY / "prometheus.yml").read_text())
    assert combined == unified + "\n" + proxied


# --- end to end --------------------------------------------------------------------------------


class PromQL:
    def __init__(self, client: httpx.AsyncClient, log: Path) -> None:
        self.client = client
        self.log = log

    async def query(self, expr: str) -> list[dict[str, Any]]:
        r = await self.client.get("/api/v1/query", params={"query": expr})
        r.raise_for_status()
        doc = r.json()
        assert doc["status"] == "success", doc
        result: list[dict[str, Any]] = doc["data"]["result"]
        return result

    async def at(self, expr: str, when: float) -> list[dict[str, Any]]:
        """An instant query evaluated at ``when`` (Unix time); a failure names the query."""
        r = await self.client.get("/api/v1/query", params={"query": expr, "time": f"{when:.3f}"})
        assert r.status_code == 200, f"{expr}\n-> {r.status_code} {r.text}"
        doc = r.json()
        assert doc["status"] == "success", doc
        result: list[dict[str, Any]] = doc["data"]["result"]
        return result

    async def by(self, expr: str, label: str = "instance") -> dict[str, float]:
        """``{label value: sample value}`` of an instant query."""
        return {s["metric"].get(label, ""): float(s["value"][1]) for s in await self.query(expr)}

    async def until(
        self, what: str, check: Callable[[], Awaitable[str]], end: float, poll: float = 0.25
    ) -> None:
        """Poll ``await check()`` (a problem string, "" when satisfied) until the
        ``time.monotonic()`` value ``end``."""
        problem = "not checked yet"
        while time.monotonic() < end:
            try:
                problem = await check()
            except httpx.TransportError as exc:  # not listening yet
                problem = f"Prometheus not reachable: {exc}"
            except httpx.HTTPStatusError as exc:  # 503 until its storage is open
                problem = f"Prometheus not ready: {exc.response.status_code}"
            if not problem:
                return
            await asyncio.sleep(poll)
        tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-15:])
        raise AssertionError(
            f"timed out waiting for {what}: {problem}\n--- prometheus log ---\n{tail}"
        )


async def test_prometheus_scrapes_the_fleet_both_ways(prometheus_bin: Path, tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    token_file = tmp_path / "edge-gpu-relay.token"
    token_file.write_text(TOKEN + "\n")
    gpus = {"edge-a": 2, "edge-b": 1}

    async with (
        fake_exporter(SIBLING_BODY) as sibling_port,
        running_gateway(gateway_config(pki, siblings=(f"edge-a={SIBLING}",))) as gw,
    ):
        cfg_a = agent_config(pki, "edge-a", gw, gpus=gpus["edge-a"])
        cfg_a = dataclasses.replace(
            cfg_a,
            publish=(
                PublishConfig(
                    name="node_exporter", node=SIBLING, port=9100, target_port=sibling_port
                ),
            ),
        )
        cfg_b = agent_config(pki, "edge-b", gw, gpus=gpus["edge-b"])
        async with running_agent(cfg_a) as agent_a, contextlib.AsyncExitStack() as stack_b:
            agent_b = await stack_b.enter_async_context(running_agent(cfg_b))
            await wait_for(
                lambda: (
                    gw.endpoints.count() == 3
                    and {"edge-a", "edge-b"} <= set(gw.registry.states(time.time()))
                ),
                what="both agents to connect and publish",
            )
            targets = {
                "edge-a": f"edge-a:{agent_a.port}",
                "edge-b": f"edge-b:{agent_b.port}",
                SIBLING: f"{SIBLING}:9100",
            }

            text = (DEPLOY / "prometheus.yml").read_text()
            config = tmp_path / "prometheus.yml"
            config.write_text(
                substituted(
                    text,
                    {
                        GATEWAY: f"127.0.0.1:{gw.http_port}",
                        TOKEN_FILE: str(token_file),
                        **FAST,
                    },
                )
            )
            with running_prometheus(prometheus_bin, config, tmp_path) as (url, log):
                async with httpx.AsyncClient(base_url=url, timeout=5, trust_env=False) as http:
                    prom = PromQL(http, log)
                    await check_both_paths(prom, gpus, targets)

                    # One agent goes away: its proxied target is down, the others stay up.
                    stopped = time.monotonic()
                    await stack_b.aclose()
                    await check_one_node_down(prom, stopped)


async def check_both_paths(prom: PromQL, gpus: dict[str, int], targets: dict[str, str]) -> None:
    nodes = set(gpus)

    async def unified() -> str:
        found = await prom.query(f'DCGM_FI_DEV_GPU_UTIL{{job="{UNIFIED_JOB}"}}')
        per_node = {n: sum(1 for s in found if s["metric"]["instance"] == n) for n in nodes}
        if per_node != gpus:
            return f"GPU series per instance {per_node}, want {gpus}"
        wrong = [s["metric"] for s in found if s["metric"]["Hostname"] != s["metric"]["instance"]]
        return f"instance is not the node name: {wrong}" if wrong else ""

    async def proxied() -> str:
        up = await prom.query(f'up{{job="{PROXIED_JOB}"}}')
        seen = {s["metric"]["instance"]: s for s in up}
        if set(seen) != set(targets):
            return f"proxied targets {sorted(seen)}, want {sorted(targets)}"
        down = {n: s["value"][1] for n, s in seen.items() if s["value"][1] != "1"}
        if down:
            return f"up != 1 for {down}"
        found = await prom.query(f'DCGM_FI_DEV_GPU_UTIL{{job="{PROXIED_JOB}"}}')
        per_node = {n: sum(1 for s in found if s["metric"]["instance"] == n) for n in nodes}
        if per_node != gpus:
            return f"GPU series per instance {per_node}, want {gpus}"
        wrong = [s["metric"] for s in found if s["metric"]["Hostname"] != s["metric"]["instance"]]
        return f"Hostname is not the node name: {wrong}" if wrong else ""

    end = time.monotonic() + SCRAPE_DEADLINE
    await prom.until("every node's GPU series through the unified /metrics", unified, end)
    await prom.until("every proxied target up, GPU series per node", proxied, end)

    # Labels: instance is the node; via and domain kept; the SD-only labels dropped.
    for sample in await prom.query(f'up{{job="{PROXIED_JOB}"}}'):
        labels = sample["metric"]
        node = labels["instance"]
        via = "edge-a" if node == SIBLING else node
        assert labels["via"] == via, labels
        assert labels["domain"] == via, labels  # no domain configured: the tunnel node's name
        assert not {"node", "agent_version", "gpu_count"} & set(labels), labels
    sibling = await prom.by(f'node_load1{{job="{PROXIED_JOB}"}}')
    assert sibling == {SIBLING: 0.5}
    # The gateway's node liveness, through the unified path, under the node name.
    assert await prom.by(f'gpurelay_node_up{{job="{UNIFIED_JOB}"}}') == dict.fromkeys(gpus, 1.0)


async def check_one_node_down(prom: PromQL, stopped: float) -> None:
    # The gateway drops an offline node from http_sd, so Prometheus soon drops the target
    # (its `up` goes stale rather than staying 0). Until it does, scrapes get the gateway's
    # 503 and `up` is 0; min_over_time finds that sample even after the target is gone.
    async def b_down() -> str:
        window = f"{int(time.monotonic() - stopped) + 2}s"
        low = await prom.by(f'min_over_time(up{{job="{PROXIED_JOB}"}}[{window}])')
        if low.get("edge-b") != 0.0:
            return f"min of up over the last {window}: {low}"
        if low.get("edge-a") != 1.0 or low.get(SIBLING) != 1.0:
            return f"a target that should stay up was not: {low}"
        now = await prom.by(f'up{{job="{PROXIED_JOB}", instance=~"edge-a|{SIBLING}"}}')
        return "" if now == {"edge-a": 1.0, SIBLING: 1.0} else f"up now {now}"

    end = stopped + DOWN_DEADLINE
    await prom.until("edge-b's proxied target to go down", b_down, end, poll=0.2)

    async def b_offline() -> str:
        up = await prom.by(f'gpurelay_node_up{{job="{UNIFIED_JOB}"}}')
        return "" if up == {"edge-a": 1.0, "edge-b": 0.0} else f"gpurelay_node_up {up}"

    await prom.until("gpurelay_node_up of edge-b to be 0", b_offline, end)
