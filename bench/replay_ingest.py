"""Gateway CPU per replayed batch: REPLAY record decode, remote write samples, encode.

Setup: ``--count`` collections of one simulated 8-GPU node (processes attributed, the
collector's real timer), each made into a spool record by the agent's
:class:`gpurelay.record.RecordEncoder`, as an agent replays them after an outage. The
gateway side runs in this process, warm (every stage has seen the node's series once):

1. decode   ``RecordDecoder.decode`` (zlib inflate, JSON header, values, series checks)
2. samples  the remote write key of every series (name + labels stamped with the node)
3. encode   ``as_series`` + ``encode_requests`` (requests of ``max_samples_per_send``,
            protobuf, snappy), as ``RemoteWriter.send`` does, one record at a time
4. e2e      ``NodeSession.handle(Replay)`` for every record with remote write on, the
            forwarder coalescing up to 10,000 samples per send, a receiver that answers
            204 through ``httpx.MockTransport`` (no socket), until every seq is
            acknowledged: process CPU time / records.

The garbage collector is set up as ``cloud_gateway.app.serve`` does (freeze, threshold
50,000), so its cost is counted as in the gateway.

Run: .venv/bin/python bench/replay_ingest.py [--count 60] [--gpus 8] [--processes-per-gpu 8]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cloud_gateway.ingest.delivery import Delivery, DeliverySettings
from cloud_gateway.ingest.session import Ingest
from cloud_gateway.registry.store import Registry
from cloud_gateway.remote_write.client import RemoteWriter
from cloud_gateway.remote_write.config import RemoteWriteConfig
from cloud_gateway.remote_write.forwarder import QueuedCollection, as_series
from cloud_gateway.remote_write.prompb import encode_requests
from gpurelay.record import Record, RecordDecoder, RecordEncoder
from gpurelay.wire import Ack, Frame, Hello, Replay
from harness.pipeline import simulated_snapshots

NODE = "edge-bench"
URL = "http://receiver.invalid/api/v1/write"


def per_call_us(fn: Callable[[], object], rounds: int) -> float:
    """Median over ``rounds`` of one call, in microseconds (CPU time of this process)."""
    times = []
    for _ in range(rounds):
        started = time.process_time_ns()
        fn()
        times.append((time.process_time_ns() - started) / 1000)
    return statistics.median(times)


async def end_to_end(records: list[bytes], max_samples_per_send: int) -> tuple[float, int, int]:
    """(CPU us per replayed batch, requests, compressed bytes) with remote write on."""
    sizes: list[int] = []

    def receive(request: httpx.Request) -> httpx.Response:
        sizes.append(len(request.content))
        return httpx.Response(204)

    client = httpx.AsyncClient(transport=httpx.MockTransport(receive))
    writer = RemoteWriter(
        RemoteWriteConfig(url=URL, max_samples_per_send=max_samples_per_send), client=client
    )
    settings = DeliverySettings(max_queued_batches=len(records) + 1)
    ingest = Ingest(Registry(), delivery=Delivery(settings, remote_write=writer))
    acks: list[int] = []

    def send(frame: Frame) -> None:
        if isinstance(frame, Ack):
            acks.append(frame.seq)

    session = ingest.open_session(NODE, "127.0.0.1:1", lambda reason: None, send)
    session.handle(Hello(agent_version="bench", node=NODE, interval_seconds=10.0))
    session.handle(Replay(seq=10**9, record=records[0]))  # warm: series keys, label blocks
    while len(acks) < 1:
        await asyncio.sleep(0)
    acks.clear()
    sizes.clear()
    started = time.process_time_ns()
    for seq, data in enumerate(records):
        session.handle(Replay(seq=seq, record=data))
    while len(acks) < len(records):
        await asyncio.sleep(0)
    cpu_us = (time.process_time_ns() - started) / 1000
    session.closed("bench done")
    await ingest.aclose()
    await writer.close()
    return cpu_us / len(records), len(sizes), sum(sizes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=60)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--processes-per-gpu", type=int, default=8)
    parser.add_argument("--max-samples-per-send", type=int, default=2000)
    args = parser.parse_args()

    snapshots = simulated_snapshots(
        gpus=args.gpus, processes_per_gpu=args.processes_per_gpu, count=args.count
    )
    encoder = RecordEncoder()
    records = [encoder.encode(s) for s in snapshots]
    decoder = RecordDecoder()
    decoded: list[Record] = [decoder.decode(r) for r in records]  # warm
    series = len(decoded[-1].series)

    ingest = Ingest(Registry())
    session = ingest.open_session(NODE, "127.0.0.1:1", lambda reason: None)
    session.handle(Hello(agent_version="bench", node=NODE, interval_seconds=10.0))
    session._replayed_samples(decoded[0])  # warm
    collections = [
        QueuedCollection(
            seq=i,
            timestamp_ms=r.timestamp_ms,
            samples=session._replayed_samples(r),
            replayed=True,
        )
        for i, r in enumerate(decoded)
    ]

    def encode(c: QueuedCollection) -> int:
        requests = encode_requests(as_series([c]), args.max_samples_per_send)
        return sum(len(body) for body, _ in requests)

    encode(collections[0])  # warm
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
    rounds = len(records)
    it_records, it_decoded, it_collections = (
        iter(records * 3),
        iter(decoded * 3),
        iter(collections * 3),
    )
    decode_us = per_call_us(lambda: decoder.decode(next(it_records)), rounds)
    samples_us = per_call_us(lambda: session._replayed_samples(next(it_decoded)), rounds)
    encode_us = per_call_us(lambda: encode(next(it_collections)), rounds)
    request_bytes = statistics.median(encode(c) for c in collections)
    e2e_us, requests, sent = asyncio.run(end_to_end(records, args.max_samples_per_send))

    print(
        f"replayed batch: {args.gpus} GPUs x {args.processes_per_gpu} processes, "
        f"{series} series, record {statistics.median(len(r) for r in records):.0f} bytes "
        f"(median of {len(records)})"
    )
    print(f"  decode   {decode_us:8.0f} us   RecordDecoder.decode (warm)")
    print(f"  samples  {samples_us:8.0f} us   remote write keys (stamped labels)")
    print(
        f"  encode   {encode_us:8.0f} us   split + protobuf + snappy "
        f"({request_bytes:.0f} bytes compressed per batch)"
    )
    print(f"  sum      {decode_us + samples_us + encode_us:8.0f} us")
    print(
        f"  e2e      {e2e_us:8.0f} us   handle(REPLAY) .. ACK, coalesced: {requests} requests "
        f"for {len(records)} batches, {sent / len(records):.0f} bytes per batch"
    )


if __name__ == "__main__":
    main()
