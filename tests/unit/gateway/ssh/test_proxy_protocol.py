"""The PROXY protocol parser (cloud_gateway.ssh.balancer_header): haproxy's v1 and v2 headers,
byte by byte, and everything a hostile or broken sender can put there."""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import re
import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cloud_gateway.config import load
from cloud_gateway.errors import GatewayConfigError
from cloud_gateway.ssh.balancer_header import (
    REFUSALS,
    V1_MAX,
    V2_MAX,
    V2_SIGNATURE,
    ProxyHeader,
    ProxyHeaderError,
    parse,
)
from cloud_gateway.ssh.balancer_listener import ProxiedListener, proxied_listener
from cloud_gateway.ssh.config import SshConfig, parse_networks

SSH = b"SSH-2.0-AsyncSSH_2.24\r\n"


def v2(
    src: str = "198.51.100.7",
    dst: str = "192.0.2.1",
    sport: int = 50123,
    dport: int = 2222,
    *,
    command: int = 1,
    fam: int | None = None,
    tlvs: bytes = b"",
    length: int | None = None,
    version: int = 2,
) -> bytes:
    ip = ipaddress.ip_address(src)
    if ip.version == 4:
        body = ipaddress.IPv4Address(src).packed + ipaddress.IPv4Address(dst).packed
        default_fam = 0x11
    else:
        body = ipaddress.IPv6Address(src).packed + ipaddress.IPv6Address(dst).packed
        default_fam = 0x21
    body += struct.pack("!HH", sport, dport) + tlvs
    size = len(body) if length is None else length
    fixed = struct.pack("!BBH", version << 4 | command, default_fam if fam is None else fam, size)
    return V2_SIGNATURE + fixed + body


def whole(data: bytes) -> ProxyHeader:
    header = parse(data)
    assert header is not None
    return header


def refused(data: bytes) -> ProxyHeaderError:
    with pytest.raises(ProxyHeaderError) as info:
        parse(data)
    assert info.value.reason in REFUSALS
    return info.value


# --- version 1 -------------------------------------------------------------------------


def test_v1_tcp4_gives_the_client_and_its_length() -> None:
    line = b"PROXY TCP4 198.51.100.7 192.0.2.1 50123 2222\r\n"
    header = whole(line + SSH)
    assert header == ProxyHeader(
        1, "proxy", "tcp4", ("198.51.100.7", 50123), ("192.0.2.1", 2222), len(line)
    )


def test_v1_tcp6() -> None:
    line = b"PROXY TCP6 2001:db8::7 2001:db8::1 65535 0\r\n"
    header = whole(line)
    assert header.family == "tcp6" and header.source == ("2001:db8::7", 65535)
    assert header.destination == ("2001:db8::1", 0) and header.length == len(line)


@pytest.mark.parametrize("line", [b"PROXY UNKNOWN\r\n", b"PROXY UNKNOWN ffff::1 ::1 1 2\r\n"])
def test_v1_unknown_keeps_the_connections_address(line: bytes) -> None:
    header = whole(line + SSH)
    assert (header.family, header.source, header.length) == ("unknown", None, len(line))


def test_v1_longest_line_is_taken_and_one_more_byte_is_not() -> None:
    longest = (
        b"PROXY UNKNOWN ffff:f...f:ffff ffff:f...f:ffff 65535 65535".ljust(V1_MAX - 2, b"x")
        + b"\r\n"
    )
    assert len(longest) == V1_MAX and whole(longest).length == V1_MAX
    assert refused(b"PROXY UNKNOWN " + b"x" * V1_MAX).reason == "oversize"


@pytest.mark.parametrize(
    "line",
    [
        b"PROXY TCP4 198.51.100.7 192.0.2.1 50123\r\n",  # a field short
        b"PROXY TCP4  198.51.100.7 192.0.2.1 50123 2222\r\n",  # two spaces
        b"PROXY TCP4 198.51.100.7 192.0.2.1 50123 2222 \r\n",  # trailing space
        b"PROXY TCP5 198.51.100.7 192.0.2.1 50123 2222\r\n",
        b"PROXY TCP4 2001:db8::7 192.0.2.1 50123 2222\r\n",  # family mismatch
        b"PROXY TCP6 198.51.100.7 2001:db8::1 50123 2222\r\n",
        b"PROXY TCP4 198.51.100.256 192.0.2.1 50123 2222\r\n",
        b"PROXY TCP4 198.51.100.07 192.0.2.1 50123 2222\r\n",  # leading zero: ambiguous
        b"PROXY TCP4 198.51.100.7 192.0.2.1 65536 2222\r\n",
        b"PROXY TCP4 198.51.100.7 192.0.2.1 050123 2222\r\n",
        b"PROXY TCP4 198.51.100.7 192.0.2.1 +5012 2222\r\n",
        b"PROXY TCP4 198.51.100.7 192.0.2.1 \xd9\xa1 2222\r\n",  # not ASCII digits
        b"PROXY TCP4 198.51.100.7 192.0.2.1 50123 2222\n",  # LF alone
        b"PROXY TCP4 198.51.100.7\r192.0.2.1 50123 2222\r\n",  # stray CR
        b"PROXY TCP4 198.51.100.7 192.0.2.1 50123 22\x0022\r\n",
        b"proxy TCP4 198.51.100.7 192.0.2.1 50123 2222\r\n",
        b"PROXY\r\n",
    ],
)
def test_v1_malformed_lines_are_refused_with_what_was_wrong(line: bytes) -> None:
    error = refused(line)
    assert error.reason in ("malformed", "missing")
    assert str(error)  # says what it saw


def test_v1_waits_for_the_rest_of_a_line() -> None:
    line = b"PROXY TCP4 198.51.100.7 192.0.2.1 50123 2222\r\n"
    for cut in range(len(line)):
        assert parse(line[:cut]) is None, cut
    assert whole(line).length == len(line)


# --- version 2 -------------------------------------------------------------------------


def test_v2_tcp4() -> None:
    data = v2()
    header = whole(data + SSH)
    assert header == ProxyHeader(
        2, "proxy", "tcp4", ("198.51.100.7", 50123), ("192.0.2.1", 2222), len(data)
    )
    assert len(data) == 28


def test_v2_tcp6() -> None:
    data = v2("2001:db8::7", "2001:db8::1", 1, 2)
    header = whole(data)
    assert header.family == "tcp6" and header.source == ("2001:db8::7", 1)
    assert header.length == 16 + 36


def test_v2_local_is_the_balancer_itself_whatever_the_addresses() -> None:
    data = v2(command=0)
    header = whole(data + SSH)
    assert (header.command, header.source, header.length) == ("local", None, len(data))
    bare = V2_SIGNATURE + bytes([0x20, 0x00, 0, 0])
    assert whole(bare) == ProxyHeader(2, "local", "unknown", None, None, 16)


def test_v2_unspec_and_unix_keep_the_connections_address() -> None:
    unspec = V2_SIGNATURE + bytes([0x21, 0x00, 0, 0])
    assert whole(unspec).family == "unknown" and whole(unspec).source is None
    unix = V2_SIGNATURE + bytes([0x21, 0x31]) + struct.pack("!H", 216) + b"/run/x".ljust(216, b"\0")
    assert whole(unix).family == "unknown" and whole(unix).length == 16 + 216


def test_v2_tlvs_are_skipped() -> None:
    tlvs = bytes([0x04, 0, 3]) + b"\0\0\0" + bytes([0x01, 0, 2]) + b"h2"  # NOOP, ALPN
    data = v2(tlvs=tlvs)
    header = whole(data + SSH)
    assert header.source == ("198.51.100.7", 50123) and header.length == len(data)


def test_v2_waits_for_the_length_it_announced() -> None:
    data = v2(tlvs=bytes([0x04, 0, 5]) + b"\0" * 5)
    for cut in range(len(data)):
        assert parse(data[:cut]) is None, cut
    assert whole(data).length == len(data)


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (v2(version=1), "malformed"),
        (v2(version=3), "malformed"),
        (v2(command=2), "malformed"),
        (v2(fam=0x12), "malformed"),  # datagram
        (v2(fam=0x41), "malformed"),  # no such family
        (v2(length=11), "malformed"),  # shorter than two IPv4 addresses and ports
        (v2("2001:db8::7", "2001:db8::1", length=35), "malformed"),
        (v2(tlvs=bytes([0x04, 0, 9]) + b"\0\0"), "malformed"),  # a TLV past the end
        (v2(tlvs=bytes([0x04, 0])), "malformed"),  # half a TLV header
        (V2_SIGNATURE + bytes([0x21, 0x11]) + struct.pack("!H", 65535), "oversize"),
        (b"\r\n\r\n\x00\r\nQUIX\n" + bytes(4), "missing"),  # wrong signature
    ],
)
def test_v2_broken_headers_are_refused(data: bytes, reason: str) -> None:
    assert refused(data).reason == reason


def test_v2_oversize_is_refused_before_its_bytes_arrive() -> None:
    fixed = V2_SIGNATURE + bytes([0x21, 0x11]) + struct.pack("!H", V2_MAX)
    assert refused(fixed).reason == "oversize"  # 16 bytes seen, not 4 kB waited for
    assert parse(fixed, v2_max=16 + V2_MAX) is None


def test_v2_length_lie_does_not_read_into_the_client_bytes() -> None:
    data = v2(length=12)  # says 12 bytes of addresses: exactly what is there
    assert whole(data + SSH).length == 28
    longer = v2(length=12 + len(SSH))  # claims the SSH banner as TLVs: not TLV-shaped
    assert refused(longer + SSH).reason == "malformed"


# --- neither ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data", [SSH, b"GET / HTTP/1.1\r\n", b"\x16\x03\x01\x02\x00", b"\x00", b"\r\n\r\nQUIT"]
)
def test_a_connection_without_a_header_is_refused_at_its_first_bytes(data: bytes) -> None:
    error = refused(data)
    assert error.reason == "missing" and repr(data[:8])[2:-1] in str(error)


def test_nothing_yet_is_not_a_refusal() -> None:
    assert parse(b"") is None
    assert parse(b"PRO") is None
    assert parse(V2_SIGNATURE[:5]) is None


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=300))
def test_any_bytes_give_a_header_none_or_a_clear_refusal(data: bytes) -> None:
    try:
        header = parse(data)
    except ProxyHeaderError as exc:
        assert exc.reason in REFUSALS and str(exc)
        return
    if header is not None:
        assert 0 < header.length <= len(data)


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=1, max_size=60), st.integers(0, 27))
def test_mutated_v2_headers_never_escape_the_parser(noise: bytes, at: int) -> None:
    data = bytearray(v2() + SSH)
    data[at : at + len(noise)] = noise
    try:
        header = parse(bytes(data))
    except ProxyHeaderError as exc:
        assert exc.reason in REFUSALS
        return
    if header is not None:
        assert header.length <= len(data)


# --- which balancers may send one ----------------------------------------------------


def test_allowed_sources() -> None:
    listener = ProxiedListener(allowed=parse_networks(["127.0.0.1/32", "10.0.0.0/8", "::1"]))
    assert listener.allowed(("127.0.0.1", 4000))
    assert listener.allowed(("10.2.3.4", 4000))
    assert listener.allowed(("::ffff:10.2.3.4", 4000, 0, 0))  # a dual-stack socket's view
    assert listener.allowed(("::1", 4000, 0, 0))
    assert not listener.allowed(("127.0.0.2", 4000))
    assert not listener.allowed(None)
    assert ProxiedListener().allowed(("203.0.113.9", 1))  # empty: any


@pytest.mark.parametrize("entry", ["10.0.0.1/8", "balancer", "300.1.1.1", ""])
def test_bad_networks_are_named(entry: str) -> None:
    with pytest.raises(ValueError, match="is not an address or network"):
        parse_networks([entry])


# --- [ssh] proxy_protocol -------------------------------------------------------------


def test_proxy_protocol_is_off_by_default_and_configurable(tmp_path: Path) -> None:
    assert load(None, {}).ssh.proxy_protocol is False
    path = tmp_path / "gateway.toml"
    path.write_text(
        '[ssh]\nproxy_protocol = true\nproxy_protocol_from = ["10.0.0.0/8", "::1"]\n'
        "proxy_protocol_timeout_seconds = 2\n"
    )
    ssh = load(path, {}).ssh
    assert ssh.proxy_protocol and ssh.proxy_protocol_from == ("10.0.0.0/8", "::1")
    assert ssh.proxy_protocol_timeout_seconds == 2.0
    env = {"CLOUD_GATEWAY_SSH_PROXY_PROTOCOL_FROM": "192.0.2.1,192.0.2.2"}
    assert load(None, env).ssh.proxy_protocol_from == ("192.0.2.1", "192.0.2.2")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"CLOUD_GATEWAY_SSH_PROXY_PROTOCOL_FROM": "10.0.0.1/8"}, "ssh.proxy_protocol_from"),
        ({"CLOUD_GATEWAY_SSH_PROXY_PROTOCOL_FROM": "haproxy"}, "ssh.proxy_protocol_from"),
        ({"CLOUD_GATEWAY_SSH_PROXY_PROTOCOL_TIMEOUT_SECONDS": "0"}, "timeout_seconds"),
    ],
)
def test_a_bad_proxy_protocol_setting_is_a_one_line_error(
    env: dict[str, str], message: str
) -> None:
    with pytest.raises(GatewayConfigError, match=message):
        load(None, env)


def test_off_builds_no_listener_and_on_says_so(caplog: pytest.LogCaptureFixture) -> None:
    assert proxied_listener(on=False, allowed=(), timeout=5) is None
    with caplog.at_level(logging.WARNING):
        listener = proxied_listener(on=True, allowed=(), timeout=5)
    assert listener is not None and "from ANY address" in caplog.text
    listener = proxied_listener(on=True, allowed=("127.0.0.1/32",), timeout=2)
    assert listener is not None and not listener.allowed(("127.0.0.2", 1))


def test_the_operator_guide_documents_every_proxy_protocol_key_with_its_default() -> None:
    guide = Path(__file__).resolve().parents[4] / "docs" / "operator-guide.md"
    rows = re.findall(
        r"^\| `ssh\.(proxy_protocol\w*)` \| `([^`]*)` \|", guide.read_text(), re.MULTILINE
    )
    ssh = SshConfig()
    keys = {f.name for f in dataclasses.fields(SshConfig) if f.name.startswith("proxy_")}
    assert {key for key, _ in rows} == keys
    for key, shown in rows:
        value = getattr(ssh, key)
        if isinstance(value, bool):
            assert shown == str(value).lower(), key
        elif isinstance(value, tuple):
            assert shown == "[]" and value == (), key
        else:
            assert float(shown) == value, key
