"""The gateway's exception hierarchy: every error a user can cause has a clear message."""

from __future__ import annotations

import errno
import os


class GatewayError(Exception):
    """Base class for errors the gateway reports to a user."""


class GatewayConfigError(GatewayError):
    """The gateway's configuration file or a CLOUD_GATEWAY_* variable is invalid."""


class InvalidInput(GatewayError):
    """A name, number or file given by the user is unusable (the CLI exits 2 for these)."""


class InvalidNodeName(InvalidInput, ValueError):
    """A node name is not a DNS-1123 label."""


class CertError(GatewayError):
    """A fleet PKI operation failed (CA missing or already present, unreadable key, ...)."""


class CaExistsError(CertError):
    """``init-ca`` would overwrite existing CA keys."""


class CaNotFoundError(CertError):
    """The CA directory does not hold the CA key an operation needs."""


class RevocationFileError(GatewayError):
    """The revocation list cannot be read or has a malformed line (the message says which)."""


class ListenError(GatewayError):
    """A listener cannot bind its address (taken, not this machine's, no permission)."""


_LISTEN_HINTS = {
    errno.EADDRINUSE: "another process listens there",
    errno.EACCES: "a port below 1024 needs root or CAP_NET_BIND_SERVICE",
    errno.EADDRNOTAVAIL: "no interface of this machine has that address",
}


def listen_error(listener: str, key: str, host: str, port: int, exc: OSError) -> ListenError:
    """``exc`` from binding ``listener`` (SSH, HTTP, ...) as set by ``key``, in one line."""
    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if exc.errno is not None and exc.errno in _LISTEN_HINTS:
        reason = f"{os.strerror(exc.errno).lower()} ({_LISTEN_HINTS[exc.errno]})"
    else:
        reason = exc.strerror or str(exc)
    return ListenError(f"cannot listen for {listener} on {shown} ({key}): {reason}")
