"""ACK_RANGES: many acknowledged seqs in one small frame, and the helpers both ends use.

Layout (uncompressed)::

    uvarint  count                     1..MAX_ACK_RANGES
    uvarint  first                     of the lowest range
    uvarint  last - first
    then count - 1 times:
    uvarint  first - previous last - 2 ranges ascending, with at least one seq between them
    uvarint  last - first

Every range is (first, last), both inclusive, last <= 2**63-1. The form is canonical (one
byte string per set of seqs): the decoder refuses an empty list, overlapping or adjacent
ranges, values past MAX_SEQ, longer varints than needed are not produced and trailing
bytes are refused. A live node's seqs are consecutive, so a frame that covers a few
seconds of batches is usually one range: 3 to 12 bytes of payload.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Sequence

from gpurelay.wire.frames import MAX_ACK_RANGES, MAX_SEQ, AckRanges, WireError
from gpurelay.wire.rules import show
from gpurelay.wire.varint import put, uvarint


def coalesce(seqs: Iterable[int]) -> tuple[tuple[int, int], ...]:
    """Seqs (any order, repeats allowed) as canonical ranges."""
    ranges: list[tuple[int, int]] = []
    first = last = -2
    for seq in sorted(set(seqs)):
        if seq == last + 1:
            last = seq
            continue
        if first >= 0:
            ranges.append((first, last))
        first = last = seq
    if first >= 0:
        ranges.append((first, last))
    return tuple(ranges)


def frames_for(seqs: Iterable[int]) -> list[AckRanges]:
    """ACK_RANGES frames that acknowledge ``seqs``: one, unless more than
    :data:`MAX_ACK_RANGES` ranges are needed."""
    ranges = coalesce(seqs)
    return [
        AckRanges(ranges=ranges[i : i + MAX_ACK_RANGES])
        for i in range(0, len(ranges), MAX_ACK_RANGES)
    ]


def covered(ranges: Sequence[tuple[int, int]], seqs: Iterable[int]) -> set[int]:
    """Those of ``seqs`` that lie in canonical ``ranges``."""
    starts = [first for first, _ in ranges]
    out: set[int] = set()
    for seq in seqs:
        i = bisect_right(starts, seq) - 1
        if i >= 0 and seq <= ranges[i][1]:
            out.add(seq)
    return out


def encode_ack_ranges(frame: AckRanges) -> bytes:
    ranges = frame.ranges
    if not isinstance(ranges, tuple | list) or not 1 <= len(ranges) <= MAX_ACK_RANGES:
        raise WireError(
            "malformed", f"ACK_RANGES must hold 1..{MAX_ACK_RANGES} ranges, not {show(ranges)}"
        )
    out = bytearray()
    put(out, len(ranges))
    prev = -2
    for pair in ranges:
        if not (isinstance(pair, tuple | list) and len(pair) == 2):
            raise WireError("malformed", f"ACK_RANGES entry {show(pair)} is not a pair")
        first, last = pair
        if type(first) is not int or type(last) is not int or not 0 <= first <= last <= MAX_SEQ:
            raise WireError("malformed", f"ACK_RANGES range {show(pair)} is out of range")
        if first < prev + 2:
            raise WireError(
                "malformed", f"ACK_RANGES range {show(pair)} is not above the previous one + 1"
            )
        put(out, first - prev - 2 if prev >= 0 else first)
        put(out, last - first)
        prev = last
    return bytes(out)


def _minimal(body: bytes, pos: int) -> tuple[int, int]:
    value, end = uvarint(body, pos)
    if end - pos > 1 and body[end - 1] == 0:
        raise WireError("malformed", f"ACK_RANGES varint at byte {pos} is longer than needed")
    return value, end


def parse_ack_ranges(body: bytes) -> AckRanges:
    count, pos = _minimal(body, 0)
    if not 1 <= count <= MAX_ACK_RANGES or 2 * count > len(body) - pos:
        raise WireError("malformed", f"ACK_RANGES claims {count} ranges (1..{MAX_ACK_RANGES})")
    ranges: list[tuple[int, int]] = []
    prev = -2
    for _ in range(count):
        gap, pos = _minimal(body, pos)
        length, pos = _minimal(body, pos)
        first = prev + 2 + gap if prev >= 0 else gap
        last = first + length
        if last > MAX_SEQ:
            raise WireError("malformed", "ACK_RANGES range ends past 2**63-1")
        ranges.append((first, last))
        prev = last
    if pos != len(body):
        raise WireError("malformed", f"ACK_RANGES has {len(body) - pos} bytes left over")
    return AckRanges(ranges=tuple(ranges))
