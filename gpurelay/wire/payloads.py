"""The JSON payloads (HELLO, DECLARE, ERROR, GOODBYE), ACK and HEARTBEAT: strict parsing, one place.

Every miss is a :class:`~gpurelay.wire.frames.WireError` with code ``malformed``."""

from __future__ import annotations

import json
import math
from dataclasses import fields
from typing import Any, Final, NoReturn

from gpurelay.model import GpuInventory
from gpurelay.wire.frames import (
    HELLO_GPUS,
    HELLO_TEXT_BYTES,
    MAX_ACK_DELAY_SECONDS,
    MAX_HEARTBEAT_SECONDS,
    MAX_SEQ,
    Ack,
    Declare,
    ErrorFrame,
    Goodbye,
    Heartbeat,
    Hello,
    SeriesDecl,
    WireError,
)
from gpurelay.wire.rules import show, utf8_size
from gpurelay.wire.varint import uvarint


def dump_json(obj: object) -> bytes:
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return text.encode("utf-8")


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise WireError("malformed", "a JSON object in the frame repeats a key")
    return obj


def no_constant(name: str) -> NoReturn:
    raise WireError("malformed", f"{name} is not allowed in a frame's JSON")


def load_json(body: bytes, what: str) -> object:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise WireError("malformed", f"{what} payload is not UTF-8 ({exc.reason})") from exc
    try:
        return json.loads(text, object_pairs_hook=unique_keys, parse_constant=no_constant)
    except json.JSONDecodeError as exc:
        raise WireError("malformed", f"{what} payload is not valid JSON ({exc})") from exc


class JsonObject:
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
        utf8_size(value, "malformed", f"{self._where}: field {key!r}")
        return value

    def short_text(self, key: str, default: str | None = None) -> str:
        """:meth:`text`, at most :data:`HELLO_TEXT_BYTES` long (facts about a box)."""
        value = self.text(key, default)
        size = utf8_size(value, "malformed", f"{self._where}: field {key!r}")
        if size > HELLO_TEXT_BYTES:
            raise self._bad(key, f"at most {HELLO_TEXT_BYTES} bytes long, not {size}")
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


def hello_json(hello: Hello) -> dict[str, Any]:
    out: dict[str, Any] = {
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
    if hello.heartbeat_seconds:  # left out when 0: the HELLO an older agent sent
        out["heartbeat_seconds"] = hello.heartbeat_seconds
    if hello.ack_delay_seconds:  # left out when 0, so an older gateway takes this HELLO
        out["ack_delay_seconds"] = hello.ack_delay_seconds
    return out


def parse_gpu(value: object, i: int) -> GpuInventory:
    o = JsonObject(value, f"HELLO gpus[{i}]")
    gpu = GpuInventory(
        index=o.count("index"),
        uuid=o.short_text("uuid"),
        name=o.short_text("name"),
        pci_bus_id=o.short_text("pci_bus_id"),
        minor=o.count("minor"),
        memory_total_bytes=o.count("memory_total_bytes"),
        memory_used_bytes=o.count("memory_used_bytes"),
        mig_enabled=o.flag("mig_enabled", False),
        healthy=o.flag("healthy", True),
    )
    o.done()
    return gpu


def parse_hello(body: bytes) -> Hello:
    o = JsonObject(load_json(body, "HELLO"), "HELLO")
    gpus = o.array("gpus", required=False)
    if len(gpus) > HELLO_GPUS:
        raise WireError("malformed", f"HELLO lists {len(gpus)} GPUs, more than {HELLO_GPUS}")
    hello = Hello(
        agent_version=o.short_text("agent_version"),
        node=o.short_text("node"),
        domain=o.short_text("domain", ""),
        backend=o.short_text("backend", ""),
        driver_version=o.short_text("driver_version", ""),
        hostname=o.short_text("hostname", ""),
        interval_seconds=o.number("interval_seconds", 10.0),
        gpus=tuple(parse_gpu(g, i) for i, g in enumerate(gpus)),
        heartbeat_seconds=o.number("heartbeat_seconds", 0.0),
        ack_delay_seconds=o.number("ack_delay_seconds", 0.0),
    )
    o.done()
    if hello.interval_seconds <= 0:
        raise WireError("malformed", "HELLO: field 'interval_seconds' must be positive")
    if not 0 <= hello.heartbeat_seconds <= MAX_HEARTBEAT_SECONDS:
        raise WireError(
            "malformed",
            f"HELLO: field 'heartbeat_seconds' must be in 0..{MAX_HEARTBEAT_SECONDS:g}",
        )
    if not 0 <= hello.ack_delay_seconds <= MAX_ACK_DELAY_SECONDS:
        raise WireError(
            "malformed",
            f"HELLO: field 'ack_delay_seconds' must be in 0..{MAX_ACK_DELAY_SECONDS:g}",
        )
    return hello


def declare_json(declare: Declare) -> dict[str, Any]:
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


_DECL_FIELDS: Final = frozenset({"id", "name", "type", "help", "labels"})
_LIST_ONLY: Final = frozenset({list})
_PAIRS: Final = frozenset({2})
# SeriesDecl is frozen: its __init__ sets each field through object.__setattr__, 2 us of
# the ~5 us a declared series took to read (issue 26: DECLAREs were 40 % of a restarted
# gateway's CPU while a fleet came back). Its slots' own setters do the same in 0.4 us.
_new_decl = object.__new__
_set_id, _set_name, _set_type, _set_help, _set_labels = (
    getattr(SeriesDecl, f).__set__ for f in ("id", "name", "type", "help", "labels")
)


def parse_decl(value: object, i: int) -> SeriesDecl:
    """One declared series. Its fields' values are checked by
    :func:`gpurelay.wire.rules.check_series` (names, type, help, label text); here only
    its shape: the fields, and what types they have. A well-formed one is read directly,
    anything else goes through :class:`JsonObject`, which says what is wrong."""
    if type(value) is dict and value.keys() == _DECL_FIELDS:
        sid, labels = value["id"], value["labels"]
        name, kind, text = value["name"], value["type"], value["help"]
        if (
            type(sid) is int
            and sid >= 0
            and type(name) is str
            and type(kind) is str
            and type(text) is str
            and type(labels) is list
            and (not labels or (_LIST_ONLY.issuperset(map(type, labels))
                                and _PAIRS.issuperset(map(len, labels))))
        ):  # fmt: skip
            decl = _new_decl(SeriesDecl)
            _set_id(decl, sid)
            _set_name(decl, name)
            _set_type(decl, kind)
            _set_help(decl, text)
            _set_labels(decl, tuple(map(tuple, labels)))
            return decl
    return _parse_decl_checked(value, i)


def _parse_decl_checked(value: object, i: int) -> SeriesDecl:
    o = JsonObject(value, f"DECLARE series[{i}]")
    labels: list[tuple[str, str]] = []
    for pair in o.array("labels"):
        if not (isinstance(pair, list) and len(pair) == 2):
            raise WireError("malformed", f"DECLARE series[{i}]: label {show(pair)} is not a pair")
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


def parse_declare(body: bytes) -> Declare:
    o = JsonObject(load_json(body, "DECLARE"), "DECLARE")
    items = o.array("series")
    o.done()
    return Declare(series=tuple(parse_decl(item, i) for i, item in enumerate(items)))


def parse_error(body: bytes) -> ErrorFrame:
    o = JsonObject(load_json(body, "ERROR"), "ERROR")
    frame = ErrorFrame(code=o.text("code"), message=o.text("message"))
    o.done()
    return frame


def parse_goodbye(body: bytes) -> Goodbye:
    o = JsonObject(load_json(body, "GOODBYE"), "GOODBYE")
    frame = Goodbye(reason=o.text("reason"))
    o.done()
    return frame


def parse_heartbeat(body: bytes) -> Heartbeat:
    received, end = uvarint(body, 0)
    if end != len(body) or received > MAX_SEQ:
        raise WireError("malformed", "HEARTBEAT payload is not one sequence number")
    return Heartbeat(received=received)


def parse_ack(body: bytes) -> Ack:
    seq, end = uvarint(body, 0)
    if end != len(body) or seq > MAX_SEQ:
        raise WireError("malformed", "ACK payload is not one sequence number")
    return Ack(seq=seq)


def check_text(value: object, what: str) -> None:
    if not isinstance(value, str):
        raise WireError("malformed", f"{what} is not a string")
