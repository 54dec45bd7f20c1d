"""Write the seed corpus of every fuzz target: real streams, records and responses.

``python fuzz/seeds.py OUT_DIR`` writes ``OUT_DIR/<target>/<name>`` (a few dozen files,
a few hundred kB in all; generated, never committed). The frames are what an agent sends
for a simulated node (HELLO, DECLARE, BATCH, REPLAY) and what a gateway answers (ACK,
ACK_RANGES, HEARTBEAT, ERROR, GOODBYE), each stream raw and in the plain form of
``common.py``, under a few chunkings; the records are those collections' records; the
responses are what exporters answer (Content-Length, chunked, close-delimited, interim
1xx, keep-alive pairs); the requests are what clients send the agent's HTTP server.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import sys
import zlib
from pathlib import Path

from common import PLAIN, SMALL, wire_to_plain

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # harness/, as bench/ does

from edge_agent.encode import SnapshotEncoder
from gpurelay.model import Snapshot
from gpurelay.record import MAGIC, RecordEncoder
from gpurelay.wire import (
    Ack,
    AckRanges,
    ErrorFrame,
    FrameEncoder,
    Goodbye,
    Heartbeat,
    Hello,
    Replay,
)
from harness.pipeline import simulated_snapshots

CONTROLS = (0x00, 0x05, 0x21)  # one chunk; two chunkings


def agent_stream(snapshots: list[Snapshot]) -> bytes:
    frames, snapshot_encoder, records = FrameEncoder(), SnapshotEncoder(), RecordEncoder()
    out = [
        frames.encode(
            Hello(
                agent_version="0.1.0",
                node="fuzz-node",
                backend="simulated",
                heartbeat_seconds=3.0,
                ack_delay_seconds=3.0,
            )
        )
    ]
    for i, snapshot in enumerate(snapshots):
        out += [frames.encode(f) for f in snapshot_encoder.frames(snapshot)]
        out.append(frames.encode(Replay(seq=100 + i, record=records.encode(snapshot))))
    return b"".join(out)


def gateway_stream() -> bytes:
    frames = FrameEncoder()
    return b"".join(
        frames.encode(f)
        for f in (
            Ack(seq=1),
            Ack(seq=2**40),
            Heartbeat(received=0),
            Heartbeat(received=2**40),
            AckRanges(ranges=((1_790_000_000_000, 1_790_000_000_003),)),
            AckRanges(ranges=((0, 0), (2, 5), (2**40, 2**40 + 7), (2**63 - 1, 2**63 - 1))),
            ErrorFrame(code="unknown_series", message="BATCH seq 3 refers to series 9"),
            Goodbye(reason="shutting down"),
        )
    )


def frame_seeds(small: list[Snapshot], large: list[Snapshot]) -> dict[str, bytes]:
    streams = {
        "small": agent_stream(small),
        "one": agent_stream(small[:1]),
        "large": agent_stream(large),
        "gateway": gateway_stream(),
    }
    seeds: dict[str, bytes] = {}
    for name, wire in streams.items():
        plain = wire_to_plain(wire)
        for control in CONTROLS:
            seeds[f"{name}-raw-{control:02x}"] = bytes([control]) + wire
            seeds[f"{name}-plain-{control:02x}"] = bytes([control | PLAIN]) + plain
        seeds[f"{name}-plain-small"] = bytes([PLAIN | SMALL]) + plain
    return seeds


def record_seeds(small: list[Snapshot], large: list[Snapshot]) -> dict[str, bytes]:
    seeds: dict[str, bytes] = {}
    encoder = RecordEncoder()
    for name, snapshot in (("small", small[0]), ("large", large[0])):
        record = encoder.encode(snapshot)
        body = zlib.decompress(record[len(MAGIC) :])
        seeds[f"{name}-raw"] = b"\x00" + record
        seeds[f"{name}-plain"] = bytes([PLAIN]) + body
        seeds[f"{name}-plain-small"] = bytes([PLAIN | SMALL]) + body
    seeds["empty-plain"] = bytes([PLAIN]) + struct.pack(">qI", 1_790_000_000_000, 2) + b"[]"
    return seeds


METRICS = b'# HELP up Up.\n# TYPE up gauge\nup 1\nDCGM_FI_DEV_GPU_UTIL{gpu="0"} 42\n'
RESPONSES = {
    "length": b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
    b"Content-Length: %d\r\n\r\n" % len(METRICS) + METRICS,
    "chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"%x\r\n" % len(METRICS) + METRICS + b"\r\n0\r\nX-Trailer: 1\r\n\r\n",
    "close": b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n" + METRICS,
    "interim": b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
    b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\nabc",
    "keepalive": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokHTTP/1.1 204 No Content\r\n\r\n"
    b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
    "error": b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\n"
    b"Content-Encoding: gzip\r\nVary: Accept-Encoding\r\n\r\nnope",
    "notmodified": b'HTTP/1.1 304 Not Modified\r\nETag: "x"\r\n\r\n',
}
TARGETS = {
    "metrics": "/metrics",
    "query": "/metrics?name[]=up&x=%20y",
    "decoded": "/a b/ü?q=1 2&r=\r\n#frag",
    "relative": "stats?",
    "percent": "/%zz%4?%%41",
    "escaped": "/\udcff\udc80?\udce9",
}


def proxy_seeds() -> dict[str, bytes]:
    seeds: dict[str, bytes] = {}
    for name, response in RESPONSES.items():
        seeds[f"response-{name}"] = b"\x00" + response
        seeds[f"response-{name}-chunks"] = b"\x07" + response
        seeds[f"response-{name}-head"] = b"\x40" + response
    for name, text in TARGETS.items():
        seeds[f"target-{name}"] = b"\x80" + text.encode("utf-8", "surrogateescape")
    return seeds


REQUESTS = {
    "get": b"GET /metrics HTTP/1.1\r\nHost: edge:9400\r\nAccept-Encoding: gzip\r\n"
    b"Authorization: Basic cHJvbTpzZWNyZXQ=\r\n\r\n",
    "pipelined": b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\nHEAD /metrics?x=1 HTTP/1.1\r\n"
    b"Host: x\r\n\r\nPOST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi"
    b"GET http://edge:9400/healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    "http10": b"GET /healthz HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
    "chunked": b"GET /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"2\r\nhi\r\n0\r\n\r\n",
    "percent": b"GET /%ff%2e/%41?%zz HTTP/1.1\r\nHost: x\r\n\r\n",
    "folded": b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-A: a\r\n b\r\n\r\n",
}


def agent_http_seeds() -> dict[str, bytes]:
    seeds: dict[str, bytes] = {}
    for name, request in REQUESTS.items():
        seeds[f"request-{name}"] = b"\x00" + request
        seeds[f"request-{name}-chunks"] = b"\x07" + request
    return seeds


def write(out: Path) -> dict[str, int]:
    """Write every target's seeds under ``out``; their count by target."""
    logging.disable(logging.WARNING)  # the simulator's notes on fields it skips
    small = simulated_snapshots(gpus=1, processes_per_gpu=1, count=3)
    large = simulated_snapshots(gpus=2, processes_per_gpu=2, count=2)
    frames = frame_seeds(small, large)
    corpora = {
        "frames": frames,
        "ingest": frames,
        "records": record_seeds(small, large),
        "proxy_http": proxy_seeds(),
        "agent_http": agent_http_seeds(),
    }
    for target, seeds in corpora.items():
        folder = out / target
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in seeds.items():
            digest = hashlib.sha1(data).hexdigest()[:8]
            (folder / f"seed-{name}-{digest}").write_bytes(data)
    return {target: len(seeds) for target, seeds in corpora.items()}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} OUT_DIR")
    for target, count in write(Path(sys.argv[1])).items():
        print(f"{target}: {count} seeds")
