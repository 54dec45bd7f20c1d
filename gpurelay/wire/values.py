"""Value kinds of a BATCH entry: the shortest exact encoding of a float, and back."""

from __future__ import annotations

import math
import struct
from typing import Final

from gpurelay.wire.frames import MAX_TIMESTAMP_MS, WireError
from gpurelay.wire.rules import show
from gpurelay.wire.varint import put, zz

# Value kinds of a BATCH entry (the low 3 bits of its head).
INT, INT_DELTA, MILLI, MILLI_DELTA, KIBI, KIBI_DELTA, FLOAT64 = range(7)
KIND_BITS: Final = 3
KIND_MASK: Final = (1 << KIND_BITS) - 1
SHORTER_THAN_FLOAT64: Final = 1 << 56  # a uvarint below this takes at most 8 bytes
F64: Final = struct.Struct(">d")


def int_base(prev: float | None) -> int | None:
    """What an INT_DELTA or KIBI_DELTA adds to: the previous value, truncated."""
    return int(prev) if prev is not None and math.isfinite(prev) else None


def milli_base(prev: float | None) -> int | None:
    """What a MILLI_DELTA adds to: the previous value in thousandths, rounded."""
    if prev is None:
        return None
    scaled = prev * 1000
    return round(scaled) if math.isfinite(scaled) else None


def put_value(out: bytearray, v: float, prev: float | None) -> int:
    """Append the shortest exact encoding of ``v``; return its kind.

    Each candidate is an integer that the decoder turns back into exactly ``v`` (integer
    arithmetic, at most one correctly rounded division); the smallest zig-zag, so the
    shortest varint, wins. Deltas add to a base that both ends compute the same way.
    """
    if v.is_integer():  # finite and integral
        if v == 0.0 and math.copysign(1.0, v) < 0:
            out += F64.pack(v)
            return FLOAT64
        n = int(v)
        kind, u = INT, zz(n)
        base = int_base(prev)
        if base is not None and (d := zz(n - base)) < u:
            kind, u = INT_DELTA, d
        if n & 1023 == 0 and n:
            if (d := zz(n >> 10)) < u:
                kind, u = KIBI, d
            if base is not None and (d := zz((n >> 10) - (base >> 10))) < u:
                kind, u = KIBI_DELTA, d
        if u < SHORTER_THAN_FLOAT64:
            put(out, u)
            return kind
    elif math.isfinite(v):  # not integral, so |v| < 2**52 and v * 1000 cannot overflow
        m = round(v * 1000)
        if m / 1000 == v:
            kind, u = MILLI, zz(m)
            base = milli_base(prev)
            if base is not None and (d := zz(m - base)) < u:
                kind, u = MILLI_DELTA, d
            if u < SHORTER_THAN_FLOAT64:
                put(out, u)
                return kind
    out += F64.pack(v)
    return FLOAT64


def timestamp_ms(timestamp: float) -> int:
    if isinstance(timestamp, bool) or not isinstance(timestamp, int | float):
        raise WireError("malformed", f"BATCH timestamp {show(timestamp)} is not a number")
    if not math.isfinite(timestamp) or abs(timestamp) * 1000 >= MAX_TIMESTAMP_MS:
        raise WireError("malformed", f"BATCH timestamp {timestamp!r} is not a usable time")
    return round(timestamp * 1000)


def decode_value(kind: int, n: int, prev: float | None, sid: int) -> float:
    """The value a BATCH entry of ``kind`` with integer ``n`` stands for."""
    if kind == INT:
        return float(n)
    if kind == MILLI:
        return n / 1000
    if kind == KIBI:
        return float(n << 10)
    if kind > KIBI_DELTA:
        raise WireError("malformed", f"value kind {kind} of series {sid} is not known")
    base = milli_base(prev) if kind == MILLI_DELTA else int_base(prev)
    if base is None:
        raise WireError(
            "malformed", f"series {sid} has a delta value but no finite previous value to add it to"
        )
    if kind == INT_DELTA:
        return float(base + n)
    if kind == MILLI_DELTA:
        return (base + n) / 1000
    return float(((base >> 10) + n) << 10)
