"""gpurelay.asyncssh_hooks: the private asyncssh methods it wraps are still there, with the
same parameters, and both hooks run on a real connection (server and client on 127.0.0.1,
port 0, keys made in memory).

When asyncssh changes one of them, the first two tests fail and name the method: update
gpurelay/asyncssh_hooks.py (and the asyncssh bound in pyproject.toml) before anything else.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncssh
import pytest
from asyncssh.connection import SSHClientConnection, SSHServerConnection
from asyncssh.public_key import SSHOpenSSHCertificate

from gpurelay.asyncssh_hooks import (
    AsyncsshChanged,
    hook_certificate_validation,
    hook_forwarded_open,
    verify_asyncssh,
)

NODE = "edge-a"


def test_the_private_methods_are_still_there_with_the_same_parameters() -> None:
    validate = SSHServerConnection._validate_openssh_certificate
    assert list(inspect.signature(validate).parameters) == ["self", "username", "cert"]
    assert inspect.iscoroutinefunction(validate)
    forwarded = SSHClientConnection._process_forwarded_tcpip_open
    assert list(inspect.signature(forwarded).parameters) == ["self", "packet"]
    assert not inspect.iscoroutinefunction(forwarded)
    verify_asyncssh()


def test_a_changed_method_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    def renamed_parameter(self: Any, pkt: Any) -> None: ...

    monkeypatch.setattr(SSHClientConnection, "_process_forwarded_tcpip_open", renamed_parameter)
    with pytest.raises(AsyncsshChanged, match=r"SSHClientConnection\._process_forwarded_tcpip"):
        verify_asyncssh()
    monkeypatch.delattr(SSHServerConnection, "_validate_openssh_certificate")
    with pytest.raises(AsyncsshChanged, match=r"_validate_openssh_certificate is gone"):
        verify_asyncssh()


def test_importing_the_hooks_fails_against_a_changed_asyncssh() -> None:
    """Both binaries import the hooks at startup: they refuse to start, naming the method."""
    changed = (
        "from asyncssh.connection import SSHClientConnection as C\n"
        "del C._process_forwarded_tcpip_open\n"
        "import gpurelay.asyncssh_hooks\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", changed], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 1
    assert "AsyncsshChanged: asyncssh " in proc.stderr
    assert "SSHClientConnection._process_forwarded_tcpip_open is gone" in proc.stderr


# --- on a real connection ------------------------------------------------------------------


class _Server(asyncssh.SSHServer):
    """Certificate auth against one CA (or none, ``require_auth=False``); each new
    connection is handed to ``hook``."""

    def __init__(self, ca: asyncssh.SSHKey, hook: Any, require_auth: bool) -> None:
        self._ca = ca
        self._hook = hook
        self._require_auth = require_auth

    def connection_made(self, conn: SSHServerConnection) -> None:  # type: ignore[override]
        self._hook(conn)

    def begin_auth(self, username: str) -> bool:
        return self._require_auth

    def public_key_auth_supported(self) -> bool:
        return True

    def validate_public_key(self, username: str, key: asyncssh.SSHKey) -> bool:
        return False

    def validate_ca_key(self, username: str, key: asyncssh.SSHKey) -> bool:
        return key.public_data == self._ca.public_data


@asynccontextmanager
async def _server(hook: Any, *, require_auth: bool = True) -> AsyncIterator[tuple[int, Any]]:
    """A server on a free port; yields (port, (client key, its certificate))."""
    ca = asyncssh.generate_private_key("ssh-ed25519")
    user = asyncssh.generate_private_key("ssh-ed25519")
    cert = ca.generate_user_certificate(user, NODE, principals=[NODE])
    server = await asyncssh.listen(
        "127.0.0.1",
        0,
        server_host_keys=[asyncssh.generate_private_key("ssh-ed25519")],
        server_factory=lambda: _Server(ca, hook, require_auth),
    )
    try:
        yield server.sockets[0].getsockname()[1], (user, cert)
    finally:
        server.close()
        await server.wait_closed()


def _connect(port: int, client_key: Any) -> Any:
    return asyncssh.connect(
        "127.0.0.1", port, username=NODE, client_keys=[client_key], known_hosts=None
    )


@pytest.mark.parametrize("allow", [True, False])
async def test_certificate_check_runs_before_asyncssh(allow: bool) -> None:
    checked: list[tuple[str, tuple[str, ...]]] = []
    accepted: list[SSHOpenSSHCertificate] = []

    def check(username: str, cert: SSHOpenSSHCertificate) -> bool:
        checked.append((username, tuple(cert.principals)))
        return allow

    def hook(conn: SSHServerConnection) -> None:
        hook_certificate_validation(conn, check, accepted.append)

    async with _server(hook) as (port, client_key):
        if allow:
            async with _connect(port, client_key) as conn:
                assert conn.get_extra_info("username") == NODE
        else:
            with pytest.raises(asyncssh.PermissionDenied):
                await _connect(port, client_key)
    # asyncssh validates a certificate when it is offered and again once signed
    assert checked and set(checked) == {(NODE, (NODE,))}
    assert {tuple(c.principals) for c in accepted} == ({(NODE,)} if allow else set())


async def test_a_refused_forwarded_connection_is_reported() -> None:
    server_side: list[SSHServerConnection] = []
    refused: list[asyncssh.ChannelOpenError] = []

    async with _server(server_side.append, require_auth=False) as (port, client_key):
        async with _connect(port, client_key) as conn:
            hook_forwarded_open(conn, refused.append)
            # The gateway side opens a forwarded-tcpip channel the client never asked for.
            with pytest.raises(asyncssh.ChannelOpenError):
                await server_side[0].create_connection(asyncssh.SSHTCPSession, "nowhere", 9)
    assert len(refused) == 1
    assert refused[0].code == asyncssh.OPEN_CONNECT_FAILED
