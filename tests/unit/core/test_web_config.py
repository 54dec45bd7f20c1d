"""gpurelay.web_config: the Prometheus web-config file (``--web.config.file`` of
node_exporter and Prometheus) read by both binaries, its TLS context and basic-auth check."""

from __future__ import annotations

import asyncio
import base64
import ssl
import threading
from pathlib import Path

import bcrypt
import pytest

from cloud_gateway.config import load as load_gateway
from cloud_gateway.errors import GatewayConfigError
from edge_agent.config import load as load_agent
from edge_agent.errors import ConfigError
from gpurelay.web_config import BasicAuth, WebConfigError, load_web_config, parse_basic
from harness.tls import make_tls

HASH = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(4)).decode()
KEY = "http.web_config_file"


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Path:
    files = make_tls(tmp_path_factory.mktemp("tls"))
    return files.ca.parent


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "web-config.yml"
    path.write_text(text)
    return path


def test_a_node_exporter_web_config_loads_with_paths_relative_to_the_file(
    tmp_path: Path, tls: Path
) -> None:
    path = write(
        tls,
        "tls_server_config:\n"
        "  cert_file: server.crt\n"
        f"  key_file: {tls / 'server.key'}\n"
        "  client_auth_type: RequireAndVerifyClientCert\n"
        "  client_ca_file: ca.crt\n"
        "  min_version: TLS13\n"
        "basic_auth_users:\n"
        f"  prometheus: {HASH}\n"
        "  htpasswd: $2y$04$" + HASH[7:] + "\n",
    )
    cfg = load_web_config(path, key=KEY)
    assert cfg.tls is not None
    assert cfg.tls.cert_file == tls / "server.crt"
    assert cfg.tls.client_ca_file == tls / "ca.crt"
    assert sorted(cfg.basic_auth_users) == ["htpasswd", "prometheus"]
    ctx = cfg.ssl_context()
    assert ctx is not None
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_3
    assert ctx.verify_mode == ssl.CERT_REQUIRED


def test_defaults_follow_the_exporter_toolkit(tls: Path) -> None:
    path = write(tls, "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n")
    cfg = load_web_config(path, key=KEY)
    ctx = cfg.ssl_context()
    assert ctx is not None
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_2
    assert ctx.verify_mode == ssl.CERT_NONE
    assert cfg.basic_auth_users == {}
    # A client CA without client_auth_type means: require and verify a client certificate.
    path = write(
        tls,
        "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
        "  client_ca_file: ca.crt\n",
    )
    ctx = load_web_config(path, key=KEY).ssl_context()
    assert ctx is not None and ctx.verify_mode == ssl.CERT_REQUIRED


def test_basic_auth_alone_needs_no_tls(tmp_path: Path) -> None:
    cfg = load_web_config(write(tmp_path, f"basic_auth_users:\n  alice: '{HASH}'\n"), key=KEY)
    assert cfg.tls is None and cfg.ssl_context() is None
    assert list(cfg.basic_auth_users) == ["alice"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "tls_server_config:\n  cert_file: missing.crt\n  key_file: server.key\n",
            "tls_server_config.cert_file: ",
        ),
        (
            "tls_server_config:\n  cert_file: server.crt\n",
            "tls_server_config.key_file is required",
        ),
        (
            "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
            "  min_version: TLS14\n",
            "tls_server_config.min_version must be one of TLS10, TLS11, TLS12, TLS13, not 'TLS14'",
        ),
        (
            "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
            "  client_auth_type: RequireAndVerifyClientCert\n",
            "tls_server_config.client_ca_file is required",
        ),
        (
            "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
            "  client_auth_type: RequireAnyClientCert\n  client_ca_file: ca.crt\n",
            "tls_server_config.client_auth_type 'RequireAnyClientCert' is not supported",
        ),
        (
            "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
            "  cipher_suites: [TLS_AES_128_GCM_SHA256]\n",
            "tls_server_config.cipher_suites is not supported",
        ),
        ("basic_auth_users:\n  alice: plaintext\n", "basic_auth_users.alice is not a bcrypt hash"),
        ("basic_auth_users: [alice]\n", "basic_auth_users must be a mapping"),
        ("tls_server_config: {cert_file: server.crt\n", "is not valid YAML"),
        ("tls_config:\n  cert_file: x\n", "unknown key(s): tls_config"),
    ],
)
def test_errors_name_the_key(tls: Path, text: str, message: str) -> None:
    path = write(tls, text)
    with pytest.raises(WebConfigError) as info:
        load_web_config(path, key=KEY)
    assert message in str(info.value)
    assert str(info.value).startswith(f"{KEY} {path}: ")


def test_a_key_that_does_not_match_its_certificate_is_an_error(tls: Path) -> None:
    path = write(tls, "tls_server_config:\n  cert_file: server.crt\n  key_file: client.key\n")
    with pytest.raises(WebConfigError, match=r"tls_server_config\.cert_file/key_file"):
        load_web_config(path, key=KEY)


def test_a_missing_web_config_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(WebConfigError, match=rf"{KEY} {tmp_path}/nope.yml: cannot be read"):
        load_web_config(tmp_path / "nope.yml", key=KEY)


def test_gateway_and_agent_configs_check_the_file_at_load(tmp_path: Path) -> None:
    bad = write(tmp_path, "basic_auth_users:\n  alice: nope\n")
    with pytest.raises(
        GatewayConfigError, match=r"http\.web_config_file .*basic_auth_users\.alice"
    ):
        load_gateway(None, {"CLOUD_GATEWAY_HTTP_WEB_CONFIG_FILE": str(bad)})
    with pytest.raises(ConfigError, match=r"^web_config_file .*basic_auth_users\.alice"):
        load_agent(None, {"EDGE_AGENT_WEB_CONFIG_FILE": str(bad)})
    good = write(tmp_path, f"basic_auth_users:\n  alice: '{HASH}'\n")
    assert (
        load_gateway(None, {"CLOUD_GATEWAY_HTTP_WEB_CONFIG_FILE": str(good)}).http.web_config_file
        == good
    )
    assert load_agent(None, {"EDGE_AGENT_WEB_CONFIG_FILE": str(good)}).web_config_file == good


# --- basic auth ---------------------------------------------------------------------------------


class CountingCheck:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, password: bytes, hashed: bytes) -> bool:
        self.calls += 1
        return bcrypt.checkpw(password, hashed)


async def test_basic_auth_verifies_bcrypt_and_caches_the_answer() -> None:
    check = CountingCheck()
    now = [100.0]
    auth = BasicAuth({"alice": HASH.encode()}, checkpw=check, ttl=60, clock=lambda: now[0])
    assert await auth.verify("alice", "s3cret")
    assert await auth.verify("alice", "s3cret")
    assert check.calls == 1  # the second scrape pays no bcrypt
    assert not await auth.verify("alice", "wrong")
    assert not await auth.verify("mallory", "s3cret")  # unknown users cost a bcrypt too
    assert check.calls == 3
    now[0] += 61
    assert await auth.verify("alice", "s3cret")
    assert check.calls == 4  # expired
    assert not await auth.verify("alice", "x" * 100)  # bcrypt's 72-byte limit: refused


async def test_basic_auth_cache_is_bounded() -> None:
    auth = BasicAuth({"alice": HASH.encode()}, checkpw=CountingCheck(), max_entries=8)
    for i in range(50):
        await auth.verify("alice", f"guess-{i}")
    assert auth.cached() <= 8


class GatedCheck:
    """bcrypt that holds every check until the gate opens, recording what it was asked."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.asked: list[bytes] = []

    def __call__(self, password: bytes, hashed: bytes) -> bool:
        self.asked.append(password)
        assert self.gate.wait(30)
        return password == b"s3cret"


async def test_a_flood_of_wrong_passwords_does_not_queue_a_real_user_behind_it() -> None:
    """Issue 24 #6: every distinct wrong password queued for a bcrypt slot, unbounded, in
    front of real users (40 delayed a real user's first request to 1.77 s, linearly). The
    queue is bounded: beyond it a check is refused at once, without a bcrypt."""
    check = GatedCheck()
    auth = BasicAuth({"alice": HASH.encode()}, checkpw=check, concurrency=2, max_waiting=8)
    flood = [asyncio.create_task(auth.verify("alice", f"guess-{i}")) for i in range(40)]
    try:
        await asyncio.sleep(0.2)  # every guess has asked; the two running hold the gate
        answered = [task for task in flood if task.done()]
        assert len(answered) == 40 - 2 - 8  # answered while bcrypt is stuck: fast
        assert not any(task.result() for task in answered)
        real = asyncio.create_task(auth.verify("alice", "s3cret"))
        await asyncio.sleep(0.05)
        assert real.done() and real.result() is False  # the queue is full: refused fast
    finally:
        check.gate.set()
        await asyncio.gather(*flood)
    assert len(check.asked) == 10  # bcrypt ran for the bounded queue only
    assert await auth.verify("alice", "s3cret")  # with room, the real user gets in
    assert check.asked.index(b"s3cret") == 10  # behind nothing


async def test_wrong_passwords_are_throttled_per_source() -> None:
    check = CountingCheck()
    now = [100.0]
    auth = BasicAuth({"alice": HASH.encode()}, checkpw=check, max_failures=5, clock=lambda: now[0])
    for i in range(5):
        assert not await auth.verify("alice", f"guess-{i}", source="203.0.113.9")
    assert check.calls == 5
    assert not await auth.verify("alice", "s3cret", source="203.0.113.9")  # throttled
    assert check.calls == 5  # no bcrypt spent on it
    assert await auth.verify("alice", "s3cret", source="198.51.100.1")  # others get in
    assert await auth.verify("alice", "s3cret", source="203.0.113.9")  # a cached answer
    now[0] += 61  # the window passed
    assert not await auth.verify("alice", "guess-6", source="203.0.113.9")
    assert check.calls == 7


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (base64.b64encode(b"alice:pa:ss").decode(), ("alice", "pa:ss")),
        (base64.b64encode(b"alice").decode(), None),
        ("!!!", None),
        (base64.b64encode(b"\xff:x").decode(), None),
        ("cHJvbTpzZWNyZXQ\xff", None),  # not ASCII: base64 raised ValueError (make fuzz)
    ],
)
def test_parse_basic(value: str, expected: tuple[str, str] | None) -> None:
    assert parse_basic(value) == expected
