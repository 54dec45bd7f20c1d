"""Hostile unauthenticated HTTP clients against the gateway (issue 12).

Whatever paths and inputs arrive, the gateway's own label sets stay fixed; idle and
slow connections can neither hold the HTTP listener nor keep ``/metrics``, ``/healthz``
or an SSH login out. Counts are bounded (a few thousand requests, a few hundred sockets)
and every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import random
import string
import time
from collections import defaultdict
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from cloud_gateway.app import Gateway
from cloud_gateway.config import GatewayConfig
from gpurelay.wire import Declare, Hello, SeriesDecl
from harness.fleet import (
    agent_config,
    gateway_config,
    make_pki,
    metrics_text,
    running_agent,
    running_gateway,
)
from harness.waiting import wait_for

ROUTES = {
    "/metrics",
    "/v1/collect",
    "/api/v1/nodes",
    "/api/v1/nodes/{node}",
    "/api/v1/sd",
    "/healthz",
    "/health",
    "/readyz",
    "/openapi.json",
    "/proxy/{node}/{port}/{path}",
    "proxy",
    "other",
}
# Every gpurelay_gateway_* label holds at most this many values, whatever clients send.
MAX_VALUES = 40


def label_values(text: str) -> dict[tuple[str, str], set[str]]:
    """(family, label) -> the values it has in a /metrics body; ``le`` left out."""
    found: dict[tuple[str, str], set[str]] = defaultdict(set)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for label, value in sample.labels.items():
                if label != "le":
                    found[(family.name, label)].add(value)
    return found


def word(rng: random.Random) -> str:
    return "".join(rng.choices(string.ascii_lowercase + string.digits, k=rng.randint(3, 12)))


def hostile_paths(rng: random.Random, count: int) -> list[str]:
    shapes = (
        "/{w}",
        "/{w}/{w2}",
        "/api/{w}",
        "/api/v1/nodes/{w}",
        "/proxy/{w}/9400/{w2}",
        "/metrics{w}",
        "/.{w}%2F..",
    )
    return [rng.choice(shapes).format(w=word(rng), w2=word(rng)) for _ in range(count)]


def hostile_declare(count: int) -> Declare:
    """Series a node may not publish, each refused with a message naming it."""
    series = []
    decl = functools.partial(SeriesDecl, type="gauge", help="", labels=())
    for i in range(count):
        kind = i % 4
        if kind == 0:  # the gateway's own namespace
            series.append(decl(id=i, name=f"gpurelay_gateway_x{i}"))
        elif kind == 1:  # one family, two types
            name = f"evil_family_{i}"
            series += [decl(id=i, name=name), decl(id=100_000 + i, name=name, type="counter")]
        elif kind == 2:  # an id declared twice
            series += [decl(id=i, name=f"evil_dup_{i}"), decl(id=i, name=f"evil_dup_b_{i}")]
        else:  # the same series under a second id
            labels = (("k", str(i)),)
            same = functools.partial(decl, name="evil_same", labels=labels)
            series += [same(id=i), same(id=200_000 + i)]
    return Declare(series=tuple(series))


async def test_random_paths_and_refused_series_leave_the_label_sets_fixed(
    tmp_path: Path,
) -> None:
    rng = random.Random(12)
    pki = make_pki(tmp_path)
    async with running_gateway(gateway_config(pki)) as gw:
        base = f"http://127.0.0.1:{gw.http_port}"
        async with httpx.AsyncClient(base_url=base, timeout=10) as client:
            for path in hostile_paths(rng, 2000):
                await client.get(path)
        async with httpx.AsyncClient(proxy=base, timeout=10) as via:  # forward-proxy form
            for _ in range(50):
                await via.get(f"http://{word(rng)}:9400/{word(rng)}")
        session = gw.ingest.open_session("evil", "127.0.0.1:1", lambda reason: None)
        session.handle(Hello(agent_version="0", node="evil"))
        session.handle(hostile_declare(500))
        gw._refresh()
        text = await metrics_text(gw)
    values = label_values(text)
    grown = {
        f"{family}{{{label}}}": len(v)
        for (family, label), v in values.items()
        if family.startswith("gpurelay_gateway_") and len(v) > MAX_VALUES
    }
    assert not grown, f"label values grew with client input: {grown}"
    assert values[("gpurelay_gateway_http_requests", "endpoint")] <= ROUTES
    assert "other" in values[("gpurelay_gateway_http_requests", "endpoint")]
    reasons = values[("gpurelay_gateway_rejected_series", "reason")]
    assert {"reserved_name", "type_conflict", "duplicate_id", "same_series"} <= reasons
    assert all(r.isidentifier() for r in reasons), reasons


def hostile(cfg: GatewayConfig, **http: float) -> GatewayConfig:
    return dataclasses.replace(cfg, http=dataclasses.replace(cfg.http, **http))


def open_http_connections(gw: Gateway) -> int:
    assert gw.runner is not None and gw.runner.server is not None
    return len(gw.runner.server.connections)


async def closed_by_peer(reader: asyncio.StreamReader) -> bool:
    """Reads to the end: True once the gateway closed (EOF or reset)."""
    with contextlib.suppress(ConnectionError):
        await reader.read()
    return True


async def test_idle_connections_neither_hold_the_listener_nor_keep_metrics_out(
    tmp_path: Path,
) -> None:
    pki = make_pki(tmp_path)
    cfg = hostile(
        gateway_config(pki), max_connections=100, header_timeout_seconds=1.0, idle_timeout_seconds=2
    )
    async with running_gateway(cfg) as gw:
        idle = [await asyncio.open_connection("127.0.0.1", gw.http_port) for _ in range(300)]
        try:
            await asyncio.sleep(0.2)  # let the gateway accept them all
            held = open_http_connections(gw)
            assert held <= 100, f"{held} idle connections held, the cap is 100"
            started = time.monotonic()
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.http_port}") as client:
                metrics = await client.get("/metrics", timeout=5)
                health = await client.get("/healthz", timeout=5)
            print(f"/metrics and /healthz answered in {time.monotonic() - started:.3f}s")
            assert metrics.status_code == 200 and health.text == "ok\n"
            async with running_agent(agent_config(pki, "edge-a", gw)):  # an SSH login
                await wait_for(lambda: gw.ingest.stats.batches >= 1, 15, "a batch over SSH")
            # Every idle socket is closed by the gateway: the header timeout or the cap.
            closed = await asyncio.wait_for(
                asyncio.gather(*(closed_by_peer(r) for r, _ in idle)), timeout=10
            )
            assert all(closed)
        finally:
            for _, writer in idle:
                writer.close()
        gw._refresh()
        text = await metrics_text(gw)
    values = {
        s.labels["reason"]: s.value
        for f in text_string_to_metric_families(text)
        if f.name == "gpurelay_gateway_http_connections_closed"
        for s in f.samples
    }
    assert values["header_timeout"] + values["evicted"] >= 300, values


async def test_slow_headers_and_idle_keepalive_are_closed(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    cfg = hostile(gateway_config(pki), header_timeout_seconds=1.0, idle_timeout_seconds=1.5)
    async with running_gateway(cfg) as gw:
        # Slowloris: a header line every 0.2 s, never the blank line that ends them.
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.http_port)
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        for _ in range(30):  # 6 s
            await asyncio.sleep(0.2)
            if writer.transport.is_closing() or reader.at_eof():
                break
            with contextlib.suppress(ConnectionError):
                writer.write(b"X-Slow: 1\r\n")
        assert await asyncio.wait_for(closed_by_peer(reader), timeout=0.5), (
            "slow headers kept the connection open"
        )
        writer.close()
        # Keep-alive: one answered request, then silence until the idle timeout.
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.http_port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        assert await reader.readexactly(3) == b"ok\n"
        assert await asyncio.wait_for(closed_by_peer(reader), timeout=5)
        writer.close()
