"""Shards: fixed across processes, a partition of the fleet, strict parameters."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cloud_gateway.exposition.shards import ShardError, parse_shard, shard_of

PINNED = [9, 13, 11, 3]


def test_a_node_is_in_the_same_shard_in_every_process() -> None:
    names = [f"edge-{k}" for k in range(50)]
    here = [shard_of(n, 7) for n in names]
    code = (
        "from cloud_gateway.exposition.shards import shard_of;"
        f"print([shard_of(n, 7) for n in {names!r}])"
    )
    # another interpreter with another hash seed: Python's hash() would differ
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345"},
        cwd=Path(__file__).resolve().parents[4],
    )
    assert out.stdout.strip() == str(here)


def test_the_hash_is_pinned() -> None:
    """Changing it would move every node to another shard on an upgrade."""
    got = [shard_of(n, 16) for n in ("edge-0", "edge-1", "gpu-node-a", "边缘-1")]
    assert got == PINNED


@given(st.lists(st.text(min_size=1, max_size=63), min_size=1, max_size=200), st.integers(1, 64))
def test_shards_partition_the_fleet(names: list[str], n: int) -> None:
    parts = [[x for x in names if shard_of(x, n) == k] for k in range(n)]
    assert sorted(x for p in parts for x in p) == sorted(names)


def test_ten_thousand_nodes_spread_evenly_over_eight_shards() -> None:
    counts = Counter(shard_of(f"edge-{k:05d}", 8) for k in range(10_000))
    assert set(counts) == set(range(8))
    assert max(counts.values()) < 1.1 * 10_000 / 8


@pytest.mark.parametrize(
    ("query", "want"),
    [({}, None), ({"shard": "0", "shards": "1"}, (0, 1)), ({"shard": "3", "shards": "4"}, (3, 4))],
)
def test_parse(query: dict[str, str], want: tuple[int, int] | None) -> None:
    assert parse_shard(query) == want


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ({"shard": "1"}, "go together"),
        ({"shards": "2"}, "go together"),
        ({"shard": "-1", "shards": "2"}, "whole numbers"),
        ({"shard": "x", "shards": "2"}, "whole numbers"),
        ({"shard": "2", "shards": "2"}, r"between 0 and shards-1 \(1\), not 2"),
        ({"shard": "0", "shards": "0"}, "between 1 and 1024"),
        ({"shard": "0", "shards": "5000"}, "between 1 and 1024"),
    ],
)
def test_bad_parameters_are_clear(query: dict[str, str], message: str) -> None:
    with pytest.raises(ShardError, match=message):
        parse_shard(query)
