"""GET /metrics of our gateway against a stock Prometheus Pushgateway holding the same
series, in one run.

1,000 simulated 8-GPU nodes (harness/pipeline, no processes: the dcgm series only, as
bench/gateway_render.py names and values them per node). Our gateway gets them as agents
send them (Declare and a full Batch per node) and serves them over HTTP with its own
handler (bench/render_http.Server); the Debian ``prometheus-pushgateway`` gets the very
same lines (same names, labels with the node's Hostname, values) by one PUT per node on
``/metrics/job/gpurelay/Hostname/<node>`` (it adds ``job`` and ``instance``, and its
push_time series). Our GETs follow new data (every node's steady batch applied first);
the Pushgateway's GET cost does not depend on what changed.

Run: .venv/bin/python bench/pushgateway_vs_gateway.py [--nodes 1000]
Needs: apt-get install prometheus-pushgateway
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import http.client
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gateway_render import GPUS, Fleet, nudge
from bench.render_http import Server, get
from cloud_gateway.exposition.body import Exposition
from cloud_gateway.registry.store import Registry, stamp_node
from gpurelay.exposition import format_labels, format_value, text_header
from gpurelay.model import Snapshot
from harness.pipeline import make_pipeline

PREFIX = "DCGM_FI_"


def dcgm_snapshots() -> tuple[Snapshot, Snapshot]:
    with tempfile.TemporaryDirectory() as tmp:
        pipeline, _sim, clock = make_pipeline(Path(tmp), gpus=GPUS, processes_per_gpu=0)
        try:
            first = pipeline.collection.collect()
            clock.advance(10.0)
            second = pipeline.collection.collect()
        finally:
            pipeline.close()
    keys = {(s.name, s.labels) for s in first.samples if s.name.startswith(PREFIX)}

    def only(snap: Snapshot) -> Snapshot:
        return dataclasses.replace(
            snap,
            families=tuple(f for f in snap.families if f.name.startswith(PREFIX)),
            samples=tuple(s for s in snap.samples if (s.name, s.labels) in keys),
        )

    return only(first), only(second)


def node_text(fleet: Fleet, i: int, node: str) -> bytes:
    """The node's series exactly as our gateway exposes them after its first batch."""
    snap = fleet.snaps[0]
    fams = {f.name: f for f in snap.families}
    out: dict[str, list[str]] = {}
    for s, labels in zip(snap.samples, fleet.labels[node], strict=True):
        line = (
            f"{s.name}{format_labels(stamp_node(labels, node))} {format_value(nudge(s.value, i))}\n"
        )
        out.setdefault(s.name, []).append(line)
    return "".join(text_header(n, fams[n]) + "".join(lines) for n, lines in out.items()).encode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_pushgateway(port: int) -> subprocess.Popen[bytes]:
    binary = shutil.which("prometheus-pushgateway") or shutil.which("pushgateway")
    if binary is None:
        sys.exit("needs prometheus-pushgateway (apt-get install prometheus-pushgateway)")
    proc = subprocess.Popen(
        [
            binary,
            f"--web.listen-address=127.0.0.1:{port}",
            "--persistence.file=",
            "--push.disable-consistency-check",  # setup speed only; GET is unaffected
            "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/-/ready")
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    sys.exit("pushgateway did not become ready")


def series(body: bytes) -> int:
    return sum(1 for line in body.split(b"\n") if line.startswith(PREFIX.encode()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]} on {os.uname().machine}, {os.cpu_count()} CPUs")
    reg = Registry()
    fleet = Fleet(reg, dcgm_snapshots(), args.nodes)
    fleet.connect_all()
    expo = Exposition(reg)
    per_node = len(fleet.snaps[0].samples)
    print(f"{args.nodes} nodes x {per_node} dcgm series ({GPUS} GPUs each)")

    port = free_port()
    pgw = start_pushgateway(port)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        start = time.perf_counter()
        for i, node in enumerate(fleet.names):
            conn.request(
                "PUT",
                f"/metrics/job/gpurelay/Hostname/{node}",
                body=node_text(fleet, i, node),
                headers={"Content-Type": "text/plain; version=0.0.4"},
            )
            resp = conn.getresponse()
            resp.read()
            assert resp.status in (200, 202), resp.status
        print(f"pushgateway: {args.nodes} PUTs in {time.perf_counter() - start:.1f} s")
        server = Server(expo)
        ours = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        batches = [fleet.steady_batches(False), fleet.steady_batches(True)]
        # (1) every node's batch applied just before the GET: the worst case, all the
        # changed blocks are rendered by the GET; (2) the same batches applied before the
        # gateway's tick, which rendered them ahead of the scrape it expected (what a
        # scrape at its period sees when the batches came before the last tick)
        for ahead in (False, True, None):  # None: (3) no new data, the transfer's floor
            for gz in (False, True):
                pg_times, our_times, tick_times = [], [], []
                for rep in range(args.reps + 1):
                    ms, pg_body = get(conn, gz, ours=False)
                    pg_times.append(ms)

                    async def new_data(
                        rep: int = rep, ahead: bool | None = ahead, ticks: list[float] = tick_times
                    ) -> None:
                        if ahead is not None:
                            fleet.apply(batches[rep % 2], time.time())
                        if ahead:
                            start = time.perf_counter()
                            assert await expo.prepare(time.monotonic(), within=math.inf)
                            ticks.append((time.perf_counter() - start) * 1000)

                    server.call(new_data)
                    ms, our_body = get(ours, gz)
                    our_times.append(ms)
                if gz:
                    pg_body, our_body = gzip.decompress(pg_body), gzip.decompress(our_body)
                assert series(pg_body) == series(our_body) == args.nodes * per_node, (
                    series(pg_body),
                    series(our_body),
                )
                pg, us = statistics.median(pg_times[1:]), statistics.median(our_times[1:])
                kind = "gzip" if gz else "identity"
                when = {
                    False: "right after new data",
                    True: "after the tick rendered ahead",
                    None: "with no new data (floor)",
                }[ahead]
                print(
                    f"GET /metrics {kind:<8} ({len(our_body) / 1e6:.1f} MB ours, "
                    f"{len(pg_body) / 1e6:.1f} MB pushgateway): ours {when} {us:.1f} ms, "
                    f"pushgateway {pg:.1f} ms: {pg / us:.1f}x  target >= 50x"
                )
                if ahead:
                    print(
                        f"    the tick's render ahead (on the loop, in 20 ms slices): "
                        f"{statistics.median(tick_times[1:]):.1f} ms"
                    )
        ours.close()
        server.close()
    finally:
        pgw.terminate()
        pgw.wait(10)


if __name__ == "__main__":
    main()
