"""The third-party pieces a gateway cluster runs with, driven the way the cluster tests
drive them: haproxy in TCP mode in front of listeners, VictoriaMetrics receiving our
remote write. These pin down the harness (and VictoriaMetrics' view of duplicates) before
the cluster tests rely on it."""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from cloud_gateway.remote_write.prompb import encode_write_request, snappy_compress
from harness.haproxy import Haproxy
from harness.victoria import VictoriaMetrics
from harness.waiting import wait_until


class _Named(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        self.request.sendall(self.server.name)  # type: ignore[attr-defined]
        time.sleep(0.3)  # stay connected a little, so leastconn sees the load


def _server(name: bytes) -> socketserver.ThreadingTCPServer:
    srv = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Named)
    srv.daemon_threads = True
    srv.name = name  # type: ignore[attr-defined]
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def _who(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        return s.recv(16)


@pytest.fixture
def servers() -> Iterator[list[socketserver.ThreadingTCPServer]]:
    srvs = [_server(b"a"), _server(b"b"), _server(b"d")]
    yield srvs
    for s in srvs:
        s.shutdown()
        s.server_close()


def test_haproxy_spreads_connections_and_takes_a_new_backend_at_run_time(
    haproxy_bin: Path, tmp_path: Path, servers: list[socketserver.ThreadingTCPServer]
) -> None:
    a, b, d = (s.server_address[1] for s in servers)
    lb = Haproxy(tmp_path, [("gw-a", a), ("gw-b", b)], spare=["gw-d"], binary=haproxy_bin)
    lb.start()
    try:
        seen = {_who(lb.port) for _ in range(8)}
        assert seen == {b"a", b"b"}
        lb.add("gw-d", d)
        wait_until(lambda: b"d" in {_who(lb.port) for _ in range(6)}, timeout=10, what="gw-d used")
        assert set(lb.sessions()) == {"gw-a", "gw-b", "gw-d"}
    finally:
        lb.stop()


@pytest.mark.parametrize("dedup", [None, "1ms"], ids=["raw", "dedup-1ms"])
def test_victoria_metrics_keeps_every_sample_we_write_and_shows_a_duplicate(
    victoria_bin: Path, tmp_path: Path, dedup: str | None
) -> None:
    """Without -dedup.minScrapeInterval the same sample written twice is stored and
    exported twice; with 1ms (what the operator guide says to run) once, and distinct
    samples a second apart all stay."""
    vm = VictoriaMetrics(tmp_path, binary=victoria_bin, dedup=dedup)
    vm.start()
    try:
        now_ms = int(time.time() * 1000) // 1000 * 1000
        labels = (("__name__", "DCGM_FI_DEV_GPU_UTIL"), ("Hostname", "edge-1"), ("gpu", "0"))
        samples = [(now_ms - 1000 * k, float(k)) for k in range(5)]
        body = snappy_compress(encode_write_request([(labels, samples)]))
        headers = {
            "Content-Encoding": "snappy",
            "Content-Type": "application/x-protobuf",
            "X-Prometheus-Remote-Write-Version": "0.1.0",
        }
        r = httpx.post(vm.write_url, content=body, headers=headers, timeout=10)
        assert r.status_code == 204, r.text
        vm.flush()
        [(series, got)] = vm.export('{__name__="DCGM_FI_DEV_GPU_UTIL"}').items()
        assert series == '{Hostname="edge-1",__name__="DCGM_FI_DEV_GPU_UTIL",gpu="0"}'
        assert got == sorted(samples)
        one = snappy_compress(encode_write_request([(labels, samples[:1])]))
        assert httpx.post(vm.write_url, content=one, headers=headers, timeout=10).is_success
        vm.flush()
        [got] = vm.export('{__name__="DCGM_FI_DEV_GPU_UTIL"}').values()
        if dedup is None:  # a duplicate check through the export API can fail
            assert len(got) == 6 and got.count(samples[0]) == 2
        else:
            assert got == sorted(samples)
    finally:
        vm.stop()
