"""The gateway-side cluster features that need no database: the fair-share decision,
http_sd of the gateways' own /metrics (and a Prometheus config using it), and the
``cloud-gateway gateways`` table."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from cloud_gateway.cli import main
from cloud_gateway.cluster.membership import to_shed
from cloud_gateway.commands.gateways import render_table
from cloud_gateway.exposition.body import Exposition
from cloud_gateway.http.api import HttpState, make_app
from cloud_gateway.http.fleet_documents import metrics_targets
from cloud_gateway.registry.store import Registry


@pytest.mark.parametrize(
    ("owned", "total", "live", "expected"),
    [
        (100, 100, 1, 0),  # alone: nothing to shed to
        (50, 100, 2, 0),  # at the fair share
        (52, 100, 2, 0),  # within the slack
        (53, 100, 2, 1),  # one above it
        (100, 100, 2, 4),  # a new gateway joined: at most per_tick at a time
        (500, 1000, 3, 4),  # fair 334 + 16 (5 %): 150 above, 4 at a time
        (350, 1000, 3, 0),  # 334 + 16: at the limit
        (0, 1000, 4, 0),
    ],
)
def test_fair_share(owned: int, total: int, live: int, expected: int) -> None:
    assert to_shed(owned, total, live, per_tick=4) == expected


def test_shedding_converges_without_overshoot() -> None:
    """A fourth gateway joins 3 x 300 nodes: the shed nodes land on the lightest gateway
    (the balancer's leastconn); no gateway ever sheds below its share, and all settle."""
    load = [300, 300, 300, 0]
    ticks = 0
    while ticks < 1000:
        ticks += 1
        total = sum(load)
        shed = [to_shed(n, total, len(load), per_tick=4) for n in load]
        if not any(shed):
            break
        for i, k in enumerate(shed):
            assert not k or load[i] - k >= -(-total // len(load))  # never below its share
            load[i] -= k
            load[load.index(min(load))] += k
    fair = 225  # ceil(900 / 4), slack max(2, 5 %) = 11
    assert sum(load) == 900 and max(load) <= fair + 11 and ticks < 30, (load, ticks)
    assert min(load) >= 900 - 3 * (fair + 11)  # the newcomer took the rest


def test_metrics_targets_one_per_gateway_and_shard() -> None:
    groups = metrics_targets([("gw-a", "10.0.0.1:9410"), ("gw-b", "10.0.0.2:9410")], 3)
    assert len(groups) == 6
    assert groups[4] == {
        "targets": ["10.0.0.2:9410"],
        "labels": {
            "__metrics_path__": "/metrics",
            "__scheme__": "http",
            "gateway": "gw-b",
            "__param_shard": "1",
            "__param_shards": "3",
            "shard": "1",
        },
    }
    whole = metrics_targets([("gw-a", "a:1")], 1, scheme="https")  # no parameters: fast path
    assert whole == [
        {
            "targets": ["a:1"],
            "labels": {"__metrics_path__": "/metrics", "__scheme__": "https", "gateway": "gw-a"},
        }
    ]


async def test_a_single_gateway_lists_itself_per_shard() -> None:
    reg = Registry()
    state = HttpState(registry=reg, exposition=Exposition(reg), tokens=frozenset({"t0ken"}))
    auth = {"Authorization": "Bearer t0ken"}
    async with TestClient(TestServer(make_app(state))) as client:
        assert (await client.get("/api/v1/sd/metrics")).status == 401  # sd's protection
        groups = await (await client.get("/api/v1/sd/metrics?shards=4", headers=auth)).json()
        host = f"{client.server.host}:{client.server.port}"
        assert [g["targets"] for g in groups] == [[host]] * 4
        assert [g["labels"]["__param_shard"] for g in groups] == ["0", "1", "2", "3"]
        one = await (await client.get("/api/v1/sd/metrics", headers=auth)).json()
        assert len(one) == 1 and "__param_shard" not in one[0]["labels"]
        bad = await client.get("/api/v1/sd/metrics?shards=0", headers=auth)
        assert bad.status == 400 and "shards" in (await bad.json())["error"]
        body = await client.get(f"/metrics?{_params(groups[3])}")
        assert body.status == 200


def _params(group: dict[str, dict[str, str]]) -> str:
    labels = group["labels"]
    return f"shard={labels['__param_shard']}&shards={labels['__param_shards']}"


def test_promtool_accepts_a_scrape_config_on_it(tmp_path: Path, promtool: Path) -> None:
    (tmp_path / "token").write_text("t0ken\n")
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "scrape_configs:\n"
        "  - job_name: gpurelay\n"
        "    http_sd_configs:\n"
        "      - url: http://gateway.example:9410/api/v1/sd/metrics?shards=4\n"
        "        refresh_interval: 30s\n"
        "        authorization: {type: Bearer, credentials_file: token}\n"
    )
    proc = subprocess.run(
        [str(promtool), "check", "config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_gateways_table() -> None:
    table = render_table(
        [
            {"id": "gw-a", "advertise": "10.0.0.1:9411", "alive": True, "this": True,
             "heartbeat_age_seconds": 0.42, "up_seconds": 7300.0, "nodes": 12},
            {"id": "gw-b", "advertise": "10.0.0.2:9411", "alive": False, "this": False,
             "heartbeat_age_seconds": 95.0, "up_seconds": 60.0, "nodes": 3},
        ]
    )  # fmt: skip
    lines = table.splitlines()
    assert lines[0].split() == ["GATEWAY", "ALIVE", "HEARTBEAT", "AGE", "NODES", "UP", "ADVERTISE"]
    assert lines[1].split() == ["gw-a", "(this)", "yes", "0.4s", "12", "2.0h", "10.0.0.1:9411"]
    # a dead gateway holds no node (an older gateway's API still counts its last ones)
    assert lines[2].split() == ["gw-b", "no", "95.0s", "-", "60.0s", "10.0.0.2:9411"]


async def test_gateways_command_against_a_gateway(capsys: pytest.CaptureFixture[str]) -> None:
    reg = Registry()
    state = HttpState(registry=reg, exposition=Exposition(reg), tokens=frozenset({"t0ken"}))
    async with TestClient(TestServer(make_app(state))) as client:
        url = str(client.make_url("/"))
        # the CLI is synchronous (httpx): run it in a thread while the server runs here
        import asyncio

        code = await asyncio.to_thread(main, ["gateways", "--gateway", url, "--token", "t0ken"])
        assert code == 0
        assert capsys.readouterr().out.splitlines()[1].split()[:3] == ["(this)", "yes", "0.0s"]
        code = await asyncio.to_thread(
            main, ["gateways", "--gateway", url, "--token", "t0ken", "--json"]
        )
        assert code == 0 and json.loads(capsys.readouterr().out)["gateways"][0]["this"]
        code = await asyncio.to_thread(main, ["gateways", "--gateway", url])
        assert code == 1 and "no token given" in capsys.readouterr().err


def test_a_gateway_above_its_share_sheds_after_two_heartbeats_in_a_row() -> None:
    from types import SimpleNamespace

    from cloud_gateway.cluster.membership import Cluster
    from cloud_gateway.cluster.store_pg import Member

    shed: list[list[str]] = []
    directory = SimpleNamespace(gateway="gw-a", on_claim=None)
    cluster = Cluster(
        directory,  # type: ignore[arg-type]
        advertise="127.0.0.1:1",
        heartbeat_seconds=1.0,
        ttl_seconds=5.0,
        on_lost=lambda node, owner: None,
        on_fenced=lambda reason: None,
        on_shed=shed.append,
    )
    cluster.owned = {f"edge-{i:03d}": 1 for i in range(100)}
    cluster.members = [Member("gw-a", "a:1", 0.1, 100, 60.0), Member("gw-b", "b:1", 0.1, 0, 1.0)]
    cluster._shed()
    assert shed == []  # once could be gw-b's count lagging a heartbeat
    cluster._shed()
    assert shed == [["edge-000", "edge-001"]]  # 2 per second, the longest held first
    cluster.members[1] = Member("gw-b", "b:1", 9.0, 0, 1.0)  # gw-b is dead: nobody to shed to
    cluster._shed()
    cluster._shed()
    assert len(shed) == 1
