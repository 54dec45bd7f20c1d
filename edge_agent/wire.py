"""The wire contract between agent and gateway: frame types and their codec.

This is the only module that knows the byte layout; both sides import it. It is pure:
no sockets, no clocks. One :class:`FrameEncoder` and one :class:`FrameDecoder` exist per
direction of one connection: they keep that connection's compression stream, the series
it declared and the last value sent for each, so both ends must see the same frames in
the same order (they do: one SSH channel).

Frame: ``u32 length (big endian) | u8 version | u8 type | payload``; ``length`` counts
version, type and payload and is at most ``Limits.max_frame_bytes``.

Payloads (``uvarint``: LEB128, at most 10 bytes; ``zz``: zig-zag, so small negatives
stay short):

- HELLO, DECLARE, BATCH travel *compressed*: one raw-deflate stream (window 2**15) per
  connection and direction, flushed with ``Z_SYNC_FLUSH`` after every frame and with the
  flush's constant ``00 00 ff ff`` tail left off (the decoder puts it back, as RFC 7692
  does). Structure repeated across frames (label sets, unchanged series ids) costs almost
  nothing. A payload may inflate to at most ``max_frame_bytes``.
- ACK, ERROR, GOODBYE travel uncompressed (tiny, and an ERROR must always be readable),
  and so does REPLAY (its record is compressed already).
- HELLO: compact UTF-8 JSON ``{"agent_version", "node", "domain", "backend",
  "driver_version", "hostname", "interval_seconds", "gpus": [GpuInventory fields]}``.
- DECLARE: JSON ``{"series": [{"id", "name", "type", "help", "labels": [[k, v], ...]}]}``.
- ERROR: JSON ``{"code", "message"}``. GOODBYE: JSON ``{"reason"}``. ACK: ``uvarint seq``
  (that one batch or replay is safely taken: applied, and accepted by remote write if on).
- REPLAY: ``uvarint seq | record`` (:mod:`edge_agent.record`): a spooled collection, sent
  again after a reconnect, in any order relative to BATCH frames; its seq is not checked
  against the connection's BATCH order (the receiver dedupes seqs instead).
- BATCH::

      u8       flags                   bit 0: full; other bits 0
      uvarint  zz(seq - previous seq)  (0 before the first batch of the connection)
      uvarint  zz(ms - previous ms)    timestamp in unix milliseconds, same base rule
      uvarint  R, then R x uvarint     removed ids, ascending: id - previous id - 1
      uvarint  N, then N x uvarint     value heads, ids ascending: (id - prev - 1) << 3 | kind
      N values, in head order, each as its kind says:
        0 INT          uvarint zz(v)                     v integral
        1 INT_DELTA    uvarint zz(v - int(p))            p: this series' previous value
        2 MILLI        uvarint zz(v * 1000)              v * 1000 integral (watts from mW)
        3 MILLI_DELTA  uvarint zz(v*1000 - round(p*1000))
        4 KIBI         uvarint zz(v / 1024)              v a multiple of 1024 (bytes from KiB)
        5 KIBI_DELTA   uvarint zz(v/1024 - int(p) // 1024)
        6 FLOAT64      8 bytes IEEE 754 big endian       anything else (NaN, inf, -0.0)
        7 (reserved)

  "Previous value" is the last value sent for the series on this connection; the encoder
  picks the shortest exact kind, so every value round-trips bit for bit. Heads and values
  are separate columns so that the heads, which repeat from batch to batch, compress away.

Rules both ends enforce (the encoder refuses to send what the decoder would reject):
HELLO first and once; series ids in 0..2**32-1, never declared twice on a connection;
values and removals only for live series; ``seq`` increasing on a connection; a full
batch lists every live series. Errors are :class:`WireError` with a stable ``code``.
"""

from __future__ import annotations

import json
import math
import re
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from enum import IntEnum
from typing import Any, Final, NoReturn

from edge_agent.model import GpuInventory, Labels, MetricType

PROTOCOL_VERSION = 1


class FrameType(IntEnum):
    HELLO = 1  # agent -> gateway, first frame
    DECLARE = 2  # agent -> gateway: new series (id -> name, type, help, labels)
    BATCH = 3  # agent -> gateway: values by series id
    ACK = 4  # gateway -> agent: batches up to seq are applied
    ERROR = 5  # either way: a clear error; the sender closes the connection after it
    GOODBYE = 6  # gateway -> agent: shutting down, reconnect later
    REPLAY = 7  # agent -> gateway: one spooled collection, self-contained (edge_agent.record)


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    max_frame_bytes: int = 4 * 1024 * 1024
    max_series: int = 50_000  # per connection (node)
    max_labels: int = 32  # per series
    max_name_bytes: int = 200  # metric and label names
    max_label_value_bytes: int = 2048
    max_help_bytes: int = 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class Hello:
    agent_version: str
    node: str  # what the agent calls itself; the gateway uses the certificate principal
    domain: str = ""
    backend: str = ""  # "nvml" or "simulated"
    driver_version: str = ""
    hostname: str = ""
    interval_seconds: float = 10.0
    gpus: tuple[GpuInventory, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class SeriesDecl:
    id: int  # >= 0, unique within a connection
    name: str
    type: MetricType
    help: str
    labels: Labels


@dataclass(frozen=True, slots=True, kw_only=True)
class Declare:
    series: tuple[SeriesDecl, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Batch:
    seq: int  # strictly increasing per agent (survives reconnects)
    timestamp: float  # unix seconds when the values were collected
    # Only values that changed since the previous batch on this connection; a series
    # not listed keeps its previous value. The first batch after DECLARE lists all.
    values: tuple[tuple[int, float], ...]
    removed: tuple[int, ...] = ()  # series that no longer exist (ids may not be reused)
    full: bool = False  # True when `values` lists every live series


@dataclass(frozen=True, slots=True, kw_only=True)
class Replay:
    """A collection from the agent's spool, sent again (after an outage or a lost ACK).

    Self-contained: ``record`` is an :mod:`edge_agent.record` byte string, decoded by the
    receiver with :func:`edge_agent.record.decode_record`. Not ordered with BATCH frames or
    with each other; ``seq`` is the one the collection got when it was taken."""

    seq: int
    record: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class Ack:
    seq: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ErrorFrame:
    code: str
    message: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Goodbye:
    reason: str


Frame = Hello | Declare | Batch | Replay | Ack | ErrorFrame | Goodbye


class WireError(Exception):
    """A frame that breaks the contract. ``code`` is stable and used as a metric label:
    ``version``, ``frame_type``, ``oversize``, ``malformed``, ``too_many_series``,
    ``too_many_labels``, ``bad_name``, ``bad_label``, ``unknown_series``, ``order``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


MAX_SERIES_ID: Final = 2**32 - 1
_MAX_SEQ: Final = 2**63 - 1
_MAX_TIMESTAMP_MS: Final = 2**63
_MAX_VARINT_BYTES: Final = 10
_HEADER: Final = struct.Struct(">IBB")
_LENGTH: Final = struct.Struct(">I")
_F64: Final = struct.Struct(">d")
_SYNC_TAIL: Final = b"\x00\x00\xff\xff"
_WINDOW_BITS: Final = 15
_COMPRESSED: Final = frozenset({FrameType.HELLO, FrameType.DECLARE, FrameType.BATCH})
_KNOWN_TYPES: Final = {t.value: t for t in FrameType}

# Value kinds of a BATCH entry (the low 3 bits of its head).
_INT, _INT_DELTA, _MILLI, _MILLI_DELTA, _KIBI, _KIBI_DELTA, _FLOAT64 = range(7)
_KIND_BITS: Final = 3
_KIND_MASK: Final = (1 << _KIND_BITS) - 1
_SHORTER_THAN_FLOAT64: Final = 1 << 56  # a uvarint below this takes at most 8 bytes

_METRIC_NAME: Final = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME: Final = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


# --- validation shared by both ends ------------------------------------------------------


def _show(text: object, limit: int = 60) -> str:
    """A peer-supplied value, quoted and shortened, for an error message."""
    if isinstance(text, str) and len(text) > limit:
        return repr(text[:limit] + "...")
    return repr(text)


def _utf8_size(text: str, code: str, what: str) -> int:
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise WireError(code, f"{what} is not valid Unicode text ({exc.reason})") from exc


def check_series(decl: SeriesDecl, limits: Limits) -> None:
    """Raise :class:`WireError` unless ``decl`` is a declaration the gateway will accept."""
    sid = decl.id
    if type(sid) is not int or not 0 <= sid <= MAX_SERIES_ID:
        raise WireError(
            "malformed", f"series id {_show(sid)} is not an integer in 0..{MAX_SERIES_ID}"
        )
    name = decl.name
    if not isinstance(name, str) or _METRIC_NAME.fullmatch(name) is None:
        raise WireError(
            "bad_name",
            f"series {sid}: metric name {_show(name)} is not valid "
            "(it must match [a-zA-Z_:][a-zA-Z0-9_:]*)",
        )
    if len(name) > limits.max_name_bytes:
        raise WireError(
            "bad_name",
            f"series {sid}: metric name {_show(name)} is {len(name)} bytes long, "
            f"more than the limit of {limits.max_name_bytes}",
        )
    if decl.type not in ("gauge", "counter"):
        raise WireError(
            "malformed", f"series {sid} ({name}): type {_show(decl.type)} is not gauge or counter"
        )
    if not isinstance(decl.help, str):
        raise WireError("malformed", f"series {sid} ({name}): help is not a string")
    size = _utf8_size(decl.help, "malformed", f"series {sid} ({name}): help")
    if size > limits.max_help_bytes:
        raise WireError(
            "malformed",
            f"series {sid} ({name}): help is {size} bytes long, "
            f"more than the limit of {limits.max_help_bytes}",
        )
    _check_labels(sid, name, decl.labels, limits)


def _check_labels(sid: int, name: str, labels: Labels, limits: Limits) -> None:
    where = f"series {sid} ({name})"
    if not isinstance(labels, tuple):
        raise WireError("malformed", f"{where}: labels are not a sequence of (name, value) pairs")
    if len(labels) > limits.max_labels:
        raise WireError(
            "too_many_labels",
            f"{where} has {len(labels)} labels, more than the limit of {limits.max_labels}",
        )
    seen: set[str] = set()
    for pair in labels:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise WireError(
                "malformed", f"{where}: label {_show(pair)} is not a (name, value) pair"
            )
        label, value = pair
        if (
            not isinstance(label, str)
            or _LABEL_NAME.fullmatch(label) is None
            or label.startswith("__")
        ):
            raise WireError(
                "bad_label",
                f"{where}: label name {_show(label)} is not valid (it must match "
                "[a-zA-Z_][a-zA-Z0-9_]* and not start with __, which Prometheus reserves)",
            )
        if len(label) > limits.max_name_bytes:
            raise WireError(
                "bad_label",
                f"{where}: label name {_show(label)} is {len(label)} bytes long, "
                f"more than the limit of {limits.max_name_bytes}",
            )
        if label in seen:
            raise WireError("bad_label", f"{where}: label {label} is given twice")
        seen.add(label)
        if not isinstance(value, str):
            raise WireError("bad_label", f"{where}: the value of label {label} is not a string")
        size = _utf8_size(value, "bad_label", f"{where}: the value of label {label}")
        if size > limits.max_label_value_bytes:
            raise WireError(
                "bad_label",
                f"{where}: the value of label {label} is {size} bytes long, "
                f"more than the limit of {limits.max_label_value_bytes}",
            )


class _Session:
    """What both ends know about one connection: live series and the batch position."""

    __slots__ = ("greeted", "last", "limits", "retired", "seq", "ts_ms")

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.greeted = False
        self.last: dict[int, float | None] = {}  # live series -> last value sent, if any
        self.retired: set[int] = set()  # removed series: their ids may not come back
        self.seq: int | None = None
        self.ts_ms = 0

    def check_hello(self) -> None:
        if self.greeted:
            raise WireError("order", "HELLO may be sent only once, as the first frame")

    def greet(self) -> None:
        self.greeted = True

    def check_greeted(self, what: str) -> None:
        if not self.greeted:
            raise WireError("order", f"{what} before HELLO: HELLO must be the first frame")

    def check_declare(self, series: Sequence[SeriesDecl]) -> None:
        self.check_greeted("DECLARE")
        limit, total = self.limits.max_series, len(self.last) + len(series)
        if total > limit:
            raise WireError(
                "too_many_series",
                f"DECLARE of {len(series)} series would make {total} live series on this "
                f"connection, more than the limit of {limit}",
            )
        fresh: set[int] = set()
        for decl in series:
            check_series(decl, self.limits)
            if decl.id in self.last or decl.id in self.retired or decl.id in fresh:
                raise WireError(
                    "malformed",
                    f"series id {decl.id} ({decl.name}) is already declared on this "
                    "connection; ids may not be reused",
                )
            fresh.add(decl.id)

    def apply_declare(self, series: Sequence[SeriesDecl]) -> None:
        for decl in series:
            self.last[decl.id] = None

    def check_seq(self, seq: int) -> None:
        if self.seq is not None and seq <= self.seq:
            raise WireError(
                "order",
                f"BATCH seq {seq} does not follow seq {self.seq}: "
                "sequence numbers must increase on a connection",
            )

    def unknown(self, sid: int, seq: int) -> WireError:
        why = "was removed" if sid in self.retired else "was never declared"
        return WireError(
            "unknown_series",
            f"BATCH seq {seq} refers to series {sid}, which {why} on this connection",
        )

    def check_full(self, seq: int, listed: int, live: int) -> None:
        if listed != live:
            raise WireError(
                "malformed",
                f"BATCH seq {seq} is marked full but lists {listed} of the {live} live series",
            )

    def remove(self, sid: int) -> None:
        del self.last[sid]
        self.retired.add(sid)


# --- varints -------------------------------------------------------------------------------


def _zz(n: int) -> int:
    return n << 1 if n >= 0 else ((-n) << 1) - 1


def _unzz(u: int) -> int:
    return (u >> 1) ^ -(u & 1)


def _put(out: bytearray, u: int) -> None:
    while u > 0x7F:
        out.append((u & 0x7F) | 0x80)
        u >>= 7
    out.append(u)


def _uvarint(buf: bytes, pos: int) -> tuple[int, int]:
    """Read one uvarint at ``pos``; return it and the position after it."""
    result = shift = 0
    for i in range(pos, pos + _MAX_VARINT_BYTES):
        byte = buf[i]  # IndexError: the frame ends early (translated at the boundary)
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, i + 1
        shift += 7
    raise WireError("malformed", f"a varint at byte {pos} is longer than {_MAX_VARINT_BYTES} bytes")


def _int_base(prev: float | None) -> int | None:
    """What an INT_DELTA or KIBI_DELTA adds to: the previous value, truncated."""
    return int(prev) if prev is not None and math.isfinite(prev) else None


def _milli_base(prev: float | None) -> int | None:
    """What a MILLI_DELTA adds to: the previous value in thousandths, rounded."""
    if prev is None:
        return None
    scaled = prev * 1000
    return round(scaled) if math.isfinite(scaled) else None


def _put_value(out: bytearray, v: float, prev: float | None) -> int:
    """Append the shortest exact encoding of ``v``; return its kind.

    Each candidate is an integer that the decoder turns back into exactly ``v`` (integer
    arithmetic, at most one correctly rounded division); the smallest zig-zag, so the
    shortest varint, wins. Deltas add to a base that both ends compute the same way.
    """
    if v.is_integer():  # finite and integral
        if v == 0.0 and math.copysign(1.0, v) < 0:
            out += _F64.pack(v)
            return _FLOAT64
        n = int(v)
        kind, u = _INT, _zz(n)
        base = _int_base(prev)
        if base is not None and (d := _zz(n - base)) < u:
            kind, u = _INT_DELTA, d
        if n & 1023 == 0 and n:
            if (d := _zz(n >> 10)) < u:
                kind, u = _KIBI, d
            if base is not None and (d := _zz((n >> 10) - (base >> 10))) < u:
                kind, u = _KIBI_DELTA, d
        if u < _SHORTER_THAN_FLOAT64:
            _put(out, u)
            return kind
    elif math.isfinite(v):  # not integral, so |v| < 2**52 and v * 1000 cannot overflow
        m = round(v * 1000)
        if m / 1000 == v:
            kind, u = _MILLI, _zz(m)
            base = _milli_base(prev)
            if base is not None and (d := _zz(m - base)) < u:
                kind, u = _MILLI_DELTA, d
            if u < _SHORTER_THAN_FLOAT64:
                _put(out, u)
                return kind
    out += _F64.pack(v)
    return _FLOAT64


def _timestamp_ms(timestamp: float) -> int:
    if isinstance(timestamp, bool) or not isinstance(timestamp, int | float):
        raise WireError("malformed", f"BATCH timestamp {_show(timestamp)} is not a number")
    if not math.isfinite(timestamp) or abs(timestamp) * 1000 >= _MAX_TIMESTAMP_MS:
        raise WireError("malformed", f"BATCH timestamp {timestamp!r} is not a usable time")
    return round(timestamp * 1000)


# --- JSON payloads ---------------------------------------------------------------------------


def _json(obj: object) -> bytes:
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return text.encode("utf-8")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise WireError("malformed", "a JSON object in the frame repeats a key")
    return obj


def _no_constant(name: str) -> NoReturn:
    raise WireError("malformed", f"{name} is not allowed in a frame's JSON")


def _load_json(body: bytes, what: str) -> object:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise WireError("malformed", f"{what} payload is not UTF-8 ({exc.reason})") from exc
    try:
        return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise WireError("malformed", f"{what} payload is not valid JSON ({exc})") from exc


class _Obj:
    """Strict, typed access to one JSON object of a frame; every miss is ``malformed``."""

    def __init__(self, value: object, where: str) -> None:
        if not isinstance(value, dict):
            raise WireError("malformed", f"{where} is not a JSON object")
        self._d: dict[str, Any] = value
        self._where = where
        self._seen: set[str] = set()

    def _get(self, key: str, required: bool) -> Any:
        self._seen.add(key)
        if key not in self._d and required:
            raise WireError("malformed", f"{self._where} lacks the field {key!r}")
        return self._d.get(key)

    def _bad(self, key: str, what: str) -> WireError:
        return WireError("malformed", f"{self._where}: field {key!r} must be {what}")

    def text(self, key: str, default: str | None = None) -> str:
        value = self._get(key, default is None)
        if value is None and default is not None:
            return default
        if not isinstance(value, str):
            raise self._bad(key, "a string")
        _utf8_size(value, "malformed", f"{self._where}: field {key!r}")
        return value

    def count(self, key: str) -> int:
        value = self._get(key, True)
        if type(value) is not int or value < 0:
            raise self._bad(key, "a non-negative integer")
        return value

    def number(self, key: str, default: float) -> float:
        value = self._get(key, False)
        if value is None:
            return default
        if type(value) not in (int, float) or not math.isfinite(value):
            raise self._bad(key, "a finite number")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self._get(key, False)
        if value is None:
            return default
        if type(value) is not bool:
            raise self._bad(key, "true or false")
        return value

    def array(self, key: str, required: bool = True) -> list[Any]:
        value = self._get(key, required)
        if value is None and not required:
            return []
        if not isinstance(value, list):
            raise self._bad(key, "a list")
        return value

    def done(self) -> None:
        unknown = sorted(set(self._d) - self._seen)
        if unknown:
            raise WireError("malformed", f"{self._where} has unknown field(s) {unknown}")


def _hello_json(hello: Hello) -> dict[str, Any]:
    return {
        "agent_version": hello.agent_version,
        "node": hello.node,
        "domain": hello.domain,
        "backend": hello.backend,
        "driver_version": hello.driver_version,
        "hostname": hello.hostname,
        "interval_seconds": hello.interval_seconds,
        "gpus": [
            {f.name: getattr(gpu, f.name) for f in fields(GpuInventory)} for gpu in hello.gpus
        ],
    }


def _parse_gpu(value: object, i: int) -> GpuInventory:
    o = _Obj(value, f"HELLO gpus[{i}]")
    gpu = GpuInventory(
        index=o.count("index"),
        uuid=o.text("uuid"),
        name=o.text("name"),
        pci_bus_id=o.text("pci_bus_id"),
        minor=o.count("minor"),
        memory_total_bytes=o.count("memory_total_bytes"),
        memory_used_bytes=o.count("memory_used_bytes"),
        mig_enabled=o.flag("mig_enabled", False),
        healthy=o.flag("healthy", True),
    )
    o.done()
    return gpu


def _parse_hello(body: bytes) -> Hello:
    o = _Obj(_load_json(body, "HELLO"), "HELLO")
    hello = Hello(
        agent_version=o.text("agent_version"),
        node=o.text("node"),
        domain=o.text("domain", ""),
        backend=o.text("backend", ""),
        driver_version=o.text("driver_version", ""),
        hostname=o.text("hostname", ""),
        interval_seconds=o.number("interval_seconds", 10.0),
        gpus=tuple(_parse_gpu(g, i) for i, g in enumerate(o.array("gpus", required=False))),
    )
    o.done()
    if hello.interval_seconds <= 0:
        raise WireError("malformed", "HELLO: field 'interval_seconds' must be positive")
    return hello


def _declare_json(declare: Declare) -> dict[str, Any]:
    return {
        "series": [
            {
                "id": d.id,
                "name": d.name,
                "type": d.type,
                "help": d.help,
                "labels": [list(pair) for pair in d.labels],
            }
            for d in declare.series
        ]
    }


def _parse_decl(value: object, i: int) -> SeriesDecl:
    o = _Obj(value, f"DECLARE series[{i}]")
    labels: list[tuple[str, str]] = []
    for pair in o.array("labels"):
        if not (isinstance(pair, list) and len(pair) == 2):
            raise WireError("malformed", f"DECLARE series[{i}]: label {_show(pair)} is not a pair")
        labels.append((pair[0], pair[1]))
    decl = SeriesDecl(
        id=o.count("id"),
        name=o.text("name"),
        type=o.text("type"),  # type: ignore[arg-type]  # checked by check_series
        help=o.text("help"),
        labels=tuple(labels),
    )
    o.done()
    return decl


def _parse_declare(body: bytes) -> Declare:
    o = _Obj(_load_json(body, "DECLARE"), "DECLARE")
    items = o.array("series")
    o.done()
    return Declare(series=tuple(_parse_decl(item, i) for i, item in enumerate(items)))


def _parse_error(body: bytes) -> ErrorFrame:
    o = _Obj(_load_json(body, "ERROR"), "ERROR")
    frame = ErrorFrame(code=o.text("code"), message=o.text("message"))
    o.done()
    return frame


def _parse_goodbye(body: bytes) -> Goodbye:
    o = _Obj(_load_json(body, "GOODBYE"), "GOODBYE")
    frame = Goodbye(reason=o.text("reason"))
    o.done()
    return frame


def _parse_ack(body: bytes) -> Ack:
    seq, end = _uvarint(body, 0)
    if end != len(body) or seq > _MAX_SEQ:
        raise WireError("malformed", "ACK payload is not one sequence number")
    return Ack(seq=seq)


def _check_text(value: object, what: str) -> None:
    if not isinstance(value, str):
        raise WireError("malformed", f"{what} is not a string")


# --- the codec -------------------------------------------------------------------------------


def _first(entry: tuple[int, float]) -> int:
    return entry[0]


class FrameEncoder:
    """Frames to bytes for one direction of one connection.

    Refuses (with :class:`WireError`, state unchanged) any frame the peer's decoder would
    reject, so a bug on this side is found here rather than by the gateway.
    """

    def __init__(self, *, limits: Limits = Limits()) -> None:
        self._limits = limits
        self._session = _Session(limits)
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
        payload = self._compress(body) if ftype in _COMPRESSED else body
        if len(payload) + 2 > limit:  # deflate grew it: the stream has it, so stop here
            self._broken = WireError(
                "oversize", f"compressed {ftype.name} frame exceeds the limit of {limit} bytes"
            )
            raise self._broken
        if commit is not None:
            commit()
        return _HEADER.pack(len(payload) + 2, PROTOCOL_VERSION, ftype) + payload

    def _compress(self, body: bytes) -> bytes:
        if self._deflater is None:
            self._deflater = zlib.compressobj(6, zlib.DEFLATED, -_WINDOW_BITS, 8)
        out = self._deflater.compress(body) + self._deflater.flush(zlib.Z_SYNC_FLUSH)
        return out[: -len(_SYNC_TAIL)]  # a sync flush always ends with this; the peer adds it

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
                    _json(_declare_json(frame)),
                    lambda: s.apply_declare(series),
                )
            if isinstance(frame, Hello):
                s.check_hello()
                body = _json(_hello_json(frame))
                _parse_hello(body)  # the same checks the gateway makes, once per connection
                return FrameType.HELLO, body, s.greet
            if isinstance(frame, Replay):
                s.check_greeted("REPLAY")
                if type(frame.seq) is not int or not 0 <= frame.seq <= _MAX_SEQ:
                    raise WireError("malformed", f"REPLAY seq {_show(frame.seq)} is out of range")
                if not isinstance(frame.record, bytes):
                    raise WireError("malformed", "REPLAY record is not bytes")
                out = bytearray()
                _put(out, frame.seq)
                return FrameType.REPLAY, bytes(out) + frame.record, None
            if isinstance(frame, Ack):
                if type(frame.seq) is not int or not 0 <= frame.seq <= _MAX_SEQ:
                    raise WireError("malformed", f"ACK seq {_show(frame.seq)} is out of range")
                out = bytearray()
                _put(out, frame.seq)
                return FrameType.ACK, bytes(out), None
            if isinstance(frame, ErrorFrame):
                _check_text(frame.code, "ERROR code")
                _check_text(frame.message, "ERROR message")
                body = _json({"code": frame.code, "message": frame.message})
                return FrameType.ERROR, body, None
            if isinstance(frame, Goodbye):
                _check_text(frame.reason, "GOODBYE reason")
                return FrameType.GOODBYE, _json({"reason": frame.reason}), None
        except (ValueError, ArithmeticError, TypeError, AttributeError, RecursionError) as exc:
            raise WireError("malformed", f"cannot encode {type(frame).__name__}: {exc}") from exc
        raise WireError("malformed", f"{type(frame).__name__} is not a frame type")

    def _batch(self, batch: Batch) -> tuple[bytes, Callable[[], None]]:
        s = self._session
        s.check_greeted("BATCH")
        seq = batch.seq
        if type(seq) is not int or not 0 <= seq <= _MAX_SEQ:
            raise WireError("malformed", f"BATCH seq {_show(seq)} is not an integer in 0..2**63-1")
        s.check_seq(seq)
        ts_ms = _timestamp_ms(batch.timestamp)
        last = s.last
        removed = sorted(batch.removed)
        out = bytearray((1 if batch.full else 0,))
        _put(out, _zz(seq - (s.seq or 0)))
        _put(out, _zz(ts_ms - s.ts_ms))
        _put(out, len(removed))
        prev = -1
        for sid in removed:
            if type(sid) is not int or sid not in last:
                raise s.unknown(sid, seq)
            if sid == prev:
                raise WireError("malformed", f"BATCH seq {seq} removes series {sid} twice")
            _put(out, sid - prev - 1)
            prev = sid
        gone = set(removed)
        entries = sorted(batch.values, key=_first)
        _put(out, len(entries))
        column = bytearray()
        sent: list[tuple[int, float]] = []
        prev = -1
        for sid, value in entries:
            if type(sid) is not int or sid not in last or sid in gone:
                raise s.unknown(sid, seq)
            if sid == prev:
                raise WireError("malformed", f"BATCH seq {seq} lists series {sid} twice")
            v = value if type(value) is float else _as_float(value, seq, sid)
            _put(out, (sid - prev - 1) << _KIND_BITS | _put_value(column, v, last[sid]))
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


def _as_float(value: object, seq: int, sid: int) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    raise WireError(
        "malformed", f"BATCH seq {seq}: value {_show(value)} of series {sid} is not a number"
    )


class FrameDecoder:
    """Bytes to frames for one direction of one connection.

    :meth:`feed` accepts any chunking of the stream. Anything invalid raises
    :class:`WireError` (and nothing else); after that the decoder refuses further input.
    """

    def __init__(self, *, limits: Limits = Limits()) -> None:
        self._limits = limits
        self._session = _Session(limits)
        self._buf = bytearray()
        self._inflater: zlib._Decompress | None = None
        self._failed: WireError | None = None

    def feed(self, data: bytes) -> list[Frame]:
        """Buffer ``data``; return the frames it completes, in order."""
        if self._failed is not None:
            raise WireError(self._failed.code, f"the decoder already failed: {self._failed}")
        buf = self._buf
        buf += data
        frames: list[Frame] = []
        pos = 0
        try:
            while len(buf) - pos >= 4:
                length = self._header(buf, pos)
                end = pos + 4 + length
                if len(buf) < end:
                    break
                ftype = _KNOWN_TYPES[buf[pos + 5]]
                payload = bytes(buf[pos + 6 : end])
                pos = end
                frames.append(self._frame(ftype, payload))
        except WireError as exc:
            self._failed = exc
            buf.clear()
            raise
        del buf[:pos]
        return frames

    def _header(self, buf: bytearray, pos: int) -> int:
        (length,) = _LENGTH.unpack_from(buf, pos)
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
        if have > 5 and buf[pos + 5] not in _KNOWN_TYPES:
            known = ", ".join(f"{t.value} {t.name}" for t in FrameType)
            raise WireError("frame_type", f"unknown frame type {buf[pos + 5]} (known: {known})")
        return int(length)

    def _frame(self, ftype: FrameType, payload: bytes) -> Frame:
        what = ftype.name
        try:
            body = self._inflate(payload, what) if ftype in _COMPRESSED else payload
            s = self._session
            if ftype is FrameType.BATCH:
                return self._batch(body)
            if ftype is FrameType.DECLARE:
                declare = _parse_declare(body)
                s.check_declare(declare.series)
                s.apply_declare(declare.series)
                return declare
            if ftype is FrameType.HELLO:
                s.check_hello()
                hello = _parse_hello(body)
                s.greet()
                return hello
            if ftype is FrameType.REPLAY:
                s.check_greeted("REPLAY")
                seq, pos = _uvarint(body, 0)
                if seq > _MAX_SEQ:
                    raise WireError("malformed", f"REPLAY seq {seq} is not in 0..2**63-1")
                return Replay(seq=seq, record=body[pos:])
            if ftype is FrameType.ACK:
                return _parse_ack(body)
            if ftype is FrameType.ERROR:
                return _parse_error(body)
            return _parse_goodbye(body)
        except (IndexError, struct.error) as exc:
            raise WireError("malformed", f"{what} frame ends in the middle of a field") from exc
        except zlib.error as exc:
            raise WireError("malformed", f"{what} frame is not valid deflate data ({exc})") from exc
        except (ValueError, ArithmeticError, RecursionError, TypeError) as exc:
            raise WireError("malformed", f"{what} frame is malformed ({exc!r})") from exc

    def _inflate(self, payload: bytes, what: str) -> bytes:
        if self._inflater is None:
            self._inflater = zlib.decompressobj(-_WINDOW_BITS)
        inflater, limit = self._inflater, self._limits.max_frame_bytes
        body = inflater.decompress(payload + _SYNC_TAIL, limit + 1)
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
        u, pos = _uvarint(body, 1)
        seq = (s.seq or 0) + _unzz(u)
        if not 0 <= seq <= _MAX_SEQ:
            raise WireError("malformed", f"BATCH seq {seq} is not in 0..2**63-1")
        s.check_seq(seq)
        u, pos = _uvarint(body, pos)
        ts_ms = s.ts_ms + _unzz(u)
        if abs(ts_ms) >= _MAX_TIMESTAMP_MS:
            raise WireError("malformed", f"BATCH seq {seq} timestamp {ts_ms} ms is out of range")
        removed, pos = _read_removed(body, pos, s, seq)
        values, pos = _read_values(body, pos, s, seq)
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


def _read_count(body: bytes, pos: int, seq: int, what: str) -> tuple[int, int]:
    count, pos = _uvarint(body, pos)
    if count > len(body) - pos:  # every entry takes at least one byte
        raise WireError("malformed", f"BATCH seq {seq} claims {count} {what}, more than fit")
    return count, pos


def _read_removed(body: bytes, pos: int, s: _Session, seq: int) -> tuple[list[int], int]:
    count, pos = _read_count(body, pos, seq, "removals")
    removed: list[int] = []
    sid = -1
    for _ in range(count):
        u, pos = _uvarint(body, pos)
        sid += u + 1
        if sid not in s.last:
            raise s.unknown(sid, seq)
        removed.append(sid)
    for sid in removed:
        s.remove(sid)
    return removed, pos


def _read_values(
    body: bytes, pos: int, s: _Session, seq: int
) -> tuple[list[tuple[int, float]], int]:
    """The head column, then the value column; the hot loop of the gateway."""
    count, pos = _read_count(body, pos, seq, "values")
    last = s.last
    heads: list[tuple[int, int]] = []
    sid = -1
    for _ in range(count):
        u = body[pos]
        if u < 0x80:
            pos += 1
        else:
            u, pos = _uvarint(body, pos)
        sid += (u >> _KIND_BITS) + 1
        if sid not in last:
            raise s.unknown(sid, seq)
        heads.append((sid, u & _KIND_MASK))
    values: list[tuple[int, float]] = []
    for sid, kind in heads:
        if kind == _FLOAT64:
            (v,) = _F64.unpack_from(body, pos)
            pos += 8
        else:
            u = body[pos]
            if u < 0x80:
                pos += 1
            else:
                u, pos = _uvarint(body, pos)
            v = _value(kind, (u >> 1) ^ -(u & 1), last[sid], sid)
        last[sid] = v
        values.append((sid, v))
    return values, pos


def _value(kind: int, n: int, prev: float | None, sid: int) -> float:
    """The value a BATCH entry of ``kind`` with integer ``n`` stands for."""
    if kind == _INT:
        return float(n)
    if kind == _MILLI:
        return n / 1000
    if kind == _KIBI:
        return float(n << 10)
    if kind > _KIBI_DELTA:
        raise WireError("malformed", f"value kind {kind} of series {sid} is not known")
    base = _milli_base(prev) if kind == _MILLI_DELTA else _int_base(prev)
    if base is None:
        raise WireError(
            "malformed", f"series {sid} has a delta value but no finite previous value to add it to"
        )
    if kind == _INT_DELTA:
        return float(base + n)
    if kind == _MILLI_DELTA:
        return (base + n) / 1000
    return float(((base >> 10) + n) << 10)
