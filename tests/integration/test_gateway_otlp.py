"""OTLP from the gateway over real asyncssh on loopback: a real agent, a real gateway with
``[otlp]`` beside ``[remote_write]``, and two receivers written here (aiohttp). Every OTLP
request is decoded with the official opentelemetry-proto package; each figure must be
what the remote write receiver got for the same sample (the DCGM names), and the
``hw.*`` conventions must be those figures in their units. While the OTLP receiver
answers 503 the agent's batches stay unacknowledged, though remote write took them."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import cramjam
from aiohttp import web
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)

from cloud_gateway.remote_write.config import OtlpConfig, RemoteWriteConfig
from edge_agent.config import SpoolConfig
from harness.fleet import agent_config, gateway_config, make_pki, running_agent, running_gateway
from harness.waiting import wait_for
from tests.unit.gateway.remote_write.test_prompb import decode_write_request

NODE = "edge-otlp"
Point = tuple[str, tuple[tuple[str, str], ...], int]  # name, labels less the node, ms


class Receivers:
    def __init__(self) -> None:
        self.otlp_status = 200
        self.otlp: dict[Point, float] = {}  # every data point, by name, attributes, time
        self.hosts: set[str] = set()
        self.refused = 0
        self.rw: dict[Point, float] = {}

    async def otlp_post(self, request: web.Request) -> web.Response:
        assert request.headers["Content-Type"] == "application/x-protobuf"
        body = await request.read()
        if self.otlp_status >= 300:
            self.refused += 1
            return web.Response(status=self.otlp_status, text="busy")
        message = ExportMetricsServiceRequest()
        message.ParseFromString(body)
        for rm in message.resource_metrics:
            resource = {a.key: a.value.string_value for a in rm.resource.attributes}
            self.hosts.add(resource["host.name"])
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    data = getattr(metric, metric.WhichOneof("data"))
                    for p in data.data_points:
                        attrs = tuple(sorted((a.key, a.value.string_value) for a in p.attributes))
                        key = (metric.name, attrs, p.time_unix_nano // 1_000_000)
                        self.otlp[key] = p.as_double
        return web.Response(status=self.otlp_status)

    async def rw_post(self, request: web.Request) -> web.Response:
        body = bytes(cramjam.snappy.decompress_raw(await request.read()))
        for labels, points in decode_write_request(body):
            d = dict(labels)
            name = d.pop("__name__")
            d.pop("Hostname", None)
            for ts, value in points:
                self.rw[(name, tuple(sorted(d.items())), ts)] = value
        return web.Response(status=204)


@asynccontextmanager
async def receivers() -> AsyncIterator[tuple[Receivers, str, str]]:
    r = Receivers()
    app = web.Application()
    app.router.add_post("/v1/metrics", r.otlp_post)
    app.router.add_post("/api/v1/write", r.rw_post)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield r, f"http://127.0.0.1:{port}/v1/metrics", f"http://127.0.0.1:{port}/api/v1/write"
    finally:
        await runner.cleanup()


async def test_every_figure_reaches_the_otlp_receiver_as_remote_write_got_it(
    tmp_path: Path,
) -> None:
    pki = make_pki(tmp_path)
    async with receivers() as (r, otlp_url, rw_url):
        cfg = dataclasses.replace(
            gateway_config(pki),
            remote_write=RemoteWriteConfig(
                url=rw_url, min_backoff_seconds=0.01, max_backoff_seconds=0.05
            ),
            otlp=OtlpConfig(url=otlp_url),
        )
        async with running_gateway(cfg) as gw:
            acfg = dataclasses.replace(
                agent_config(pki, NODE, gw, gpus=2),
                spool=SpoolConfig(directory=tmp_path / "spool"),
            )
            async with running_agent(acfg) as agent:
                assert agent.tunnel is not None
                await wait_for(lambda: agent.tunnel.stats.acked_seq >= 3)  # type: ignore[union-attr]
                r.otlp_status = 503  # OTLP busy: nothing acknowledged, remote write or not
                acked = agent.tunnel.stats.acked_seq
                await wait_for(lambda: r.refused >= 3, what="OTLP refusals")
                assert agent.tunnel.stats.acked_seq <= acked + 1  # one may have been in flight
                r.otlp_status = 200
                await wait_for(
                    lambda: agent.tunnel.stats.acked_seq > acked + 3,  # type: ignore[union-attr]
                    what="the backlog acknowledged once OTLP took it",
                )
    assert r.hosts == {NODE}
    dcgm = {k: v for k, v in r.otlp.items() if k[0].startswith(("DCGM_", "gpurelay_"))}
    assert len(dcgm) > 100
    # every DCGM figure is what remote write got for the same series and instant
    missing = [k for k in dcgm if k not in r.rw]
    assert not missing, missing[:5]
    wrong = [(k, v, r.rw[k]) for k, v in dcgm.items() if v != r.rw[k] and v == v]
    assert not wrong, wrong[:5]
    # and the hw.* conventions are those figures in their units
    checked = 0
    for (name, labels, ts), value in r.rw.items():
        d = dict(labels)
        if name == "DCGM_FI_DEV_GPU_UTIL" and not d.get("GPU_I_ID"):
            hw = [
                v
                for (n, attrs, t), v in r.otlp.items()
                if n == "hw.gpu.utilization"
                and t == ts
                and ("hw.id", d["UUID"]) in attrs
                and ("hw.gpu.task", "general") in attrs
            ]
            assert hw == [value / 100], (d["UUID"], ts, hw, value)
            checked += 1
    assert checked >= 6
    assert gw.otlp is not None and gw.otlp.stats.retried_requests == r.refused
