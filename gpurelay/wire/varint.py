"""LEB128 unsigned varints and zig-zag signed integers."""

from __future__ import annotations

from typing import Final

from gpurelay.wire.frames import WireError

MAX_VARINT_BYTES: Final = 10


def zz(n: int) -> int:
    return n << 1 if n >= 0 else ((-n) << 1) - 1


def unzz(u: int) -> int:
    return (u >> 1) ^ -(u & 1)


def put(out: bytearray, u: int) -> None:
    while u > 0x7F:
        out.append((u & 0x7F) | 0x80)
        u >>= 7
    out.append(u)


def uvarint(buf: bytes, pos: int) -> tuple[int, int]:
    """Read one uvarint at ``pos``; return it and the position after it."""
    result = shift = 0
    for i in range(pos, pos + MAX_VARINT_BYTES):
        byte = buf[i]  # IndexError: the frame ends early (translated at the boundary)
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, i + 1
        shift += 7
    raise WireError("malformed", f"a varint at byte {pos} is longer than {MAX_VARINT_BYTES} bytes")
