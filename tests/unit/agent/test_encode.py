"""The encode stage: ids, declarations, removals, changed-only values, reconnects."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path

import pytest

from edge_agent.encode import SnapshotEncoder
from gpurelay.model import Family, Labels, Sample, Snapshot
from gpurelay.wire import (
    Batch,
    Declare,
    Frame,
    FrameDecoder,
    FrameEncoder,
    Hello,
    Limits,
    SeriesDecl,
)
from harness.pipeline import FIXED_TIME, make_pipeline

TEMP = Family(name="DCGM_FI_DEV_GPU_TEMP", type="gauge", help="GPU temperature (in C).")
ENERGY = Family(name="DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", type="counter", help="Energy (mJ).")


def gpu(i: int) -> Labels:
    return (("gpu", str(i)), ("UUID", f"GPU-{i}"))


def snap(*samples: tuple[str, Labels, float], t: float = 0.0) -> Snapshot:
    return Snapshot(
        node="edge-node-1",
        timestamp=FIXED_TIME + t,
        families=(TEMP, ENERGY),
        samples=tuple(Sample(name, labels, value) for name, labels, value in samples),
    )


def temp(i: int, value: float) -> tuple[str, Labels, float]:
    return (TEMP.name, gpu(i), value)


def split(frames: Sequence[Frame]) -> tuple[Declare | None, Batch]:
    *head, batch = frames
    assert isinstance(batch, Batch)
    if not head:
        return None, batch
    assert len(head) == 1 and isinstance(head[0], Declare)
    return head[0], batch


def ids_by_gpu(declare: Declare) -> dict[str, int]:
    return {dict(d.labels)["gpu"]: d.id for d in declare.series}


def test_first_snapshot_declares_everything_and_sends_a_full_batch() -> None:
    enc = SnapshotEncoder()
    declare, batch = split(
        enc.frames(snap(temp(0, 50.0), temp(1, 51.0), (ENERGY.name, gpu(0), 7.0)))
    )
    assert declare is not None
    assert [(d.name, d.type, d.help) for d in declare.series] == [
        (TEMP.name, "gauge", TEMP.help),
        (TEMP.name, "gauge", TEMP.help),
        (ENERGY.name, "counter", ENERGY.help),
    ]
    assert len({d.id for d in declare.series}) == 3
    assert batch.full and batch.seq == 1 and batch.timestamp == FIXED_TIME and batch.removed == ()
    assert sorted(v for _, v in batch.values) == [7.0, 50.0, 51.0]
    assert enc.next_seq == 2


def test_ids_are_stable_and_only_changed_values_are_sent() -> None:
    enc = SnapshotEncoder(first_seq=41)
    declare, _ = split(enc.frames(snap(temp(0, 50.0), temp(1, 51.0), temp(2, 52.0))))
    assert declare is not None
    ids = ids_by_gpu(declare)
    declare, batch = split(enc.frames(snap(temp(0, 50.0), temp(1, 60.0), temp(2, 52.0), t=10)))
    assert declare is None
    assert batch.seq == 42 and not batch.full
    assert batch.values == ((ids["1"], 60.0),)
    declare, batch = split(enc.frames(snap(temp(2, 53.0), temp(1, 60.0), temp(0, 50.0), t=20)))
    assert declare is None  # order of samples does not matter
    assert batch.values == ((ids["2"], 53.0),)
    assert enc.next_seq == 44


def test_new_series_are_declared_once() -> None:
    enc = SnapshotEncoder()
    enc.frames(snap(temp(0, 50.0)))
    declare, batch = split(enc.frames(snap(temp(0, 50.0), temp(1, 51.0), t=10)))
    assert declare is not None and [dict(d.labels)["gpu"] for d in declare.series] == ["1"]
    assert batch.values == ((declare.series[0].id, 51.0),)
    declare, batch = split(enc.frames(snap(temp(0, 50.0), temp(1, 51.0), t=20)))
    assert declare is None and batch.values == ()


def test_vanished_series_are_removed_and_come_back_with_a_new_id() -> None:
    enc = SnapshotEncoder()
    declare, _ = split(enc.frames(snap(temp(0, 50.0), temp(1, 51.0))))
    assert declare is not None
    ids = ids_by_gpu(declare)
    declare, batch = split(enc.frames(snap(temp(0, 50.0), t=10)))
    assert declare is None and batch.removed == (ids["1"],) and batch.values == ()
    declare, batch = split(enc.frames(snap(temp(0, 50.0), temp(1, 51.0), t=20)))
    assert declare is not None
    (again,) = declare.series
    assert again.id not in ids.values()
    assert batch.values == ((again.id, 51.0),) and batch.removed == ()


def test_reset_redeclares_every_live_series_under_the_same_ids() -> None:
    enc = SnapshotEncoder()
    first, _ = split(enc.frames(snap(temp(0, 50.0), temp(1, 51.0), temp(2, 52.0))))
    enc.frames(snap(temp(0, 50.0), temp(2, 52.0), t=10))  # gpu 1 goes away
    enc.reset()
    declare, batch = split(enc.frames(snap(temp(0, 50.0), temp(2, 53.0), t=20)))
    assert first is not None and declare is not None
    ids = ids_by_gpu(first)
    assert [d.id for d in declare.series] == [ids["0"], ids["2"]]
    assert batch.full and batch.removed == ()
    assert batch.values == ((ids["0"], 50.0), (ids["2"], 53.0))
    declare, batch = split(enc.frames(snap(temp(0, 50.0), temp(2, 53.0), t=30)))
    assert declare is None and not batch.full and batch.values == ()


def test_sample_without_family_is_a_gauge_without_help() -> None:
    enc = SnapshotEncoder()
    declare, _ = split(enc.frames(snap(("my_custom_metric", (), 1.0))))
    assert declare is not None
    assert declare.series == (
        SeriesDecl(id=0, name="my_custom_metric", type="gauge", help="", labels=()),
    )


def test_change_detection_is_bit_exact() -> None:
    enc = SnapshotEncoder()
    enc.frames(snap(temp(0, math.nan), temp(1, 0.0)))
    _, batch = split(enc.frames(snap(temp(0, math.nan), temp(1, 0.0), t=10)))
    assert batch.values == ()  # NaN stays NaN: nothing to send
    _, batch = split(enc.frames(snap(temp(0, math.nan), temp(1, -0.0), t=20)))
    assert len(batch.values) == 1 and math.copysign(1.0, batch.values[0][1]) < 0


def test_a_repeated_series_is_sent_once() -> None:
    enc = SnapshotEncoder()
    declare, batch = split(enc.frames(snap(temp(0, 50.0), temp(0, 99.0))))
    assert declare is not None and len(declare.series) == 1
    assert batch.values == ((0, 50.0),)


def test_the_same_series_again_take_the_fast_path_with_repeats_and_refusals() -> None:
    """Same series in the same order: ids reused without lookups; the first of a repeat
    still wins and a refused series stays out; a change of order or set goes the long way."""
    enc = SnapshotEncoder()
    bad = ("bad name", gpu(9), 1.0)
    split(enc.frames(snap(temp(0, 50.0), temp(0, 99.0), bad, temp(1, 60.0))))
    declare, batch = split(enc.frames(snap(temp(0, 51.0), temp(0, 98.0), bad, temp(1, 60.0))))
    assert declare is None and batch.values == ((0, 51.0),) and batch.removed == ()
    declare, batch = split(enc.frames(snap(temp(1, 61.0), temp(0, 51.0))))  # order changed
    assert declare is None and batch.values == ((1, 61.0),)
    declare, batch = split(enc.frames(snap(temp(1, 61.0))))
    assert declare is None and batch.removed == (0,) and batch.values == ()
    enc.reset()
    declare, batch = split(enc.frames(snap(temp(1, 62.0))))
    assert declare is not None and [d.id for d in declare.series] == [1]
    assert batch.full and batch.values == ((1, 62.0),)


def test_series_the_gateway_would_refuse_are_left_out(caplog: pytest.LogCaptureFixture) -> None:
    enc = SnapshotEncoder()
    bad = snap(
        temp(0, 50.0),
        ("bad-name", (), 1.0),
        (TEMP.name, (("__reserved", "x"),), 2.0),
    )
    with caplog.at_level(logging.WARNING, logger="edge_agent.encode"):
        declare, batch = split(enc.frames(bad))
    assert declare is not None and [d.name for d in declare.series] == [TEMP.name]
    assert batch.full and len(batch.values) == 1
    assert set(enc.rejected) == {("bad-name", ()), (TEMP.name, (("__reserved", "x"),))}
    assert "bad-name" in caplog.text
    caplog.clear()
    enc.frames(bad)
    assert caplog.text == ""  # said once
    stream = FrameEncoder()
    stream.encode(Hello(agent_version="1", node="n"))
    stream.encode(declare)
    stream.encode(batch)


def test_series_beyond_the_limit_wait_for_room() -> None:
    enc = SnapshotEncoder(limits=Limits(max_series=2))
    declare, _ = split(enc.frames(snap(temp(0, 1.0), temp(1, 1.0), temp(2, 1.0))))
    assert declare is not None and len(declare.series) == 2 and enc.over_limit == 1
    enc.frames(snap(temp(0, 1.0), t=10))
    declare, _ = split(enc.frames(snap(temp(0, 1.0), temp(2, 1.0), t=20)))
    assert declare is not None and len(declare.series) == 1 and enc.over_limit == 0


def test_declarations_are_split_to_fit_the_frame_limit() -> None:
    limits = Limits(max_frame_bytes=4096)
    enc = SnapshotEncoder(limits=limits)
    frames = enc.frames(snap(*(temp(i, float(i)) for i in range(100))))
    declares = [f for f in frames if isinstance(f, Declare)]
    assert len(declares) > 1
    assert sum(len(d.series) for d in declares) == 100
    stream = FrameEncoder(limits=limits)
    stream.encode(Hello(agent_version="1", node="n"))
    for frame in frames:
        stream.encode(frame)  # none is over the limit


class Gateway:
    """What the gateway rebuilds from the frames: (name, labels) -> latest value."""

    def __init__(self) -> None:
        self.decoder = FrameDecoder()
        self.series: dict[int, SeriesDecl] = {}
        self.values: dict[int, float] = {}

    def receive(self, data: bytes) -> list[Frame]:
        frames = self.decoder.feed(data)
        for frame in frames:
            if isinstance(frame, Declare):
                self.series.update((d.id, d) for d in frame.series)
            elif isinstance(frame, Batch):
                if frame.full:
                    self.values.clear()
                for sid in frame.removed:
                    del self.values[sid]
                self.values.update(frame.values)
        return frames

    def view(self) -> dict[tuple[str, Labels], float]:
        return {(self.series[i].name, self.series[i].labels): v for i, v in self.values.items()}


def test_simulated_node_round_trips_through_the_wire(tmp_path: Path) -> None:
    pipeline, _sim, clock = make_pipeline(tmp_path, gpus=8)
    try:
        snapshots = []
        for _ in range(6):
            snapshots.append(pipeline.collection.collect())
            clock.advance(10)
    finally:
        pipeline.close()
    enc = SnapshotEncoder()
    gateway = Gateway()

    def connect() -> FrameEncoder:
        gateway.decoder = FrameDecoder()
        enc.reset()
        stream = FrameEncoder()
        gateway.receive(stream.encode(Hello(agent_version="1", node="edge-node-1")))
        return stream

    stream = connect()
    sent = []
    for i, snapshot in enumerate(snapshots):
        if i == 3:
            stream = connect()  # a reconnect in the middle
        frames = enc.frames(snapshot)
        received = gateway.receive(b"".join(stream.encode(f) for f in frames))
        assert len(received) == len(frames)
        assert gateway.view() == {(s.name, s.labels): s.value for s in snapshot.samples}
        _, batch = split(frames)
        sent.append(len(batch.values))
    # Full batches: the first, and after the reconnect (the first collection has fewer
    # series: rates measured between two collections, GPM's among them, start at the second).
    series = [len(s.samples) for s in snapshots]
    assert sent[0] == series[0] and sent[3] == series[3]
    assert all(n < series[i] / 2 for i, n in enumerate(sent) if i not in (0, 3))
