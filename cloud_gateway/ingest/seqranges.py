"""Which batch sequence numbers of a node were delivered, as merged ranges.

Live batches arrive with increasing seqs, and a replayed backlog fills the gaps an outage
left, so a node's delivered seqs are almost always a handful of runs: a few ranges hold
millions of seqs. The number of ranges is bounded; past the bound the lowest (oldest)
ranges are forgotten. Forgetting is safe: a forgotten seq that is replayed again is only
delivered a second time (identical samples, which remote-write receivers accept).

Pure: no I/O, no clocks.
"""

from __future__ import annotations

from bisect import bisect_right

DEFAULT_MAX_RANGES = 4096


class SeqRanges:
    """A set of non-negative ints stored as sorted, disjoint, non-adjacent ranges."""

    __slots__ = ("_ends", "_max", "_starts", "forgotten")

    def __init__(self, max_ranges: int = DEFAULT_MAX_RANGES) -> None:
        if max_ranges < 1:
            raise ValueError("max_ranges must be >= 1")
        self._max = max_ranges
        self._starts: list[int] = []  # _starts[i] .. _ends[i], both inclusive
        self._ends: list[int] = []
        self.forgotten = 0  # ranges dropped to stay within the bound

    def __contains__(self, seq: object) -> bool:
        if not isinstance(seq, int):
            return False
        i = bisect_right(self._starts, seq) - 1
        return i >= 0 and seq <= self._ends[i]

    def __len__(self) -> int:
        """The number of ranges (not of seqs)."""
        return len(self._starts)

    def ranges(self) -> list[tuple[int, int]]:
        """(first, last) of every range, lowest first; both inclusive."""
        return list(zip(self._starts, self._ends, strict=True))

    def add(self, seq: int) -> bool:
        """Add ``seq``; ``False`` when it was there already."""
        starts, ends = self._starts, self._ends
        i = bisect_right(starts, seq) - 1  # the range starting at or before seq, if any
        if i >= 0 and seq <= ends[i]:
            return False
        joins_left = i >= 0 and ends[i] == seq - 1
        joins_right = i + 1 < len(starts) and starts[i + 1] == seq + 1
        if joins_left and joins_right:  # seq closes the gap between two ranges
            ends[i] = ends[i + 1]
            del starts[i + 1], ends[i + 1]
        elif joins_left:
            ends[i] = seq
        elif joins_right:
            starts[i + 1] = seq
        else:
            starts.insert(i + 1, seq)
            ends.insert(i + 1, seq)
            if len(starts) > self._max:
                del starts[0], ends[0]
                self.forgotten += 1
        return True
