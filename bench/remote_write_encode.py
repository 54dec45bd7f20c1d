"""Remote write encoding: ``cloud_gateway.remote_write.prompb`` (by hand) against ``protobuf``.

Collections of ``--series`` series (a big 8-GPU node: 740) with ``--labels`` labels each
(``__name__`` included), 10 s apart, in two requests the gateway sends:

- live     one collection as it arrives: one request of 740 samples
- replay   the backlog after an outage: the forwarder coalesces collections up to 10,000
           samples per send, cut into requests of ``--samples`` (``max_samples_per_send``,
           2000); the first one

Both sides produce the same protobuf ``prometheus.WriteRequest`` bytes (checked):

- prompb         ``encode_write_request``, caches warm: the gateway's steady state, the
                 same series every collection
- prompb, new    label-set cache emptied first (series not seen before, label pairs known)
- prompb, first  every cache emptied first
- protobuf       build the ``WriteRequest`` message and ``SerializeToString``, with the
                 classes generated code would get (a ``FileDescriptorProto`` of prompb's
                 ``Label``/``Sample``/``TimeSeries``/``WriteRequest``, no protoc needed)

Snappy is not included (both would pay the same). Median of ``--rounds`` calls, wall time.

Run: .venv/bin/python bench/remote_write_encode.py [--samples 2000] [--series 740]
     [--labels 10] [--rounds 200]   (needs ``protobuf``: pip install -e .[test])
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.internal import api_implementation

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cloud_gateway.remote_write import prompb
from cloud_gateway.remote_write.forwarder import MAX_SAMPLES_PER_SEND
from cloud_gateway.remote_write.prompb import Series, encode_write_request, split_series


def write_request_class() -> Any:
    """``prometheus.WriteRequest`` as generated ``remote_pb2`` code builds it at import."""
    f = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(
        name="prometheus/remote.proto", package="prometheus", syntax="proto3"
    )
    fields: dict[str, list[tuple[str, int, int, str]]] = {
        "Label": [("name", 1, f.TYPE_STRING, ""), ("value", 2, f.TYPE_STRING, "")],
        "Sample": [("value", 1, f.TYPE_DOUBLE, ""), ("timestamp", 2, f.TYPE_INT64, "")],
        "TimeSeries": [
            ("labels", 1, f.TYPE_MESSAGE, ".prometheus.Label"),
            ("samples", 2, f.TYPE_MESSAGE, ".prometheus.Sample"),
        ],
        "WriteRequest": [("timeseries", 1, f.TYPE_MESSAGE, ".prometheus.TimeSeries")],
    }
    for name, spec in fields.items():
        message = file.message_type.add(name=name)
        for field_name, number, kind, type_name in spec:
            repeated = kind == f.TYPE_MESSAGE
            field = message.field.add(
                name=field_name,
                number=number,
                type=kind,
                label=f.LABEL_REPEATED if repeated else f.LABEL_OPTIONAL,
            )
            if type_name:
                field.type_name = type_name
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("prometheus.WriteRequest"))


def collections(n: int, series: int, labels: int) -> list[Series]:
    """``n`` collections of ``series`` series, grouped by series as the forwarder does;
    labels sorted by name, so protobuf's side has nothing to sort."""
    rng = random.Random(1)
    names = [f"DCGM_FI_DEV_FIELD_{i}" for i in range(series // 8 + 1)]
    label_sets = []
    for i in range(series):
        gpu = i % 8
        base = (
            ("__name__", names[i // 8]),
            ("Hostname", "edge-gpu-node-0042"),
            ("gpu", str(gpu)),
            ("UUID", f"GPU-{gpu:08x}-1111-2222-3333-{rng.getrandbits(48):012x}"),
            ("device", f"nvidia{gpu}"),
            ("modelName", "NVIDIA H100 80GB HBM3"),
            ("pci_bus_id", f"00000000:{gpu + 0x18:02X}:00.0"),
            ("namespace", "inference"),
            ("pod", f"llm-serving-7d9f8b{gpu}"),
            ("container", "triton"),
        )
        extra = tuple((f"label_{k}", f"value-{k}") for k in range(len(base), labels))
        label_sets.append(tuple(sorted((base + extra)[:labels])))  # as Prometheus wants
    t0 = 1_790_000_000_000
    return [(ls, [(t0 + c * 10_000, rng.uniform(0, 100)) for c in range(n)]) for ls in label_sets]


def with_protobuf(write_request: Any) -> Callable[[list[Series]], bytes]:
    def encode(series: list[Series]) -> bytes:
        request = write_request()
        for labels, samples in series:
            ts = request.timeseries.add()
            for name, label_value in labels:  # already sorted by name, no empty values
                ts.labels.add(name=name, value=label_value)
            for timestamp, value in samples:
                ts.samples.add(value=value, timestamp=timestamp)
        data: bytes = request.SerializeToString(deterministic=True)
        return data

    return encode


def median_us(fn: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        started = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - started) / 1000)
    return statistics.median(times)


def compare(
    what: str, series: list[Series], protobuf: Callable[[list[Series]], bytes], rounds: int
) -> None:
    body = encode_write_request(series)
    assert protobuf(series) == body, "the two encodings differ"

    def new() -> bytes:
        prompb._label_cache.clear()
        return encode_write_request(series)

    def first() -> bytes:
        prompb._label_field.cache_clear()
        return new()

    warm_us = median_us(lambda: encode_write_request(series), rounds)
    new_us = median_us(new, rounds)
    first_us = median_us(first, rounds)
    protobuf_us = median_us(lambda: protobuf(series), rounds)
    n = sum(len(s) for _, s in series)
    print(f"{what}: {n} samples of {len(series)} series, {len(body):,} bytes")
    for name, us in (("prompb", warm_us), ("prompb, new", new_us), ("prompb, first", first_us)):
        print(f"  {name:14} {us:7.0f} us   protobuf / this {protobuf_us / us:4.1f}x")
    print(f"  {'protobuf':14} {protobuf_us:7.0f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--series", type=int, default=740)
    parser.add_argument("--labels", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()

    protobuf = with_protobuf(write_request_class())
    print(
        f"{args.labels} labels a series; protobuf {api_implementation.Type()}, "
        f"Python {sys.version.split()[0]}"
    )
    print()
    live = collections(1, args.series, args.labels)
    compare("live", live, protobuf, args.rounds)
    print()
    backlog = collections(MAX_SAMPLES_PER_SEND // args.series, args.series, args.labels)
    replay = next(iter(split_series(backlog, args.samples)))
    compare("replay", replay, protobuf, args.rounds)


if __name__ == "__main__":
    main()
