"""One shard of the ``/metrics`` body (``/metrics?shard=K&shards=N``, see
:mod:`cloud_gateway.exposition.shards`), built from the same cached (family, node) blocks as the
whole body (:mod:`cloud_gateway.exposition.body`), filtered by node.

A family's ``# HELP``/``# TYPE`` header comes once, only when the shard holds one of its
series; the node families (liveness, and the ``gpurelay_node_*`` families the gateway
computes, such as the certificate expiry) keep the shard's nodes; the gateway's own
families (``gpurelay_gateway_*``) come in shard 0 only. So the N shards' bodies together hold every
series of the whole body exactly once, and each one alone is a valid exposition.

A shard's fleet part is joined (a copy of its share of the blocks) and, for gzip,
compressed in a worker thread, both kept until a block changes; its tail (liveness, the
gateway's own families) is rendered per change, as the whole body's. So a scrape with no
new device data costs the tail, and N scrapers of N shards each pay for their share of a
change once. The unsharded body does not pass through here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from typing import TYPE_CHECKING

from cloud_gateway.exposition.gzip_members import GZIP_HEADER, Deflated, trailer
from cloud_gateway.exposition.shards import shard_of

if TYPE_CHECKING:
    from cloud_gateway.exposition.body import Body, Exposition
    from cloud_gateway.registry.records import FamilyState

Key = tuple[int, int, bool]  # shard, shards, openmetrics
Cached = tuple[object, bytes, Deflated | None]  # generation, plain, deflated
MAX_CACHED = 4096  # shard bodies kept (a Prometheus asks the same few again and again)


class ShardCache:
    """Per :class:`Exposition`: each (node, N)'s shard, each family's blocks' nodes, and
    the shards' bodies as of the exposition's generation."""

    def __init__(self) -> None:
        self._shards: dict[int, dict[str, int]] = {}  # N -> node -> its shard
        self._nodes: dict[str, tuple[object, dict[int, str]]] = {}  # family -> ordered, nodes
        self._fleet: dict[Key, Cached] = {}  # by the exposition's fleet generation
        self._tails: dict[Key, Cached] = {}  # by its generation

    def shard(self, node: str, shards: int) -> int:
        memo = self._shards.setdefault(shards, {})
        k = memo.get(node)
        if k is None:
            if len(memo) > 1_000_000:
                memo.clear()
            k = memo[node] = shard_of(node, shards)
        return k

    def keep(self, families: Collection[str]) -> None:
        """Forget the block lists of families no longer in the fleet (they hold blocks)."""
        self._nodes = {k: v for k, v in self._nodes.items() if k in families}

    def block_nodes(self, fs: FamilyState) -> dict[int, str]:
        """``id(block) -> node`` of the family's blocks, kept while its block list is."""
        ordered = fs.ordered
        hit = self._nodes.get(fs.family.name)
        if hit is None or hit[0] is not ordered:
            hit = self._nodes[fs.family.name] = (
                ordered,
                {id(g): node for node, g in fs.groups.items()},
            )
        return hit[1]

    async def body(self, expo: Exposition, key: Key, *, gzip: bool) -> Body:
        """The shard's body: its fleet part (kept until a piece changes; compressed in a
        worker thread once a gzip scrape asks) and its tail (liveness, the gateway's own
        families in shard 0, rendered when they changed), one gzip member with gzip."""
        from cloud_gateway.exposition.body import Body

        generation = expo.fleet_generation()
        part = self._fleet.get(key)
        if part is None or part[0] != generation:
            shard, shards, openmetrics = key
            parts = self._fleet_parts(expo, shards, openmetrics)
            for k, plain in enumerate(parts):  # storing them may clear the cache, so
                _store(self._fleet, (k, shards, openmetrics), (generation, plain, None))
            part = (generation, parts[shard], None)  # not read back from it
        tail = self._tails.get(key)
        if tail is None or tail[0] != expo.generation:
            tail = _store(self._tails, key, (expo.generation, self._tail(expo, *key), None))
        if not gzip:
            return Body((part[1], tail[1]), len(part[1]) + len(tail[1]), False)
        packed, last = part[2], tail[2]
        if packed is None:
            packed = await asyncio.to_thread(Deflated, part[1], expo.gzip_level)
            if self._fleet.get(key, part)[0] == part[0]:  # still current: keep it
                self._fleet[key] = (part[0], part[1], packed)
        if last is None:
            last = Deflated(tail[1], expo.gzip_level, final=True)
            self._tails[key] = (tail[0], tail[1], last)
        chunks = (GZIP_HEADER, packed.data, last.data, trailer([packed, last]))
        return Body(chunks, sum(map(len, chunks)), True)

    def _fleet_parts(self, expo: Exposition, shards: int, openmetrics: bool) -> list[bytes]:
        """Every shard's fleet part in one pass over the blocks (their N scrapers come
        together: one pass, not N)."""
        fleet = expo.current_fleet()
        states = {fs.family.name: fs for fs, _ in expo.registry.family_states()}
        outs: list[list[bytes | memoryview]] = [[] for _ in range(shards)]
        for fam, pieces in fleet:
            nodes = self.block_nodes(states[fam.name])
            per: list[list[bytes | memoryview]] = [[] for _ in range(shards)]
            for piece in pieces:
                for i, g in enumerate(piece.groups):
                    per[self.shard(nodes[id(g)], shards)].append(piece.block(i))
            header = expo.family_header(fam, openmetrics)
            for out, blocks in zip(outs, per, strict=True):
                if blocks:
                    out.append(header)
                    out.extend(blocks)
        return [b"".join(out) for out in outs]

    def _tail(self, expo: Exposition, shard: int, shards: int, openmetrics: bool) -> bytes:
        out = expo.node_families(openmetrics, lambda node: self.shard(node, shards) == shard)
        if shard == 0:
            out.append(expo.extra(openmetrics))
        if openmetrics:
            out.append(b"# EOF\n")
        return b"".join(out)


def _store(cache: dict[Key, Cached], key: Key, value: Cached) -> Cached:
    if key not in cache and len(cache) >= MAX_CACHED:
        cache.clear()
    cache[key] = value
    return value
