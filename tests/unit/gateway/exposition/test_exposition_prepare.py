"""Rendering ahead of a scrape: the exposition learns when scrapers come and, on the
gateway's tick shortly before the next one, renders the blocks that changed, so the
scrape costs only what changed since; between scrapes blocks stay unrendered."""

from __future__ import annotations

import asyncio

from cloud_gateway.exposition.body import Exposition
from cloud_gateway.registry.store import Registry
from gpurelay.wire import Batch, Declare, Hello, SeriesDecl

NODES = ("n1", "n2", "n3")


def _fleet() -> tuple[Registry, dict[str, int]]:
    reg = Registry()
    conns = {}
    for node in NODES:
        hello = Hello(agent_version="0.1.0", node=node, gpus=())
        conn = conns[node] = reg.connect(node, remote="r", hello=hello, now=0.0).conn_id
        series = tuple(
            SeriesDecl(id=j, name=f"fam{j % 4}", type="gauge", help="h", labels=(("k", f"{j}"),))
            for j in range(12)
        )
        reg.declare(node, conn, Declare(series=series))
        values = tuple((j, float(j)) for j in range(12))
        reg.apply(node, conn, Batch(seq=1, timestamp=0.0, values=values), now=0.0, size_bytes=0)
    return reg, conns


def _send(reg: Registry, conns: dict[str, int], node: str, seq: int, value: float) -> None:
    batch = Batch(seq=seq, timestamp=0.0, values=((1, value), (2, value + 0.5)))
    reg.apply(node, conns[node], batch, now=float(seq), size_bytes=0)


def test_nothing_is_rendered_ahead_before_the_scrape_period_is_known() -> None:
    reg, conns = _fleet()
    expo = Exposition(reg)
    expo.scrape(openmetrics=False, gzip=False)
    _send(reg, conns, "n1", 2, 7.0)
    rendered = reg.blocks_rendered
    assert not asyncio.run(expo.prepare(100.0))  # no scrape seen: stay lazy
    expo.note_scrape(100.0)
    assert not asyncio.run(expo.prepare(101.0))  # one scrape: no period yet
    assert reg.blocks_rendered == rendered


def test_blocks_are_rendered_on_the_tick_before_a_due_scrape_and_not_between() -> None:
    reg, conns = _fleet()
    expo = Exposition(reg)
    for t in (0.0, 15.0, 30.0):  # a scraper every 15 s
        expo.note_scrape(t)
        expo.scrape(openmetrics=False, gzip=False)
    _send(reg, conns, "n1", 2, 7.0)
    rendered = reg.blocks_rendered
    assert not asyncio.run(expo.prepare(35.0))  # the next scrape is 10 s away
    assert reg.blocks_rendered == rendered
    assert asyncio.run(expo.prepare(44.0))  # due at 45: render now
    assert reg.blocks_rendered == rendered + 2  # n1's fam1 and fam2
    _send(reg, conns, "n2", 3, 9.0)  # arrives between the tick and the scrape
    body = expo.body(openmetrics=False, gzip=False)
    assert reg.blocks_rendered == rendered + 4  # only n2's blocks were left for the scrape
    fresh = Exposition(reg).body(openmetrics=False, gzip=False)
    assert body == fresh  # every block rendered ahead is in the body, as a fresh one
    assert b'fam1{k="1",Hostname="n1"} 7\n' in body and b'fam2{k="2",Hostname="n2"} 9.5\n' in body


def test_a_body_built_before_the_tick_is_not_served_after_it() -> None:
    reg, conns = _fleet()
    expo = Exposition(reg)
    for t in (0.0, 15.0):
        expo.note_scrape(t)
    old = expo.body(openmetrics=False, gzip=True)
    _send(reg, conns, "n3", 2, 11.0)
    assert asyncio.run(expo.prepare(29.0))
    new = expo.body(openmetrics=False, gzip=True)
    assert new != old and new == Exposition(reg).body(openmetrics=False, gzip=True)


def test_a_family_gone_before_the_tick_leaves_no_pieces_behind() -> None:
    reg, conns = _fleet()
    expo = Exposition(reg)
    for t in (0.0, 15.0):
        expo.note_scrape(t)
    expo.scrape(openmetrics=False, gzip=False)
    for seq, node in enumerate(NODES, start=2):  # every node drops its fam3 series
        batch = Batch(seq=seq, timestamp=0.0, values=(), removed=(3, 7, 11))
        reg.apply(node, conns[node], batch, now=float(seq), size_bytes=0)
    assert asyncio.run(expo.prepare(29.0))
    assert "fam3" not in expo._pieces
    body = expo.body(openmetrics=False, gzip=False)
    assert b"fam3" not in body and body == Exposition(reg).body(openmetrics=False, gzip=False)


def test_the_tick_compresses_ahead_only_for_scrapers_that_take_gzip() -> None:
    for gz in (False, True):
        reg, conns = _fleet()
        expo = Exposition(reg)
        for t in (0.0, 15.0):
            expo.note_scrape(t, gzip=gz)
        _send(reg, conns, "n2", 2, 5.0)
        assert asyncio.run(expo.prepare(29.0))
        packed = [p.packed is not None for pieces in expo._pieces.values() for p in pieces]
        assert packed and all(packed) if gz else not any(packed)
        body = asyncio.run(expo.scrape_async(openmetrics=False, gzip=True)).join()
        assert body == Exposition(reg).body(openmetrics=False, gzip=True)


def test_a_scraper_that_stopped_coming_leaves_the_blocks_lazy_again() -> None:
    reg, conns = _fleet()
    expo = Exposition(reg)
    for t in (0.0, 15.0, 30.0):
        expo.note_scrape(t)
    expo.scrape(openmetrics=False, gzip=False)
    for seq, now in enumerate((46.5, 50.0, 75.0, 300.0), start=2):  # all after 45 + 1.1
        _send(reg, conns, "n1", seq, float(seq))
        assert not asyncio.run(expo.prepare(now))
