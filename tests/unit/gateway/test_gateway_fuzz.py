"""Fuzzed frames never crash the gateway: only WireError leaves the decode+ingest path,
and whatever was accepted still renders as a valid exposition."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from cloud_gateway.exposition.body import Exposition
from cloud_gateway.ingest.session import Ingest
from cloud_gateway.registry.store import Registry
from edge_agent.encode import SnapshotEncoder
from gpurelay.record import RecordEncoder
from gpurelay.wire import (
    Batch,
    Declare,
    Frame,
    FrameDecoder,
    FrameEncoder,
    Hello,
    Replay,
    SeriesDecl,
    WireError,
)
from harness.pipeline import make_pipeline


def _valid_stream(tmp: Path) -> bytes:
    pipeline, _sim, clock = make_pipeline(tmp, gpus=2)
    encoder, frames, records = SnapshotEncoder(), FrameEncoder(), RecordEncoder()
    out = [frames.encode(Hello(agent_version="0.1.0", node="fuzz"))]
    try:
        for i in range(3):
            snapshot = pipeline.collection.collect()
            out += [frames.encode(f) for f in encoder.frames(snapshot)]
            # and a replayed collection, so that mutated records reach the record decoder
            out.append(frames.encode(Replay(seq=100 + i, record=records.encode(snapshot))))
            clock.advance(10)
    finally:
        pipeline.close()
    return b"".join(out)


@pytest.fixture(scope="module")
def stream(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return _valid_stream(tmp_path_factory.mktemp("fuzz"))


def _ingest(data: bytes, chunk: int) -> Ingest:
    """What an SSH channel does with incoming bytes; returns the ingest afterwards."""
    registry = Registry()
    ingest = Ingest(registry, clock=lambda: 1000.0)
    session = ingest.open_session("fuzz-node", "127.0.0.1:1", lambda reason: None)
    decoder = FrameDecoder()
    try:
        for i in range(0, len(data), chunk):
            session.received(chunk)
            for frame in decoder.feed(data[i : i + chunk]):
                session.handle(frame)
    except WireError:
        pass  # the connection would be closed with an ERROR frame: that is the contract
    finally:
        session.closed("fuzz")
    return ingest


def _feed(data: bytes, chunk: int) -> Registry:
    return _ingest(data, chunk).registry


def _renders(registry: Registry) -> None:
    body = Exposition(registry).body(openmetrics=False, gzip=False).decode()
    list(text_string_to_metric_families(body))  # parses


def test_the_valid_stream_is_accepted(stream: bytes) -> None:
    ingest = _ingest(stream, 4096)
    registry = ingest.registry
    assert registry.node("fuzz-node", now=1000.0) is not None
    view = registry.node("fuzz-node", now=1000.0)
    assert view is not None and (view.batches_received, view.replays_received) == (3, 3)
    assert all(ingest.delivery.is_delivered("fuzz-node", seq) for seq in (100, 101, 102))
    _renders(registry)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), chunk=st.integers(min_value=1, max_value=5000))
def test_mutated_streams_only_raise_wire_errors(
    stream: bytes, data: st.DataObject, chunk: int
) -> None:
    mutated = bytearray(stream)
    for _ in range(data.draw(st.integers(min_value=1, max_value=8))):
        kind = data.draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        pos = data.draw(st.integers(min_value=0, max_value=max(len(mutated) - 1, 0)))
        if kind == "flip" and mutated:
            mutated[pos] ^= data.draw(st.integers(min_value=1, max_value=255))
        elif kind == "insert":
            mutated[pos:pos] = data.draw(st.binary(min_size=1, max_size=16))
        elif kind == "delete":
            del mutated[pos : pos + data.draw(st.integers(min_value=1, max_value=16))]
        else:
            del mutated[pos:]
    _renders(_feed(bytes(mutated), chunk))


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=2048))
def test_random_bytes_only_raise_wire_errors(blob: bytes) -> None:
    _renders(_feed(blob, 97))


_label_text = st.text(min_size=0, max_size=20)
_series = st.builds(
    SeriesDecl,
    id=st.integers(min_value=0, max_value=50),
    name=st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,20}", fullmatch=True),
    type=st.sampled_from(["gauge", "counter"]),
    help=_label_text,
    labels=st.lists(
        st.tuples(st.from_regex(r"[a-zA-Z][a-zA-Z0-9_]{0,10}", fullmatch=True), _label_text),
        max_size=4,
        unique_by=lambda kv: kv[0],
    ).map(tuple),
)


@settings(max_examples=100, deadline=None)
@given(
    decls=st.lists(_series, max_size=12, unique_by=lambda s: s.id),
    values=st.lists(st.tuples(st.integers(0, 60), st.floats(allow_nan=True)), max_size=30),
)
def test_structurally_valid_but_hostile_frames(
    decls: list[SeriesDecl], values: list[tuple[int, float]]
) -> None:
    """Labels with quotes/newlines, a series claiming NodeName or Hostname, undeclared ids."""
    encoder = FrameEncoder()
    frames: list[Frame] = [
        Hello(agent_version="x", node="other-node"),
        Declare(series=tuple(decls)),
    ]
    declared = {d.id for d in decls}
    batch_values = tuple(sorted({i: v for i, v in values if i in declared}.items()))
    frames.append(Batch(seq=1, timestamp=1.0, values=batch_values))
    stream = b""
    try:
        stream = b"".join(encoder.encode(f) for f in frames)
    except WireError:
        return  # the agent-side encoder refuses it already
    registry = _feed(stream, 64)
    _renders(registry)
    body = Exposition(registry).body(openmetrics=False, gzip=False).decode()
    for line in body.splitlines():
        if line.startswith("#") or not line:
            continue
        if "Hostname=" in line or "NodeName=" in line:
            assert 'Hostname="fuzz-node"' in line or 'NodeName="fuzz-node"' in line, line
