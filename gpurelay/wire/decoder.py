"""Bytes to frames for one direction of one connection (the gateway's hot path)."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator

from gpurelay.wire.ackranges import parse_ack_ranges
from gpurelay.wire.frames import (
    COMPRESSED,
    DEFAULT_LIMITS,
    KNOWN_TYPES,
    LENGTH,
    MAX_SEQ,
    MAX_TIMESTAMP_MS,
    PROTOCOL_VERSION,
    SYNC_TAIL,
    WINDOW_BITS,
    Batch,
    Frame,
    FrameType,
    Limits,
    Replay,
    WireError,
)
from gpurelay.wire.payloads import (
    parse_ack,
    parse_declare,
    parse_error,
    parse_goodbye,
    parse_heartbeat,
    parse_hello,
)
from gpurelay.wire.session import ConnectionState
from gpurelay.wire.values import (
    F64,
    FLOAT64,
    INT,
    INT_DELTA,
    KIND_BITS,
    KIND_MASK,
    MILLI,
    MILLI_DELTA,
    decode_value,
)
from gpurelay.wire.varint import unzz, uvarint


class FrameDecoder:
    """Bytes to frames for one direction of one connection.

    :meth:`feed` accepts any chunking of the stream. Anything invalid raises
    :class:`WireError` (and nothing else); after that the decoder refuses further input.
    """

    def __init__(self, *, limits: Limits = DEFAULT_LIMITS) -> None:
        self._limits = limits
        self._session = ConnectionState(limits)
        self._buf = bytearray()
        self._inflater: zlib._Decompress | None = None
        self._failed: WireError | None = None

    @property
    def pending(self) -> int:
        """Bytes held of a frame not complete yet (0 between frames)."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[Frame]:
        """Buffer ``data``; return the frames it completes, in order."""
        return list(self.frames(data))

    def frames(self, data: bytes) -> Iterator[Frame]:
        """:meth:`feed`, a frame at a time: each frame is decoded when the caller asks for
        the next, so a read of many compressed DECLAREs holds one frame's objects at a
        time, not all of them (the gateway: attack W17 of issue 24, whose 64 KiB reads
        each made ~25,000 objects at once and left the heap fragmented after). A caller
        that stops early leaves the rest of ``data`` undecoded, for good."""
        if self._failed is not None:
            raise WireError(self._failed.code, f"the decoder already failed: {self._failed}")
        buf = self._buf
        buf += data
        try:
            while len(buf) >= 4:
                length = self._header(buf, 0)
                end = 4 + length
                if len(buf) < end:
                    break
                ftype = KNOWN_TYPES[buf[5]]
                payload = bytes(buf[6:end])
                del buf[:end]  # a bytearray drops its head in place
                yield self._frame(ftype, payload)
        except WireError as exc:
            self._failed = exc
            buf.clear()
            raise

    def _header(self, buf: bytearray, pos: int) -> int:
        (length,) = LENGTH.unpack_from(buf, pos)
        limit = self._limits.max_frame_bytes
        if length > limit:
            raise WireError(
                "oversize",
                f"frame of {length} bytes exceeds the limit of {limit} bytes "
                "(or the peer does not speak this protocol)",
            )
        if length < 2:
            raise WireError("malformed", f"frame length {length} is shorter than its 2-byte header")
        have = len(buf) - pos
        if have > 4 and buf[pos + 4] != PROTOCOL_VERSION:
            raise WireError(
                "version",
                f"frame protocol version {buf[pos + 4]} is not supported: "
                f"this end speaks version {PROTOCOL_VERSION}",
            )
        if have > 5 and buf[pos + 5] not in KNOWN_TYPES:
            known = ", ".join(f"{t.value} {t.name}" for t in FrameType)
            raise WireError("frame_type", f"unknown frame type {buf[pos + 5]} (known: {known})")
        return int(length)

    def _frame(self, ftype: FrameType, payload: bytes) -> Frame:
        what = ftype.name
        try:
            body = self._inflate(payload, what) if ftype in COMPRESSED else payload
            s = self._session
            if ftype is FrameType.BATCH:
                return self._batch(body)
            if ftype is FrameType.DECLARE:
                declare = parse_declare(body)
                s.check_declare(declare.series)
                s.apply_declare(declare.series)
                return declare
            if ftype is FrameType.HELLO:
                s.check_hello()
                hello = parse_hello(body)
                s.greet()
                return hello
            if ftype is FrameType.REPLAY:
                s.check_greeted("REPLAY")
                seq, pos = uvarint(body, 0)
                if seq > MAX_SEQ:
                    raise WireError("malformed", f"REPLAY seq {seq} is not in 0..2**63-1")
                return Replay(seq=seq, record=body[pos:])
            if ftype is FrameType.ACK:
                return parse_ack(body)
            if ftype is FrameType.ACK_RANGES:
                return parse_ack_ranges(body)
            if ftype is FrameType.HEARTBEAT:
                return parse_heartbeat(body)
            if ftype is FrameType.ERROR:
                return parse_error(body)
            return parse_goodbye(body)
        except (IndexError, struct.error) as exc:
            raise WireError("malformed", f"{what} frame ends in the middle of a field") from exc
        except zlib.error as exc:
            raise WireError("malformed", f"{what} frame is not valid deflate data ({exc})") from exc
        except (ValueError, ArithmeticError, RecursionError, TypeError) as exc:
            raise WireError("malformed", f"{what} frame is malformed ({exc!r})") from exc

    def _inflate(self, payload: bytes, what: str) -> bytes:
        if self._inflater is None:
            self._inflater = zlib.decompressobj(-WINDOW_BITS)
        inflater, limit = self._inflater, self._limits.max_frame_bytes
        body = inflater.decompress(payload + SYNC_TAIL, limit + 1)
        if len(body) > limit or inflater.unconsumed_tail:
            raise WireError("oversize", f"{what} frame inflates to more than {limit} bytes")
        if inflater.eof:
            raise WireError("malformed", f"{what} frame closed the connection's deflate stream")
        return body

    def _batch(self, body: bytes) -> Batch:
        s = self._session
        s.check_greeted("BATCH")
        flags = body[0]
        if flags > 1:
            raise WireError("malformed", f"BATCH flags {flags:#x} are not known")
        u, pos = uvarint(body, 1)
        seq = (s.seq or 0) + unzz(u)
        if not 0 <= seq <= MAX_SEQ:
            raise WireError("malformed", f"BATCH seq {seq} is not in 0..2**63-1")
        s.check_seq(seq)
        u, pos = uvarint(body, pos)
        ts_ms = s.ts_ms + unzz(u)
        if abs(ts_ms) >= MAX_TIMESTAMP_MS:
            raise WireError("malformed", f"BATCH seq {seq} timestamp {ts_ms} ms is out of range")
        removed, pos = read_removed(body, pos, s, seq)
        values, pos = read_values(body, pos, s, seq)
        if pos != len(body):
            raise WireError("malformed", f"BATCH seq {seq} has {len(body) - pos} bytes left over")
        if flags:
            s.check_full(seq, len(values), len(s.last))
        s.seq, s.ts_ms = seq, ts_ms
        return Batch(
            seq=seq,
            timestamp=ts_ms / 1000,
            values=tuple(values),
            removed=tuple(removed),
            full=bool(flags),
        )


def read_count(body: bytes, pos: int, seq: int, what: str) -> tuple[int, int]:
    count, pos = uvarint(body, pos)
    if count > len(body) - pos:  # every entry takes at least one byte
        raise WireError("malformed", f"BATCH seq {seq} claims {count} {what}, more than fit")
    return count, pos


def read_removed(body: bytes, pos: int, s: ConnectionState, seq: int) -> tuple[list[int], int]:
    count, pos = read_count(body, pos, seq, "removals")
    removed: list[int] = []
    sid = -1
    for _ in range(count):
        u, pos = uvarint(body, pos)
        sid += u + 1
        if sid not in s.last:
            raise s.unknown(sid, seq)
        removed.append(sid)
    for sid in removed:
        s.remove(sid)
    return removed, pos


def read_heads(
    body: bytes, pos: int, s: ConnectionState, seq: int
) -> tuple[list[int], list[int], int]:
    """The head column of a BATCH: every entry's series id and value kind."""
    count, pos = read_count(body, pos, seq, "values")
    last = s.last
    sids: list[int] = []
    kinds: list[int] = []
    add_sid, add_kind = sids.append, kinds.append
    sid = -1
    for _ in range(count):
        u = body[pos]
        if u < 0x80:
            pos += 1
        elif (b := body[pos + 1]) < 0x80:  # two bytes, the other common size
            u = (u & 0x7F) | (b << 7)
            pos += 2
        else:
            u, pos = uvarint(body, pos)
        sid += (u >> KIND_BITS) + 1
        if sid not in last:
            raise s.unknown(sid, seq)
        add_sid(sid)
        add_kind(u & KIND_MASK)
    return sids, kinds, pos


def read_values(
    body: bytes, pos: int, s: ConnectionState, seq: int
) -> tuple[list[tuple[int, float]], int]:
    """The head column, then the value column; the hot loop of the gateway.

    One loop per column with everything in locals; the common kinds (INT, MILLI and
    their deltas from a finite previous value, FLOAT64) are decoded inline, anything else
    (KIBI, a delta without a usable base, an unknown kind) by :func:`decode_value`, which
    also words the errors. The result is bit for bit what ``decode_value`` gives.
    """
    sids, kinds, pos = read_heads(body, pos, s, seq)
    last = s.last
    values: list[tuple[int, float]] = []
    add = values.append
    unpack = F64.unpack_from
    v: float
    for sid, kind in zip(sids, kinds, strict=True):
        if kind == FLOAT64:
            (v,) = unpack(body, pos)
            pos += 8
        else:
            u = body[pos]
            if u < 0x80:
                pos += 1
            elif (b := body[pos + 1]) < 0x80:
                u = (u & 0x7F) | (b << 7)
                pos += 2
            elif (c := body[pos + 2]) < 0x80:
                u = (u & 0x7F) | ((b & 0x7F) << 7) | (c << 14)
                pos += 3
            else:
                u, pos = uvarint(body, pos)
            n = (u >> 1) ^ -(u & 1)
            if kind == INT_DELTA:  # the most common kind by far, then MILLI_DELTA
                prev = last[sid]
                if prev is not None and prev - prev == 0.0:  # finite: int_base
                    v = float(int(prev) + n)
                else:
                    v = decode_value(kind, n, prev, sid)
            elif kind == MILLI_DELTA:
                prev = last[sid]
                if prev is not None and (scaled := prev * 1000) - scaled == 0.0:  # milli_base
                    v = (round(scaled) + n) / 1000
                else:
                    v = decode_value(kind, n, prev, sid)
            elif kind == INT:
                v = float(n)
            elif kind == MILLI:
                v = n / 1000
            else:
                v = decode_value(kind, n, last[sid], sid)
        last[sid] = v
        add((sid, v))
    return values, pos
