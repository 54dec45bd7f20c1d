"""Shards of the fleet for ``/metrics?shard=K&shards=N``: node ``name`` is in shard
``blake2b-64(name) mod N``. The hash is fixed (not Python's per-process ``hash``), so every
gateway, every restart and every version puts a node in the same shard, and Prometheus can
scrape a big fleet as N targets in parallel, none over its body-size limit."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

MAX_SHARDS = 1024


class ShardError(ValueError):
    """A bad ``shard``/``shards`` pair; the message is for the client (HTTP 400)."""


def shard_of(node: str, shards: int) -> int:
    digest = hashlib.blake2b(node.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % shards


def parse_shard(query: Mapping[str, str]) -> tuple[int, int] | None:
    """``(shard, shards)`` from a query, or None when it names no shard (the whole fleet)."""
    shard, shards = query.get("shard"), query.get("shards")
    if shard is None and shards is None:
        return None
    if shard is None or shards is None:
        raise ShardError("shard and shards go together: /metrics?shard=K&shards=N")
    if not (_decimal(shard) and _decimal(shards)):
        raise ShardError(f"shard={shard[:20]!r} and shards={shards[:20]!r} must be whole numbers")
    k, n = int(shard), int(shards)
    if not 1 <= n <= MAX_SHARDS:
        raise ShardError(f"shards must be between 1 and {MAX_SHARDS}, not {n}")
    if not k < n:
        raise ShardError(f"shard must be between 0 and shards-1 ({n - 1}), not {k}")
    return k, n


def _decimal(text: str) -> bool:
    """ASCII digits, few enough for int(): ``str.isdigit`` also takes ``²``, which int()
    refuses, and int() refuses more than 4,300 digits."""
    return text.isascii() and text.isdigit() and len(text) <= 20
