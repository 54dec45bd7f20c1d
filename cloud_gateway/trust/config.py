"""``[enroll]``: nodes get and renew their certificates over SSH (served by
:mod:`cloud_gateway.ssh.enrollment`), owned here, assembled by :mod:`cloud_gateway.config`."""

from __future__ import annotations

from dataclasses import dataclass

from cloud_gateway.errors import GatewayConfigError

WEEK = 7 * 86400
MIN_LIFETIME_SECONDS = 60  # of a certificate the gateway or the signer issues
DEFAULT_MIN_RSA_BITS = 3072
LOWEST_MIN_RSA_BITS = 2048  # a floor below this is a configuration error


def check_min_rsa_bits(bits: object, name: str) -> None:
    """GatewayConfigError unless ``bits`` is a usable floor; ``name`` says where it was set."""
    if isinstance(bits, bool) or not isinstance(bits, int) or bits < LOWEST_MIN_RSA_BITS:
        raise GatewayConfigError(
            f"{name} must be an integer of at least {LOWEST_MIN_RSA_BITS} (default 3072)"
        )


@dataclass(frozen=True, kw_only=True)
class EnrollConfig:
    """``[enroll]``: nodes get (and renew) their certificate over SSH. Off by default: the
    gateway then accepts no password at all."""

    enabled: bool = False
    # Exactly one when enabled: the user CA private key (the gateway signs; the key's
    # directory holds the serial counter and issued.log), or a `cloud-gateway signer`.
    user_ca_key: str = ""
    signer_socket: str = ""
    lifetime_seconds: int = WEEK  # of each certificate issued; 7 days recommended
    token_max_ttl_seconds: int = WEEK  # tokens valid for longer than this are refused
    min_rsa_bits: int = DEFAULT_MIN_RSA_BITS  # weaker RSA keys (and DSA) get no certificate


def check_enroll(section: EnrollConfig) -> None:
    for name in ("lifetime_seconds", "token_max_ttl_seconds"):
        if getattr(section, name) < MIN_LIFETIME_SECONDS:
            raise GatewayConfigError(f"enroll.{name} must be at least {MIN_LIFETIME_SECONDS}")
    check_min_rsa_bits(section.min_rsa_bits, "enroll.min_rsa_bits")
    if section.enabled and bool(section.user_ca_key) == bool(section.signer_socket):
        raise GatewayConfigError(
            "enroll.enabled needs exactly one of enroll.user_ca_key (the gateway signs) and "
            "enroll.signer_socket (a `cloud-gateway signer` process signs)"
        )
