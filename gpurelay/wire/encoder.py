"""Frames to bytes for one direction of one connection."""

from __future__ import annotations

import zlib
from collections.abc import Callable

from gpurelay.wire.ackranges import encode_ack_ranges
from gpurelay.wire.frames import (
    COMPRESSED,
    DEFAULT_LIMITS,
    HEADER,
    MAX_SEQ,
    PROTOCOL_VERSION,
    SYNC_TAIL,
    WINDOW_BITS,
    Ack,
    AckRanges,
    Batch,
    Declare,
    ErrorFrame,
    Frame,
    FrameType,
    Goodbye,
    Heartbeat,
    Hello,
    Limits,
    Replay,
    WireError,
)
from gpurelay.wire.payloads import check_text, declare_json, dump_json, hello_json, parse_hello
from gpurelay.wire.rules import show
from gpurelay.wire.session import ConnectionState
from gpurelay.wire.values import KIND_BITS, put_value, timestamp_ms
from gpurelay.wire.varint import put, zz


def by_id(entry: tuple[int, float]) -> int:
    return entry[0]


class FrameEncoder:
    """Frames to bytes for one direction of one connection.

    Refuses (with :class:`WireError`, state unchanged) any frame the peer's decoder would
    reject, so a bug on this side is found here rather than by the gateway.
    """

    def __init__(self, *, limits: Limits = DEFAULT_LIMITS) -> None:
        self._limits = limits
        self._session = ConnectionState(limits)
        self._deflater: zlib._Compress | None = None  # made on first use: ACKs need none
        self._broken: WireError | None = None

    def encode(self, frame: Frame) -> bytes:
        """One complete frame, length prefix included."""
        if self._broken is not None:
            raise WireError(self._broken.code, f"the encoder is unusable: {self._broken}")
        ftype, body, commit = self._body(frame)
        limit = self._limits.max_frame_bytes
        if len(body) + 2 > limit:
            raise WireError(
                "oversize",
                f"{ftype.name} frame of {len(body) + 2} bytes exceeds the limit of {limit} bytes",
            )
        payload = self._compress(body) if ftype in COMPRESSED else body
        if len(payload) + 2 > limit:  # deflate grew it: the stream has it, so stop here
            self._broken = WireError(
                "oversize", f"compressed {ftype.name} frame exceeds the limit of {limit} bytes"
            )
            raise self._broken
        if commit is not None:
            commit()
        return HEADER.pack(len(payload) + 2, PROTOCOL_VERSION, ftype) + payload

    def _compress(self, body: bytes) -> bytes:
        if self._deflater is None:
            self._deflater = zlib.compressobj(6, zlib.DEFLATED, -WINDOW_BITS, 8)
        out = self._deflater.compress(body) + self._deflater.flush(zlib.Z_SYNC_FLUSH)
        return out[: -len(SYNC_TAIL)]  # a sync flush always ends with this; the peer adds it

    def _body(self, frame: Frame) -> tuple[FrameType, bytes, Callable[[], None] | None]:
        s = self._session
        try:
            if isinstance(frame, Batch):
                body, commit = self._batch(frame)
                return FrameType.BATCH, body, commit
            if isinstance(frame, Declare):
                series = tuple(frame.series)
                s.check_declare(series)
                return (
                    FrameType.DECLARE,
                    dump_json(declare_json(frame)),
                    lambda: s.apply_declare(series),
                )
            if isinstance(frame, Hello):
                s.check_hello()
                body = dump_json(hello_json(frame))
                parse_hello(body)  # the same checks the gateway makes, once per connection
                return FrameType.HELLO, body, s.greet
            if isinstance(frame, Replay):
                s.check_greeted("REPLAY")
                if type(frame.seq) is not int or not 0 <= frame.seq <= MAX_SEQ:
                    raise WireError("malformed", f"REPLAY seq {show(frame.seq)} is out of range")
                if not isinstance(frame.record, bytes):
                    raise WireError("malformed", "REPLAY record is not bytes")
                out = bytearray()
                put(out, frame.seq)
                return FrameType.REPLAY, bytes(out) + frame.record, None
            if isinstance(frame, Ack):
                if type(frame.seq) is not int or not 0 <= frame.seq <= MAX_SEQ:
                    raise WireError("malformed", f"ACK seq {show(frame.seq)} is out of range")
                out = bytearray()
                put(out, frame.seq)
                return FrameType.ACK, bytes(out), None
            if isinstance(frame, AckRanges):
                return FrameType.ACK_RANGES, encode_ack_ranges(frame), None
            if isinstance(frame, Heartbeat):
                received = frame.received
                if type(received) is not int or not 0 <= received <= MAX_SEQ:
                    raise WireError("malformed", f"HEARTBEAT seq {show(received)} is out of range")
                out = bytearray()
                put(out, received)
                return FrameType.HEARTBEAT, bytes(out), None
            if isinstance(frame, ErrorFrame):
                check_text(frame.code, "ERROR code")
                check_text(frame.message, "ERROR message")
                body = dump_json({"code": frame.code, "message": frame.message})
                return FrameType.ERROR, body, None
            if isinstance(frame, Goodbye):
                check_text(frame.reason, "GOODBYE reason")
                return FrameType.GOODBYE, dump_json({"reason": frame.reason}), None
        except (ValueError, ArithmeticError, TypeError, AttributeError, RecursionError) as exc:
            raise WireError("malformed", f"cannot encode {type(frame).__name__}: {exc}") from exc
        raise WireError("malformed", f"{type(frame).__name__} is not a frame type")

    def _batch(self, batch: Batch) -> tuple[bytes, Callable[[], None]]:
        s = self._session
        s.check_greeted("BATCH")
        seq = batch.seq
        if type(seq) is not int or not 0 <= seq <= MAX_SEQ:
            raise WireError("malformed", f"BATCH seq {show(seq)} is not an integer in 0..2**63-1")
        s.check_seq(seq)
        ts_ms = timestamp_ms(batch.timestamp)
        last = s.last
        removed = sorted(batch.removed)
        out = bytearray((1 if batch.full else 0,))
        put(out, zz(seq - (s.seq or 0)))
        put(out, zz(ts_ms - s.ts_ms))
        put(out, len(removed))
        prev = -1
        for sid in removed:
            if type(sid) is not int or sid not in last:
                raise s.unknown(sid, seq)
            if sid == prev:
                raise WireError("malformed", f"BATCH seq {seq} removes series {sid} twice")
            put(out, sid - prev - 1)
            prev = sid
        gone = set(removed)
        entries = sorted(batch.values, key=by_id)
        put(out, len(entries))
        column = bytearray()
        sent: list[tuple[int, float]] = []
        prev = -1
        for sid, value in entries:
            if type(sid) is not int or sid not in last or sid in gone:
                raise s.unknown(sid, seq)
            if sid == prev:
                raise WireError("malformed", f"BATCH seq {seq} lists series {sid} twice")
            v = value if type(value) is float else as_float(value, seq, sid)
            put(out, (sid - prev - 1) << KIND_BITS | put_value(column, v, last[sid]))
            sent.append((sid, v))
            prev = sid
        if batch.full:
            s.check_full(seq, len(entries), len(last) - len(removed))
        out += column

        def commit() -> None:
            for sid in removed:
                s.remove(sid)
            last.update(sent)
            s.seq, s.ts_ms = seq, ts_ms

        return bytes(out), commit


def as_float(value: object, seq: int, sid: int) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    raise WireError(
        "malformed", f"BATCH seq {seq}: value {show(value)} of series {sid} is not a number"
    )
