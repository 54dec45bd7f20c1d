"""Section (h) of bench/gateway_render.py: GET /metrics over real HTTP (the gateway's own
handler, aiohttp on loopback) with and without gzip, quiet and under ingest load.

The server and the ingest run on one event loop in a thread, as in the gateway; the
client (http.client) runs in the main thread and reads every byte. Under ingest, every
node's steady batch is applied once a second in slices of 20 ms, and the 1 s tick moves
the gateway's own counters and renders ahead of a scrape it expects (as the gateway's
tick: Exposition.prepare); GETs come back to back, then at a period.
"""

from __future__ import annotations

import asyncio
import gzip
import http.client
import itertools
import statistics
import threading
import time
import zlib
from collections.abc import Callable, Coroutine
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

from aiohttp import web

from cloud_gateway.exposition.body import Exposition
from cloud_gateway.http.api import STATE, metrics
from gpurelay.model import Family, Sample

if TYPE_CHECKING:
    from bench.gateway_render import Fleet

SLICE_S = 0.02
PERIOD_S = 2.5  # of the periodic scraper
SCRAPES = 8
OWN = Family(name="gpurelay_gateway_batches_total", type="counter", help="Batches.")


class Server:
    def __init__(self, expo: Exposition) -> None:
        self.loop = asyncio.new_event_loop()
        self.expo = expo
        self.port = 0
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait()

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app[STATE] = cast(Any, SimpleNamespace(exposition=self.expo))
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app, access_log=None)
        self.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = runner.addresses[0][1]
        ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(runner.cleanup())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)

    def call(self, fn: Callable[[], Coroutine[Any, Any, object]]) -> object:
        return asyncio.run_coroutine_threadsafe(fn(), self.loop).result()


def get(conn: http.client.HTTPConnection, gz: bool, *, ours: bool = True) -> tuple[float, bytes]:
    """One GET, every byte read; ours must send Content-Length and Content-Encoding."""
    start = time.perf_counter()
    conn.request("GET", "/metrics", headers={"Accept-Encoding": "gzip" if gz else "identity"})
    resp = conn.getresponse()
    data = resp.read()
    ms = (time.perf_counter() - start) * 1000
    assert resp.status == 200
    if ours:
        assert int(resp.headers["Content-Length"]) == len(data)
        assert (resp.headers.get("Content-Encoding") == "gzip") == gz
    return ms, data


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def over_http(fleet: Fleet, expo: Exposition, seconds: float) -> None:
    server = Server(expo)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    batches = [fleet.steady_batches(False), fleet.steady_batches(True)]
    flips, ticks = itertools.count(), itertools.count()

    async def new_data() -> None:
        fleet.apply(batches[next(flips) % 2], time.time())
        expo.set_extra([(OWN, [Sample(OWN.name, (), float(next(ticks)))])])

    async def tick_only() -> None:
        expo.set_extra([(OWN, [Sample(OWN.name, (), float(next(ticks)))])])

    async def nothing() -> None:
        pass

    server.call(nothing)
    _, packed = get(conn, True)
    _, plain = get(conn, False)
    one = zlib.decompressobj(zlib.MAX_WBITS | 16)  # one member, as httpx and curl read
    assert one.decompress(packed) == plain and one.eof and not one.unused_data
    assert gzip.decompress(packed) == plain
    print(
        f"(h) over HTTP: identity {len(plain) / 1e6:.1f} MB, gzip {len(packed) / 1e6:.1f} MB "
        "(one gzip member, decompressed == identity body)"
    )
    medians = {}
    for label, before in (("after new data", new_data), ("no new data, tick", tick_only)):
        for gz in (False, True):
            times = []
            for _ in range(7):
                server.call(before)
                times.append(get(conn, gz)[0])
            kind = "gzip" if gz else "identity"
            medians[label, gz] = ms = statistics.median(times[2:])
            print(f"(h) GET {label}, {kind:<8} median {ms:8.1f} ms  (5 after 2 warm-up)")
    ratio = medians["after new data", True] / medians["after new data", False]
    print(f"    gzip / identity after new data = {ratio:.2f}  target <= 1.5")

    stop = threading.Event()

    async def ingest() -> None:
        per_slice = max(1, round(len(fleet.names) * SLICE_S))
        next_tick = time.monotonic() + 1.0
        while not stop.is_set():
            chunk = batches[next(flips) % 2]
            for i in range(0, len(chunk), per_slice):
                fleet.apply(chunk[i : i + per_slice], time.time())
                if time.monotonic() >= next_tick:  # the gateway's tick
                    await tick_only()
                    await expo.prepare(time.monotonic())  # renders ahead of a due scrape
                    next_tick += 1.0
                await asyncio.sleep(SLICE_S)
                if stop.is_set():
                    return

    task = asyncio.run_coroutine_threadsafe(ingest(), server.loop)
    for gz in (False, True):
        times = []
        end = time.monotonic() + seconds / 2
        while time.monotonic() < end:
            times.append(get(conn, gz)[0])
        med, p95 = statistics.median(times), pct(times, 0.95)
        kind = "gzip" if gz else "identity"
        print(
            f"(h) GET under ingest ({len(fleet.names)} batches/s), {kind:<8} {len(times)} GETs: "
            f"median {med:.1f} ms, p95 {p95:.1f} ms, max {max(times):.1f} ms; "
            f"p95/median = {p95 / med:.2f}  target <= 2"
        )
    for gz in (False, True):  # a scraper at a period, as Prometheus: the tick renders ahead
        times, prepared = [], expo.prepared
        start = time.monotonic()
        for k in range(1, SCRAPES + 1):
            time.sleep(max(0.0, start + k * PERIOD_S - time.monotonic()))
            times.append(get(conn, gz)[0])
        med, p95 = statistics.median(times[2:]), pct(times[2:], 0.95)
        kind = "gzip" if gz else "identity"
        print(
            f"(h) GET every {PERIOD_S:g} s under ingest, {kind:<8} {SCRAPES - 2} GETs after 2: "
            f"median {med:.1f} ms, p95 {p95:.1f} ms; the tick rendered ahead "
            f"{expo.prepared - prepared} times"
        )
    stop.set()
    task.result()
    conn.close()
    server.close()
