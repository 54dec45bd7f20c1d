"""The cached pieces of the ``/metrics`` fleet part (see :mod:`cloud_gateway.exposition.body`).

A piece is up to ``PIECE_BLOCKS`` consecutive (family, node) blocks of one family,
joined, with each block's group and version and where it ends in the join, and that
join deflated once a gzip scrape asked for it (in worker threads: zlib releases the GIL).
"""

from __future__ import annotations

import asyncio
import os
from array import array
from collections.abc import Sequence
from itertools import accumulate
from operator import is_
from typing import TYPE_CHECKING, Final

from cloud_gateway.exposition.gzip_members import Deflated

if TYPE_CHECKING:
    from cloud_gateway.registry.records import Group

PACK_THREADS: Final = 4  # at most, and no more than the machine's cores


class Piece:
    """Up to ``PIECE_BLOCKS`` consecutive (family, node) blocks of one family, joined,
    and that join deflated once a gzip scrape asked for it. The piece keeps its blocks'
    versions and where each ends in the join: a block that did not change is taken back
    from the old join (a memoryview, no copy), only changed blocks are rendered."""

    __slots__ = ("ends", "groups", "packed", "plain", "versions")

    def __init__(
        self,
        groups: Sequence[Group],
        versions: tuple[int, ...],
        blocks: Sequence[bytes | memoryview],
    ) -> None:
        self.groups = tuple(groups)  # identity tells a block that stayed
        self.versions = versions
        self.plain = b"".join(blocks)
        self.ends = array("I", accumulate(map(len, blocks)))
        self.packed: Deflated | None = None

    def same(self, groups: Sequence[Group], versions: tuple[int, ...]) -> bool:
        return versions == self.versions and all(map(is_, groups, self.groups))

    def block(self, i: int) -> memoryview:
        return memoryview(self.plain)[self.ends[i - 1] if i else 0 : self.ends[i]]


def versions_of(groups: Sequence[Group]) -> tuple[int, ...]:
    return tuple(g.version for g in groups)


def pack(pieces: Sequence[Piece], level: int) -> int:
    """Compress what no scrape compressed yet (in a worker thread: zlib releases the GIL)."""
    packed = 0
    for piece in pieces:
        if piece.packed is None:
            piece.packed = Deflated(piece.plain, level)
            packed += len(piece.plain)
    return packed


async def pack_parallel(pieces: Sequence[Piece], level: int) -> int:
    """:func:`_pack` over worker threads, one share of about equal bytes per core."""
    shares = max(1, min(os.cpu_count() or 1, PACK_THREADS, len(pieces)))
    if shares == 1:
        return await asyncio.to_thread(pack, pieces, level)
    total = sum(len(p.plain) for p in pieces)
    split: list[list[Piece]] = [[] for _ in range(shares)]
    done = 0
    for piece in pieces:
        split[min(shares - 1, done * shares // max(total, 1))].append(piece)
        done += len(piece.plain)
    counts = await asyncio.gather(*(asyncio.to_thread(pack, share, level) for share in split))
    return sum(counts)
