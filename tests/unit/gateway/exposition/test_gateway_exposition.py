"""The gateway's unified /metrics: cached family-major blocks, OpenMetrics, promtool, BIE."""

from __future__ import annotations

import asyncio
import gzip
import math
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from cloud_gateway.exposition.body import (
    NODE_LAST_SEEN,
    NODE_LATE_AFTER,
    NODE_STATE,
    NODE_UP,
    TEXT_LINES,
    Exposition,
    header,
)
from cloud_gateway.http.bie import bie_document
from cloud_gateway.registry.store import Registry, StoreConfig, stamp_node
from gpurelay.exposition import format_labels, format_value, openmetrics_header, text_header
from gpurelay.model import Family, Sample, Snapshot
from gpurelay.wire import Batch, Declare, Hello, SeriesDecl
from harness.pipeline import make_pipeline
from tests.promtool_support import unexpected_findings

T0 = 1_790_000_000.0
MIB = 1024 * 1024

# Copied from tests/integration/test_agent_http.py: promtool's findings that *are* the
# compatibility contract (dcgm/ACK camelCase labels, dcgm counters without _total).

ODD = Family(name="odd_labels", type="gauge", help='back\\slash and\nnewline "quoted"')
ODD_SAMPLE = Sample("odd_labels", (("v", 'q"uo\\te\nnl ünï'), ("Hostname", "liar")), 0.25)
OWN = (
    Family(name="gpurelay_gateway_batches_total", type="counter", help="Batches applied."),
    [Sample("gpurelay_gateway_batches_total", (), 42.0)],
)


def snapshot(tmp: Path, *, gpus: int, seed: int, mig: bool = False) -> Snapshot:
    pipeline, _sim, _clock = make_pipeline(tmp, gpus=gpus, seed=seed, mig=mig)
    try:
        return pipeline.collection.collect()
    finally:
        pipeline.close()


class Agent:
    """Feeds a snapshot into the registry as an agent's frames would (ids in sample order)."""

    def __init__(self, reg: Registry, node: str, snap: Snapshot, now: float = T0) -> None:
        self.reg, self.node, self.snap, self.seq = reg, node, snap, 0
        hello = Hello(agent_version="0.1.0", node=node, gpus=snap.gpus)
        self.conn = reg.connect(node, remote="10.1.1.1:40000", hello=hello, now=now).conn_id
        fams = {f.name: f for f in snap.families}
        series = tuple(
            SeriesDecl(
                id=i, name=s.name, type=fams[s.name].type, help=fams[s.name].help, labels=s.labels
            )
            for i, s in enumerate(snap.samples)
        )
        assert reg.declare(node, self.conn, Declare(series=series)).rejected == ()
        self.send(list(enumerate(s.value for s in snap.samples)), now=now, full=True)

    def send(self, values: list[tuple[int, float]], *, now: float, full: bool = False) -> None:
        self.seq += 1
        b = Batch(seq=self.seq, timestamp=now, values=tuple(values), full=full)
        self.reg.apply(self.node, self.conn, b, now=now, size_bytes=100)


def reference(
    nodes: dict[str, Snapshot], live: dict[str, tuple[str, float, float]], *, openmetrics: bool
) -> bytes:
    """The body rendered the obvious way: every sample formatted from scratch."""
    header = openmetrics_header if openmetrics else text_header
    families = {f.name: f for snap in nodes.values() for f in snap.families}
    out = []
    for name in sorted(families):
        samples = [
            Sample(s.name, stamp_node(s.labels, node), s.value)
            for node in sorted(nodes)
            for s in nodes[node].samples
            if s.name == name
        ]
        if samples:
            out.append(header(name, families[name]))
            out += [f"{s.name}{format_labels(s.labels)} {format_value(s.value)}\n" for s in samples]
    # (state, last seen, late after): up, one state series per state, the two times
    out.append(header(NODE_UP.name, NODE_UP))
    out += [f'{NODE_UP.name}{{Hostname="{n}"}} {int(live[n][0] == "online")}\n' for n in live]
    out.append(header(NODE_STATE.name, NODE_STATE))
    out += [
        f'{NODE_STATE.name}{{Hostname="{n}",state="{s}"}} {int(live[n][0] == s)}\n'
        for n in sorted(live)
        for s in ("online", "stale", "offline")
    ]
    for fam, col in ((NODE_LAST_SEEN, 1), (NODE_LATE_AFTER, 2)):
        out.append(header(fam.name, fam))
        out += [
            f'{fam.name}{{Hostname="{n}"}} {format_value(float(live[n][col]))}\n'
            for n in sorted(live)
        ]
    out.append(header(OWN[0].name, OWN[0]) + "gpurelay_gateway_batches_total 42\n")
    return ("".join(out) + ("# EOF\n" if openmetrics else "")).encode()


@dataclass
class Fleet:
    reg: Registry
    expo: Exposition
    snaps: dict[str, Snapshot]
    agents: dict[str, Agent]


@pytest.fixture
def fleet(tmp_path: Path) -> Fleet:
    snaps = {
        "edge-b": snapshot(tmp_path / "b", gpus=2, seed=3, mig=True),
        "edge-a": snapshot(tmp_path / "a", gpus=1, seed=5),
        "edge-c": snapshot(tmp_path / "c", gpus=3, seed=9),
    }
    a = snaps["edge-a"]
    snaps["edge-a"] = Snapshot(
        node="edge-a",
        timestamp=a.timestamp,
        families=(*a.families, ODD),
        samples=(*a.samples, ODD_SAMPLE),
        gpus=a.gpus,
    )
    reg = Registry()
    agents = {node: Agent(reg, node, snap) for node, snap in snaps.items()}
    expo = Exposition(reg)
    expo.set_extra([OWN])
    return Fleet(reg, expo, snaps, agents)


def test_body_is_family_major_and_matches_a_naive_rendering(
    fleet: Fleet,
) -> None:
    expo, snaps = fleet.expo, fleet.snaps
    live = {n: ("online", T0, 3 * 10.0 + 2) for n in sorted(snaps)}
    assert expo.body(openmetrics=False, gzip=False) == reference(snaps, live, openmetrics=False)
    assert expo.body(openmetrics=True, gzip=False) == reference(snaps, live, openmetrics=True)
    body = expo.body(openmetrics=False, gzip=False).decode()
    assert 'Hostname="liar"' not in body and 'v="q\\"uo\\\\te\\nnl ünï",Hostname="edge-a"' in body
    types = re.findall(r"^# TYPE (\S+)", body, re.M)
    assert len(types) == len(set(types))  # every family in one group


def test_body_is_shared_until_something_changes(
    fleet: Fleet,
) -> None:
    reg, expo = fleet.reg, fleet.expo
    text = expo.body(openmetrics=False, gzip=False)
    packed = expo.body(openmetrics=False, gzip=True)
    built = expo.bodies_built
    for _ in range(3):  # more scrapers cost nothing
        assert expo.body(openmetrics=False, gzip=False) is text
        assert expo.body(openmetrics=False, gzip=True) is packed
    assert expo.bodies_built == built and gzip.decompress(packed) == text
    expo.set_extra([OWN])  # same content: still the same body
    assert expo.body(openmetrics=False, gzip=False) is text
    reg.connect("edge-z", remote="r", hello=Hello(agent_version="1", node="edge-z"), now=T0 + 1)
    after = expo.body(openmetrics=False, gzip=False)
    assert after is not text and b'gpurelay_node_up{Hostname="edge-z"} 1\n' in after


async def test_concurrent_scrapers_share_one_compression_off_the_loop(fleet: Fleet) -> None:
    expo = fleet.expo
    built = expo.bodies_built
    bodies = await asyncio.gather(
        *(expo.scrape_async(openmetrics=True, gzip=True) for _ in range(5))
    )
    assert all(b.chunks == bodies[0].chunks for b in bodies)
    first = bodies[0].chunks[:-1]  # the trailer (CRC, length) is made per scrape
    assert all(x is y for b in bodies for x, y in zip(b.chunks[:-1], first, strict=True))
    assert expo.bodies_built == built + 2  # the fleet pieces, then one pass compressing them
    packed = bodies[0].join()
    assert bodies[0].size == len(packed) and bodies[0].gzip
    assert gzip.decompress(packed) == expo.body(openmetrics=True, gzip=False)
    assert expo.body(openmetrics=True, gzip=True) == packed
    plain = await expo.scrape_async(openmetrics=False, gzip=False)
    assert plain.join() == expo.body(openmetrics=False, gzip=False)


async def test_own_metrics_and_liveness_leave_the_fleet_part_alone(fleet: Fleet) -> None:
    """The gateway's own families change every tick and last_seen every batch; neither
    re-joins nor recompresses a fleet piece: only the small tail is new."""
    reg, expo = fleet.reg, fleet.expo
    first = await expo.scrape_async(openmetrics=False, gzip=True)
    built = expo.bodies_built
    counter = (OWN[0], [Sample("gpurelay_gateway_batches_total", (), 43.0)])
    expo.set_extra([counter])
    fleet.agents["edge-a"].send([], now=T0 + 5)  # a batch without values: last_seen moves
    second = await expo.scrape_async(openmetrics=False, gzip=True)
    assert expo.bodies_built == built
    # all but the tail's deflate and the trailer (CRC, length) are the very same bytes
    assert all(x is y for x, y in zip(first.chunks[:-2], second.chunks[:-2], strict=True))
    text = gzip.decompress(second.join())
    assert text.endswith(b"gpurelay_gateway_batches_total 43\n")
    assert b'gpurelay_node_last_seen_timestamp_seconds{Hostname="edge-a"} 1790000005\n' in text
    assert reg.generation and text == expo.body(openmetrics=False, gzip=False)


async def test_a_changed_block_recompresses_only_its_piece(fleet: Fleet) -> None:
    expo, snaps = fleet.expo, fleet.snaps
    first = await expo.scrape_async(openmetrics=True, gzip=True)
    util = next(
        i for i, s in enumerate(snaps["edge-b"].samples) if s.name == "DCGM_FI_DEV_GPU_UTIL"
    )
    fleet.agents["edge-b"].send([(util, 99.0)], now=T0 + 10)
    second = await expo.scrape_async(openmetrics=True, gzip=True)
    fresh = [y for x, y in zip(first.chunks, second.chunks, strict=True) if x is not y]
    assert len(fresh) == 3  # the piece of DCGM_FI_DEV_GPU_UTIL, the tail, the trailer
    assert b"DCGM_FI_DEV_GPU_UTIL{" in zlib.decompressobj(-zlib.MAX_WBITS).decompress(fresh[0])
    packed = second.join()
    assert gzip.decompress(packed) == expo.body(openmetrics=True, gzip=False)
    one = zlib.decompressobj(zlib.MAX_WBITS | 16)  # as httpx and curl read: one member
    assert one.decompress(packed) == expo.body(openmetrics=True, gzip=False)
    assert one.eof and not one.unused_data


def test_a_batch_rerenders_only_the_blocks_it_touched(
    fleet: Fleet,
) -> None:
    reg, expo, snaps = fleet.reg, fleet.expo, fleet.snaps

    def versions() -> dict[tuple[str, int], int]:
        return {(f.name, i): g.version for f, gs in reg.family_groups() for i, g in enumerate(gs)}

    before = expo.body(openmetrics=False, gzip=False)
    old = versions()
    rendered = reg.blocks_rendered
    util = next(
        i for i, s in enumerate(snaps["edge-b"].samples) if s.name == "DCGM_FI_DEV_GPU_UTIL"
    )
    fleet.agents["edge-b"].send([(util, 99.0)], now=T0 + 10)
    new = versions()
    assert [k for k in old if old[k] != new[k]] == [("DCGM_FI_DEV_GPU_UTIL", 1)]  # edge-b's
    assert reg.blocks_rendered == rendered  # rendered when a scrape asks, not per batch
    after = expo.body(openmetrics=False, gzip=False)
    assert reg.blocks_rendered == rendered + 1
    assert after != before and b"DCGM_FI_DEV_GPU_UTIL{" in after
    assert (
        after
        == b"".join(  # the other blocks were taken back from the old pieces
            [header(f, openmetrics=False) + b"".join(bs) for f, bs in reg.family_blocks()]
        )
        + after[after.index(b"# HELP gpurelay_node_up") :]
    )


def test_promtool_finds_nothing_but_the_compatible_names(fleet: Fleet, promtool: Path) -> None:
    expo = fleet.expo
    packed = expo.body(openmetrics=False, gzip=True)
    for body in (expo.body(openmetrics=False, gzip=False), gzip.decompress(packed)):
        assert unexpected_findings(promtool, body) == []


def test_openmetrics_parses_and_keeps_the_dcgm_names(
    fleet: Fleet,
) -> None:
    expo = fleet.expo
    body = expo.body(openmetrics=True, gzip=False).decode()
    parsed = text_string_to_metric_families(body)  # type: ignore[no-untyped-call]
    fams = {f.name: f for f in parsed}
    energy = fams["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"]
    assert energy.type == "unknown"
    assert {s.name for s in energy.samples} == {"DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"}
    assert fams["gpurelay_agent_collections"].type == "counter"
    assert fams["gpurelay_gateway_batches"].samples[0].value == 42
    up = {s.labels["Hostname"]: s.value for s in fams["gpurelay_node_up"].samples}
    assert up == {"edge-a": 1, "edge-b": 1, "edge-c": 1}
    procs = fams["DCGM_CUSTOM_PROCESS_SM_UTIL"].samples
    assert {s.labels["NodeName"] for s in procs} == {"edge-a", "edge-b", "edge-c"}


def test_an_expired_node_keeps_up_and_last_seen(tmp_path: Path) -> None:
    reg = Registry(StoreConfig(offline_grace=60))
    agent = Agent(reg, "edge-a", snapshot(tmp_path, gpus=1, seed=1))
    expo = Exposition(reg)
    reg.disconnect("edge-a", agent.conn, now=T0 + 5, reason="eof")
    assert b"DCGM_FI_DEV_GPU_UTIL{" in expo.body(openmetrics=False, gzip=False)
    reg.expire(T0 + 66)
    body = expo.body(openmetrics=False, gzip=False).decode()
    assert body == (
        f"# HELP gpurelay_node_up {NODE_UP.help}\n# TYPE gpurelay_node_up gauge\n"
        'gpurelay_node_up{Hostname="edge-a"} 0\n'
        f"# HELP {NODE_STATE.name} {NODE_STATE.help}\n# TYPE {NODE_STATE.name} gauge\n"
        'gpurelay_node_state{Hostname="edge-a",state="online"} 0\n'
        'gpurelay_node_state{Hostname="edge-a",state="stale"} 0\n'
        'gpurelay_node_state{Hostname="edge-a",state="offline"} 1\n'
        f"# HELP {NODE_LAST_SEEN.name} {NODE_LAST_SEEN.help}\n# TYPE {NODE_LAST_SEEN.name} gauge\n"
        f'{NODE_LAST_SEEN.name}{{Hostname="edge-a"}} {format_value(T0)}\n'
    )


def test_bie_document_uses_the_latest_fb_values_of_online_nodes(tmp_path: Path) -> None:
    reg = Registry()
    snap = snapshot(tmp_path / "b", gpus=2, seed=3, mig=True)
    agent = Agent(reg, "edge-b", snap)
    Agent(reg, "edge-stale", snapshot(tmp_path / "s", gpus=1, seed=4), now=T0 - 100)
    fb = [
        (i, s)
        for i, s in enumerate(snap.samples)
        if s.name == "DCGM_FI_DEV_FB_USED" and not dict(s.labels).get("GPU_I_ID")
    ]
    assert len(fb) == 2  # one per physical GPU; MIG instances have their own series
    agent.send([(fb[0][0], 1000.0)], now=T0 + 1)
    doc = bie_document(reg, T0 + 2)
    assert list(doc) == ["edge-b"]  # edge-stale has been silent for > 3 intervals
    devices = doc["edge-b"]["devices"]
    assert doc["edge-b"]["deviceNum"] == 2
    assert devices[0]["usedMemory"] == 1000 * MIB
    assert devices[1]["usedMemory"] == round(fb[1][1].value * MIB)
    assert [d["totalMemory"] for d in devices] == [g.memory_total_bytes for g in snap.gpus]
    assert doc["edge-b"]["usedMemory"] == sum(d["usedMemory"] for d in devices)


@given(st.floats(allow_nan=True, allow_infinity=True) | st.integers(-(2**60), 2**60).map(float))
def test_series_lines_format_values_as_the_shared_renderer(value: float) -> None:
    """The registry's lines come from TEXT_LINES; its integer shortcut must give exactly
    the bytes of gpurelay.exposition.format_value (one text format, two code paths)."""
    assert TEXT_LINES.value(value) == (format_value(value) + "\n").encode()
    labels = (("gpu", "0"), ("Hostname", 'a"b'))
    assert TEXT_LINES.prefix("m", labels) == f"m{format_labels(labels)} ".encode()


VALUE = (
    st.floats(allow_nan=True, allow_infinity=True)
    | st.integers(-(2**60), 2**60).map(float)
    | st.sampled_from([1e15, -1e15, 999999999999999.0, 1e15 - 0.5, -0.0, 0.1])
)


@given(st.lists(st.lists(VALUE, min_size=1, max_size=12), min_size=1, max_size=4))
@example([[5.0], [1e15]])  # integral both times, but only the first takes %d
@example([[5.0], [-1e15]])
@example([[1.5], [math.nan], [math.inf], [2.5]])
@example([[1.0, 2.0], [6e14, 9e14]])  # a sum beyond 1e15, each value within
def test_a_block_template_renders_every_value_as_the_shared_renderer(
    rounds: list[list[float]],
) -> None:
    """A block renders as one % of its template, slots remade when a value's kind
    changes: every round of values (kinds changing between rounds, big sums, NaN, huge
    integers) must give the lines gpurelay.exposition.format_value gives."""
    reg = Registry()
    hello = Hello(agent_version="0.1.0", node="n", gpus=())
    conn = reg.connect("n", remote="r", hello=hello, now=0.0).conn_id
    width = max(map(len, rounds))
    series = tuple(
        SeriesDecl(id=j, name="m", type="gauge", help="h", labels=(("k", f"{j}%"),))
        for j in range(width)
    )
    reg.declare("n", conn, Declare(series=series))
    for seq, values in enumerate(rounds, start=1):
        batch = Batch(seq=seq, timestamp=0.0, values=tuple(enumerate(values)))
        reg.apply("n", conn, batch, now=0.0, size_bytes=0)
        ((_, [got]),) = reg.family_blocks()
        want = "".join(
            f'm{{k="{j}%",Hostname="n"}} {format_value(v)}\n' for j, v in reg_values(reg)
        )
        assert got == want.encode()


def reg_values(reg: Registry) -> list[tuple[int, float]]:
    return [(int(dict(labels)["k"][:-1]), v) for labels, v in reg.samples("n")]
