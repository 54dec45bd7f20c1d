"""Delivered seqs as merged ranges: membership, merging, the bound."""

from __future__ import annotations

import random
from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cloud_gateway.ingest.seqranges import SeqRanges


def test_adding_merges_neighbours() -> None:
    r = SeqRanges()
    assert r.add(5) and r.add(7) and r.add(9)
    assert r.ranges() == [(5, 5), (7, 7), (9, 9)]
    assert r.add(6)  # closes the gap between 5 and 7
    assert r.ranges() == [(5, 7), (9, 9)]
    assert r.add(8) and r.add(4) and r.add(10)
    assert r.ranges() == [(4, 10)] and len(r) == 1
    assert not r.add(4) and not r.add(7) and not r.add(10)
    assert 4 in r and 10 in r and 3 not in r and 11 not in r and "4" not in r


def test_a_live_stream_stays_one_range() -> None:
    r = SeqRanges(max_ranges=2)
    for seq in range(1, 100_001):
        r.add(seq)
    assert r.ranges() == [(1, 100_000)]


def test_the_lowest_ranges_are_forgotten_past_the_bound() -> None:
    r = SeqRanges(max_ranges=3)
    for seq in (10, 20, 30, 40):
        r.add(seq)
    assert r.ranges() == [(20, 20), (30, 30), (40, 40)] and r.forgotten == 1
    assert 10 not in r
    assert r.add(5)  # lower than everything kept: in and out at once
    assert 5 not in r and r.forgotten == 2
    assert r.add(21)  # merging never needs to forget
    assert r.ranges() == [(20, 21), (30, 30), (40, 40)]


def test_bound_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_ranges"):
        SeqRanges(0)


@given(st.lists(st.integers(min_value=0, max_value=200), max_size=300))
def test_behaves_like_a_set(seqs: list[int]) -> None:
    r, model = SeqRanges(), set()
    for seq in seqs:
        assert r.add(seq) == (seq not in model)
        model.add(seq)
    assert all((i in r) == (i in model) for i in range(-1, 202))
    ranges = r.ranges()
    assert all(a <= b for a, b in ranges)
    assert all(b1 + 1 < a2 for (_, b1), (a2, _) in pairwise(ranges))


def test_random_backlog_fill() -> None:
    rng = random.Random(1)
    order = list(range(1000))
    rng.shuffle(order)
    r = SeqRanges()
    for seq in order:
        r.add(seq)
    assert r.ranges() == [(0, 999)]
