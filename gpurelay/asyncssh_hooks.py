"""The places where we wrap a private asyncssh method, and the check that they still fit.

asyncssh's public callbacks say *that* something was refused, not *why* or *how often*:

- :func:`hook_certificate_validation` (the gateway): asyncssh checks a client's OpenSSH
  certificate itself and, when the check fails, only moves on to the next key. To count
  and log each refusal by reason (untrusted CA, expired, principal mismatch, revoked ...)
  the gateway runs its own policy first, inside
  ``SSHServerConnection._validate_openssh_certificate(username, cert)``.
- :func:`hook_undecodable_certificate` (the gateway): a certificate asyncssh cannot even
  decode (an ``ssh-keygen -O critical:...`` option it does not know, a damaged blob) is
  dropped inside ``SSHServerConnection._validate_client_certificate(username, key_data)``
  without a word; the client then offers its plain key, and the refusal would read "not a
  certificate". The hook says what was wrong with the certificate instead.
- :func:`hook_forwarded_open` (the agent): asyncssh refuses a forwarded connection to an
  endpoint that was never published inside
  ``SSHClientConnection._process_forwarded_tcpip_open(packet)`` and tells the application
  nothing. The agent counts those refusals (``proxy_refused``).

Each wraps the method on one connection object only, never on the class. asyncssh finds
the gateway's through ``self._validate_...`` and the agent's through
``getattr(self, '_process_' + channel_type + '_open')``, so an attribute set on the
instance takes effect.

If asyncssh renames one of these methods or changes its parameters, the hook would silently stop
running (refusals would go uncounted, the gateway would lose its revocation check).
Instead :func:`verify_asyncssh` runs when this module is imported and raises
:class:`AsyncsshChanged` naming what moved, so neither binary starts against an asyncssh
it was not checked with. ``pyproject.toml`` holds asyncssh below 3, and
``tests/unit/core/test_asyncssh_hooks.py`` checks the signatures and runs both hooks on a real
connection. End to end, ``tests/integration/test_tunnel_e2e.py`` (refusal reasons,
revocation) and ``tests/integration/test_proxy.py`` (``proxy_refused``) cover them too.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import asyncssh
from asyncssh.connection import SSHClientConnection, SSHServerConnection
from asyncssh.packet import PacketDecodeError, SSHPacket
from asyncssh.public_key import (
    KeyImportError,
    SSHKey,
    SSHOpenSSHCertificate,
    decode_ssh_certificate,
)

# (class, method, its parameters after self, a coroutine function?)
PRIVATE_API: tuple[tuple[type, str, tuple[str, ...], bool], ...] = (
    (SSHServerConnection, "_validate_openssh_certificate", ("username", "cert"), True),
    (SSHServerConnection, "_validate_client_certificate", ("username", "key_data"), True),
    (SSHClientConnection, "_process_forwarded_tcpip_open", ("packet",), False),
)


class AsyncsshChanged(RuntimeError):
    """The installed asyncssh no longer has a private method that these hooks wrap."""


def verify_asyncssh() -> None:
    """Raise :class:`AsyncsshChanged` unless each wrapped method is still there, with the
    same parameters and the same sync/async nature."""
    for cls, name, params, is_async in PRIVATE_API:
        where = f"asyncssh {asyncssh.__version__}: {cls.__name__}.{name}"
        method = getattr(cls, name, None)
        if method is None:
            raise AsyncsshChanged(f"{where} is gone; gpurelay.asyncssh_hooks must be updated")
        found = tuple(inspect.signature(method).parameters)[1:]
        if found != params or inspect.iscoroutinefunction(method) != is_async:
            kind = "async " if inspect.iscoroutinefunction(method) else ""
            raise AsyncsshChanged(
                f"{where} is now {kind}({', '.join(found)}), the hook expects "
                f"{'async ' if is_async else ''}({', '.join(params)}); "
                "gpurelay.asyncssh_hooks must be updated"
            )


verify_asyncssh()


def hook_certificate_validation(
    conn: SSHServerConnection,
    check: Callable[[str, SSHOpenSSHCertificate], bool],
    accepted: Callable[[SSHOpenSSHCertificate], None],
) -> None:
    """Run ``check(username, cert)`` before asyncssh validates a client certificate on
    ``conn``. False refuses the certificate (``check`` records why); True lets asyncssh
    validate it as usual, and ``accepted(cert)`` is called when asyncssh accepts it too.
    Both may run twice for one login: asyncssh validates a certificate when the client
    offers it and again when the client signs with it."""
    original = conn._validate_openssh_certificate

    async def validate(username: str, cert: SSHOpenSSHCertificate) -> SSHKey | None:
        if not check(username, cert):
            return None
        key = await original(username, cert)
        if key is not None:
            accepted(cert)
        return key

    conn._validate_openssh_certificate = validate  # type: ignore[method-assign]


def hook_undecodable_certificate(
    conn: SSHServerConnection, on_undecodable: Callable[[str, str], None]
) -> None:
    """Call ``on_undecodable(username, why)`` when a client on ``conn`` offers an OpenSSH
    certificate that asyncssh cannot decode; asyncssh still refuses it."""
    original = conn._validate_client_certificate

    async def validate(username: str, key_data: bytes) -> SSHKey | None:
        key: SSHKey | None = await original(username, key_data)
        if key is None and is_certificate_blob(key_data):
            try:
                decode_ssh_certificate(key_data)
            except KeyImportError as exc:  # asyncssh keeps the detail in the context
                on_undecodable(username, str(exc.__context__ or exc))
        return key

    conn._validate_client_certificate = validate  # type: ignore[method-assign]


def is_certificate_blob(key_data: bytes) -> bool:
    """Whether ``key_data`` names an OpenSSH certificate algorithm (``...-cert-v01@...``)."""
    try:
        return SSHPacket(key_data).get_string().endswith(b"-cert-v01@openssh.com")
    except PacketDecodeError:
        return False


def hook_forwarded_open(
    conn: SSHClientConnection, on_refused: Callable[[asyncssh.ChannelOpenError], None]
) -> None:
    """Call ``on_refused(error)`` each time ``conn`` refuses a forwarded-tcpip channel (the
    peer asked for an address:port with no remote forward); the refusal still happens."""
    original = conn._process_forwarded_tcpip_open

    def process(packet: Any) -> Any:
        try:
            return original(packet)
        except asyncssh.ChannelOpenError as exc:
            on_refused(exc)
            raise

    conn._process_forwarded_tcpip_open = process  # type: ignore[method-assign]
