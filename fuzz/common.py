"""What the fuzz targets share: how one fuzz input picks a chunking, limits and a stream.

Every target reads a first *control* byte and then its payload. Mutating compressed bytes
rarely gets past deflate, so the frame and record targets also take a *plain* form: the
payload written uncompressed, which this module compresses the way the real encoders do.
``seeds.py`` writes the seed corpus in both forms.

Plain frame stream: repeated ``u8 type | u16 length (big endian) | body``; HELLO, DECLARE
and BATCH bodies are deflated on one stream (as :class:`gpurelay.wire.FrameEncoder` does),
and each becomes ``u32 length | u8 version 1 | u8 type | payload`` on the wire.
"""

from __future__ import annotations

import random
import struct
import zlib
from collections.abc import Awaitable
from typing import TypeVar

from gpurelay.wire import Limits
from gpurelay.wire.frames import COMPRESSED, HEADER, LENGTH, SYNC_TAIL, WINDOW_BITS

T = TypeVar("T")

PLAIN = 0x80  # control bit: the payload is in plain form
SMALL = 0x40  # control bit: decode under SMALL_LIMITS rather than the defaults
SEED_MASK = 0x3F  # control bits: the chunking (0: one chunk)

# Limits a few kilobytes of input can exceed, so the fuzzer reaches every limit check.
SMALL_LIMITS = Limits(
    max_frame_bytes=2048,
    max_series=16,
    max_labels=4,
    max_name_bytes=32,
    max_label_value_bytes=64,
    max_help_bytes=64,
)
_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 13, 64, 1000, 4096)
_PLAIN_HEAD = struct.Struct(">BH")


def split(data: bytes, control: int) -> tuple[bytes, ...]:
    """Cut ``data`` into chunks chosen by the control byte (0: one chunk)."""
    seed = control & SEED_MASK
    if seed == 0:
        return (data,)
    rng = random.Random(seed)
    out: list[bytes] = []
    pos = 0
    while pos < len(data):
        size = rng.choice(_SIZES)
        out.append(data[pos : pos + size])
        pos += size
    return tuple(out)


def plain_to_wire(plain: bytes) -> bytes:
    """A plain frame stream (see the module docstring) as the bytes a peer would send."""
    deflater = zlib.compressobj(6, zlib.DEFLATED, -WINDOW_BITS, 8)
    out = bytearray()
    pos = 0
    while pos + _PLAIN_HEAD.size <= len(plain):
        ftype, length = _PLAIN_HEAD.unpack_from(plain, pos)
        pos += _PLAIN_HEAD.size
        body = plain[pos : pos + length]
        pos += length
        if ftype in COMPRESSED:
            body = (deflater.compress(body) + deflater.flush(zlib.Z_SYNC_FLUSH))[: -len(SYNC_TAIL)]
        out += HEADER.pack(len(body) + 2, 1, ftype) + body
    return bytes(out)


def wire_to_plain(wire: bytes) -> bytes:
    """The inverse of :func:`plain_to_wire` for a valid stream (seeds.py uses it)."""
    inflater = zlib.decompressobj(-WINDOW_BITS)
    out = bytearray()
    pos = 0
    while pos + HEADER.size <= len(wire):
        (length,) = LENGTH.unpack_from(wire, pos)
        ftype = wire[pos + 5]
        payload = wire[pos + HEADER.size : pos + 4 + length]
        pos += 4 + length
        if ftype in COMPRESSED:
            payload = inflater.decompress(payload + SYNC_TAIL)
        if len(payload) > 0xFFFF:
            break  # a seed needs no more
        out += _PLAIN_HEAD.pack(ftype, len(payload)) + payload
    return bytes(out)


def run_sync(awaitable: Awaitable[T]) -> T:
    """Await something that never waits (its awaitables are fakes that answer at once)
    without an event loop: much cheaper per fuzz input than ``asyncio.run``."""
    steps = awaitable.__await__()
    try:
        next(steps)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    raise RuntimeError("the coroutine waited on something real")
