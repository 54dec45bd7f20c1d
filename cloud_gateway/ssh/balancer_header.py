"""The PROXY protocol header a TCP balancer puts before a connection's first byte.

Behind haproxy in TCP mode (``send-proxy-v2``) every agent's connection comes from the
balancer's address; the header says which client the balancer accepted it from. Both
versions of haproxy's spec (doc/proxy-protocol.txt) are read here, told apart by their
first bytes:

- version 1, text: ``PROXY TCP4 <src> <dst> <sport> <dport>\\r\\n`` (or TCP6, or
  ``PROXY UNKNOWN...\\r\\n``), at most 107 bytes with the CRLF;
- version 2, binary: a 12-byte signature, version/command, family/transport, a 16-bit
  length, then the addresses and optional TLVs (skipped, but their framing is checked).

Pure and strict: :func:`parse` takes the bytes received so far and returns ``None`` while
they are a valid beginning of a header, a :class:`ProxyHeader` (whose ``length`` says how
many bytes it took: what follows is the client's) once whole, or raises
:class:`ProxyHeaderError` with a ``reason`` from :data:`REFUSALS` (a metric label) and a
message for the log. Nothing past the header is looked at.
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass
from typing import Final, Literal

V1_PREFIX: Final = b"PROXY "
V1_MAX: Final = 107  # the longest v1 line, CRLF included (spec, 2.1)
V2_SIGNATURE: Final = b"\r\n\r\n\x00\r\nQUIT\n"
V2_FIXED: Final = 16  # signature, version/command, family, length
# What the gateway takes in a v2 header: addresses (at most 216 bytes, for AF_UNIX) and
# TLVs. The spec allows 16 + 65,535; haproxy sends tens of bytes. A bound keeps what one
# connection may make the gateway hold before it has said anything small.
V2_MAX: Final = 4096

# Why a connection was refused before SSH (the label of the gateway's counter):
# source: not from a balancer in ssh.proxy_protocol_from; missing: did not start with a
# header; malformed: a header that breaks the spec; oversize: longer than allowed;
# timeout: no whole header within the deadline; closed: the peer left mid-header.
REFUSALS: Final = ("source", "missing", "malformed", "oversize", "timeout", "closed")

Reason = Literal["source", "missing", "malformed", "oversize", "timeout", "closed"]
Address = tuple[str, int]


class ProxyHeaderError(ValueError):
    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.reason: Reason = reason


@dataclass(frozen=True, slots=True)
class ProxyHeader:
    version: Literal[1, 2]
    # "proxy": relayed for the client in ``source``; "local": the balancer's own
    # connection (a v2 health check), with no client address.
    command: Literal["proxy", "local"]
    # "tcp4"/"tcp6" carry addresses; "unknown" (v1 UNKNOWN, v2 AF_UNSPEC or AF_UNIX)
    # does not, and the connection's own address stands.
    family: Literal["tcp4", "tcp6", "unknown"]
    source: Address | None
    destination: Address | None
    length: int  # bytes of the header; the client's bytes follow


def parse(data: bytes | bytearray | memoryview, *, v2_max: int = V2_MAX) -> ProxyHeader | None:
    """The header at the start of ``data``; ``None`` while more bytes are needed."""
    head = bytes(data[:V2_FIXED])
    if head[:1] == V1_PREFIX[:1]:
        if not V1_PREFIX.startswith(head[: len(V1_PREFIX)]):
            raise _missing(head)
        return _parse_v1(bytes(data[:V1_MAX]))
    if head[:1] == V2_SIGNATURE[:1]:
        if not V2_SIGNATURE.startswith(head[: len(V2_SIGNATURE)]):
            raise _missing(head)
        return _parse_v2(data, v2_max)
    if not head:
        return None
    raise _missing(head)


def _missing(head: bytes) -> ProxyHeaderError:
    return ProxyHeaderError(
        "missing", f"the connection did not start with a PROXY protocol header: {head!r}"
    )


def _parse_v1(data: bytes) -> ProxyHeader | None:
    end = data.find(b"\r\n")
    if end < 0:
        if len(data) >= V1_MAX:
            raise ProxyHeaderError("oversize", f"a v1 header without CRLF in {V1_MAX} bytes")
        if b"\n" in data or b"\r" in data[:-1]:
            raise ProxyHeaderError("malformed", f"a v1 header with a stray CR or LF: {data!r}")
        return None
    line = data[:end]
    try:
        text = line.decode("ascii")
    except UnicodeDecodeError:
        raise ProxyHeaderError("malformed", f"a v1 header that is not ASCII: {line!r}") from None
    if not text.isprintable():
        raise ProxyHeaderError("malformed", f"a v1 header with control bytes: {line!r}")
    fields = text.split(" ")
    length = end + 2
    if fields[1:2] == ["UNKNOWN"]:  # the rest of the line is to be ignored (spec, 2.1)
        return ProxyHeader(1, "proxy", "unknown", None, None, length)
    if len(fields) != 6 or fields[1] not in ("TCP4", "TCP6"):
        raise ProxyHeaderError(
            "malformed",
            f"a v1 header must be 'PROXY TCP4|TCP6 SRC DST SPORT DPORT' or "
            f"'PROXY UNKNOWN', not {text!r}",
        )
    family: Literal["tcp4", "tcp6"] = "tcp4" if fields[1] == "TCP4" else "tcp6"
    src = _v1_address(fields[2], family, text)
    dst = _v1_address(fields[3], family, text)
    sport, dport = _v1_port(fields[4], text), _v1_port(fields[5], text)
    return ProxyHeader(1, "proxy", family, (src, sport), (dst, dport), length)


def _v1_address(field: str, family: Literal["tcp4", "tcp6"], text: str) -> str:
    kind = ipaddress.IPv4Address if family == "tcp4" else ipaddress.IPv6Address
    try:
        return str(kind(field))
    except ValueError:
        raise ProxyHeaderError(
            "malformed", f"{field!r} is not an {family.upper()} address in v1 header {text!r}"
        ) from None


def _v1_port(field: str, text: str) -> int:
    # decimal, no sign, no leading zero (spec, 2.1)
    if not (field.isascii() and field.isdigit()) or len(field) > 5 or field != str(int(field)):
        raise ProxyHeaderError("malformed", f"{field!r} is not a port in v1 header {text!r}")
    port = int(field)
    if port > 65535:
        raise ProxyHeaderError("malformed", f"port {port} out of range in v1 header {text!r}")
    return port


_V2_ADDRESS_BYTES: Final = {0x1: 12, 0x2: 36, 0x3: 216}  # AF_INET, AF_INET6, AF_UNIX


def _parse_v2(data: bytes | bytearray | memoryview, v2_max: int) -> ProxyHeader | None:
    if len(data) < V2_FIXED:
        return None
    ver_cmd, fam, size = struct.unpack_from("!BBH", data, 12)
    if ver_cmd >> 4 != 2:
        raise ProxyHeaderError("malformed", f"a v2 signature with version {ver_cmd >> 4}")
    command = ver_cmd & 0xF
    if command not in (0, 1):
        raise ProxyHeaderError("malformed", f"a v2 header with unknown command {command}")
    total = V2_FIXED + size
    if total > v2_max:
        raise ProxyHeaderError(
            "oversize", f"a v2 header of {total} bytes (the gateway takes at most {v2_max})"
        )
    if len(data) < total:
        return None
    body = bytes(data[V2_FIXED:total])
    if command == 0:  # LOCAL: the balancer's own connection; addresses are to be ignored
        return ProxyHeader(2, "local", "unknown", None, None, total)
    af, transport = fam >> 4, fam & 0xF
    if af > 3 or transport > 2:
        raise ProxyHeaderError("malformed", f"a v2 header with unknown family byte {fam:#04x}")
    if af == 0:  # AF_UNSPEC: the sender could not say (spec: use the connection's own)
        return ProxyHeader(2, "proxy", "unknown", None, None, total)
    if transport != 1:
        raise ProxyHeaderError(
            "malformed", f"a v2 header for a non-stream transport (family byte {fam:#04x})"
        )
    need = _V2_ADDRESS_BYTES[af]
    if size < need:
        raise ProxyHeaderError(
            "malformed",
            f"a v2 header whose length {size} is too short for its addresses ({need} bytes)",
        )
    _check_tlvs(body[need:])
    if af == 3:  # AF_UNIX: no IP to stand for the client; the connection's own stands
        return ProxyHeader(2, "proxy", "unknown", None, None, total)
    if af == 1:
        src4, dst4, sport, dport = struct.unpack_from("!4s4sHH", body)
        src, dst = str(ipaddress.IPv4Address(src4)), str(ipaddress.IPv4Address(dst4))
        return ProxyHeader(2, "proxy", "tcp4", (src, sport), (dst, dport), total)
    src6, dst6, sport, dport = struct.unpack_from("!16s16sHH", body)
    src, dst = str(ipaddress.IPv6Address(src6)), str(ipaddress.IPv6Address(dst6))
    return ProxyHeader(2, "proxy", "tcp6", (src, sport), (dst, dport), total)


def _check_tlvs(tlvs: bytes) -> None:
    """Each TLV (type, 16-bit length, value) must end within the header."""
    at = 0
    while at < len(tlvs):
        if len(tlvs) - at < 3:
            raise ProxyHeaderError(
                "malformed", f"a v2 header ends inside a TLV's type and length (at {at})"
            )
        kind, size = struct.unpack_from("!BH", tlvs, at)
        at += 3 + size
        if at > len(tlvs):
            raise ProxyHeaderError(
                "malformed",
                f"a v2 TLV of type {kind:#04x} runs {at - len(tlvs)} bytes past "
                "the header's length",
            )
