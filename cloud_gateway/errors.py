"""The gateway's exception hierarchy: every error a user can cause has a clear message."""

from __future__ import annotations


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
