"""The registry's compact blocks: after any mix of batches, removals, full batches and
reconnects, each rendered (family, node) block is exactly the lines of its live series,
each made from scratch (the splicing of old text and changed values loses nothing)."""

from __future__ import annotations

import random

import pytest

from cloud_gateway.exposition.body import TEXT_LINES
from cloud_gateway.registry.store import Registry
from gpurelay.wire import Batch, Declare, Hello, SeriesDecl

VALUES = (0.0, -1.5, 1e20, 2.5e-7, float("inf"), float("-inf"), float("nan"))


def _value(rnd: random.Random) -> float:
    if rnd.random() < 0.5:
        return float(rnd.randint(0, 10 ** rnd.randint(0, 13)))  # as many digits, or not
    return rnd.choice(VALUES) if rnd.random() < 0.3 else rnd.random() * 1e6


def _labels(j: int) -> tuple[tuple[str, str], ...]:
    return (("k", f"{j}"), ("p", "5%s %d%% %r %%%"[: 1 + j % 12]))


def _expected(reg: Registry, node: str) -> dict[str, bytes]:
    out: dict[str, list[bytes]] = {}
    for labels, value in reg.samples(node):
        name = labels[0][1]
        out.setdefault(name, []).append(
            TEXT_LINES.prefix(name, labels[1:]) + TEXT_LINES.value(value)
        )
    return {name: b"".join(lines) for name, lines in out.items()}


@pytest.mark.parametrize("seed", range(5))
def test_rendered_blocks_are_the_lines_of_the_live_series(seed: int) -> None:
    rnd = random.Random(seed)
    reg = Registry()
    hello = Hello(agent_version="0.1.0", node="n1", gpus=())
    for _ in range(40):  # connections
        conn = reg.connect("n1", remote="r", hello=hello, now=0.0).conn_id
        ids = rnd.sample(range(30), rnd.randint(1, 30))
        series = tuple(  # a % in a label value stays text (the block's template doubles it)
            SeriesDecl(id=j, name=f"fam{j % 3}", type="gauge", help="h", labels=_labels(j))
            for j in ids
        )
        reg.declare("n1", conn, Declare(series=series))
        for seq in range(2, 2 + rnd.randint(1, 8)):
            values = tuple((j, _value(rnd)) for j in rnd.sample(ids, rnd.randint(0, len(ids))))
            removed = tuple(rnd.sample(ids, min(len(ids), 2))) if rnd.random() < 0.2 else ()
            batch = Batch(
                seq=seq, timestamp=0.0, values=values, removed=removed, full=rnd.random() < 0.2
            )
            reg.apply("n1", conn, batch, now=0.0, size_bytes=0)
            if rnd.random() < 0.5:
                got = {fam.name: b"".join(blocks) for fam, blocks in reg.family_blocks()}
                assert got == _expected(reg, "n1")


def test_a_block_nobody_scrapes_keeps_no_prefixes_of_removed_series() -> None:
    reg = Registry()
    hello = Hello(agent_version="0.1.0", node="n1", gpus=())
    conn = reg.connect("n1", remote="r", hello=hello, now=0.0).conn_id
    for seq in range(1, 200):  # each batch replaces the node's 10 series by 10 new ones
        ids = range(seq * 10, seq * 10 + 10)
        series = tuple(
            SeriesDecl(id=j, name="fam", type="gauge", help="h", labels=(("k", f"{j:04d}" * 50),))
            for j in ids
        )
        reg.declare("n1", conn, Declare(series=series))
        values = tuple((j, float(j)) for j in ids)
        reg.apply(
            "n1",
            conn,
            Batch(seq=seq, timestamp=0.0, values=values, full=True),
            now=0.0,
            size_bytes=0,
        )
    group = reg._nodes["n1"].groups["fam"]
    held = len(group.tmpl) + len(group.pending or b"")
    assert held < 10 * 240  # the template holds the 10 live lines only
    got = {fam.name: b"".join(blocks) for fam, blocks in reg.family_blocks()}
    assert got == _expected(reg, "n1") and got["fam"].count(b"\n") == 10


def test_a_live_series_labels_are_read_back_from_its_block_as_declared() -> None:
    """A live series keeps no label tuple: remote write's key is read back from the
    block's template, unescaped, in the declared order (then kept)."""
    nasty = ("", "a\\b", 'q"q', "l\nl", "%d %s %%", "{x=y,z}", "\\n\\", "ünï")
    reg = Registry()
    hello = Hello(agent_version="0.1.0", node="n1", gpus=())
    conn = reg.connect("n1", remote="r", hello=hello, now=0.0).conn_id
    series = tuple(
        SeriesDecl(id=j, name="fam", type="gauge", help="h", labels=(("z", v), ("a", f"{j}")))
        for j, v in enumerate(nasty)
    )
    reg.declare("n1", conn, Declare(series=series))
    values = tuple((j, float(j)) for j in range(len(nasty)))
    reg.apply("n1", conn, Batch(seq=1, timestamp=0.0, values=values), now=0.0, size_bytes=0)
    group = reg._nodes["n1"].groups["fam"]
    assert all(s.labels is None for s in group.members)  # nothing but the template
    want = {
        (("__name__", "fam"), ("z", v), ("a", f"{j}"), ("Hostname", "n1")): float(j)
        for j, v in enumerate(nasty)
    }
    assert dict(reg.samples("n1")) == want
    assert dict(reg.samples("n1")) == want  # kept after the first read
