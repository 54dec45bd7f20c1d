"""One gzip member from separately compressed pieces, so that gzip costs what changed.

Each piece of a ``/metrics`` body is compressed on its own as raw deflate ending in a
sync flush (byte-aligned, not final, no reference to earlier bytes), so any sequence of
them is a valid deflate stream. A body is then a 10-byte gzip header, the pieces' deflate
in order, a final piece (the small per-scrape tail, finished), and the trailer: the CRC-32
of the whole plain body, folded from the pieces' own CRCs (zlib's ``crc32_combine``,
which Python's ``zlib`` does not expose: a carry-less multiply by ``x^(8 * len)`` modulo
the CRC polynomial, the power kept with each piece), and its length. One member, not a
concatenation of members: every gzip reader takes it, including those that stop after
the first member (httpx, curl).
"""

from __future__ import annotations

import struct
import zlib
from typing import Final

# magic, deflate, no flags, mtime 0, no extra flags, OS unknown
GZIP_HEADER: Final = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"
_POLY: Final = 0xEDB88320  # CRC-32, reflected


def _multmodp(a: int, b: int) -> int:
    """``a * b`` modulo the CRC polynomial (reflected bit order, as zlib's multmodp)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> tuple[int, ...]:
    p, out = 1 << 30, []  # x^1
    for _ in range(32):
        out.append(p)
        p = _multmodp(p, p)
    return tuple(out)


_X2N: Final = _x2n_table()


def shift_of(length: int) -> int:
    """``x^(8 * length)`` modulo the polynomial: what moves a CRC past ``length`` bytes."""
    p, k = 1 << 31, 3  # x^0; bytes are 2^3 bits
    while length:
        if length & 1:
            p = _multmodp(_X2N[k & 31], p)
        length >>= 1
        k += 1
    return p


class Deflated:
    """A piece's raw deflate (sync-flushed, or finished when ``final``), with its plain
    length, CRC-32 and :func:`shift_of` its length."""

    __slots__ = ("crc", "data", "length", "shift")

    def __init__(self, plain: bytes, level: int, *, final: bool = False) -> None:
        c = zlib.compressobj(level, zlib.DEFLATED, -zlib.MAX_WBITS)
        self.data = c.compress(plain) + c.flush(zlib.Z_FINISH if final else zlib.Z_SYNC_FLUSH)
        self.length = len(plain)
        self.crc = zlib.crc32(plain)
        self.shift = shift_of(len(plain))


def trailer(parts: list[Deflated]) -> bytes:
    """CRC-32 and length (mod 2^32) of the plain bytes of ``parts`` in order."""
    crc = length = 0
    for part in parts:
        crc = _multmodp(part.shift, crc) ^ part.crc if crc else part.crc
        length += part.length
    return struct.pack("<II", crc, length & 0xFFFFFFFF)
