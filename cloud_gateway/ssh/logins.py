"""Who may log in to the gateway's SSH server: the certificate policy and the
per-connection callbacks (certificate auth, enrollment logins, remote forwards as
published endpoints). :mod:`cloud_gateway.ssh.server` listens and runs the channels.

A client is accepted only with an OpenSSH user certificate that :class:`CertificatePolicy`
accepts (trusted user CA, valid now, exactly one principal equal to the login name, not
revoked), or, with ``[enroll]`` on, as ``enroll:NODE`` with a one-time token
(:mod:`cloud_gateway.ssh.enrollment`). Every refusal is counted by reason and logged once per
connection, with the node, key id and serial it was about.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import asyncssh
from asyncssh.public_key import SSHOpenSSHCertificate

from cloud_gateway.relay.endpoints import EndpointTable, PublishedListener
from cloud_gateway.ssh.enrollment import REFUSALS as ENROLL_REFUSALS
from cloud_gateway.ssh.enrollment import Enrollment, EnrollmentLogin
from cloud_gateway.trust.auth_policy import REASONS, check_user_certificate, describe
from cloud_gateway.trust.revocation import RevocationList, RevocationWatcher
from gpurelay.asyncssh_hooks import hook_certificate_validation, hook_undecodable_certificate
from gpurelay.logs import node_logger
from gpurelay.ssh_cert import certificate_info

log = logging.getLogger("cloud_gateway.ssh_server")  # the server's lines, wherever written

# gpurelay_gateway_auth_failures_total{reason}: the certificate checks', the two asyncssh
# refusals before them, and enrollment's (anything else is counted as "other").
AUTH_REASONS: tuple[str, ...] = (*REASONS, "bad_certificate", "not_a_certificate", *ENROLL_REFUSALS)


def node_log(node: str) -> logging.Logger:
    """A child logger per node, so every line says which node it is about."""
    return node_logger(log, node)


@dataclass
class Held:
    """What a held connection's certificate last passed under (:meth:`CertificatePolicy.
    recheck`): the revocation list, the trusted CAs' keys, and until when (its
    ``valid_before``); ``until`` 0: never checked here."""

    revoked: RevocationList | None = None
    cas: tuple[bytes, ...] = ()
    until: float = 0.0


@dataclass
class CertificatePolicy:
    """Which user certificates the gateway accepts, and the count of refusals by reason."""

    trusted_cas: Sequence[asyncssh.SSHKey]
    revocations: RevocationWatcher | None = None
    clock: Callable[[], float] = time.time
    failures: Counter[str] = field(default_factory=Counter)
    enrollment: Enrollment | None = None  # [enroll]: password logins of enroll:NODE only

    def check(self, username: str, cert: SSHOpenSSHCertificate) -> str | None:
        revoked = self.revocations.current() if self.revocations else RevocationList()
        return check_user_certificate(
            username, cert, trusted_cas=self.trusted_cas, revoked=revoked, now=self.clock()
        )

    def trust_state(self) -> tuple[RevocationList | None, tuple[bytes, ...]]:
        """What a held certificate's verdict depends on besides the time: the revocation
        list in force (a new one is a new object) and the trusted CAs' keys."""
        revoked = self.revocations.current() if self.revocations else None
        return revoked, tuple(ca.public_data for ca in self.trusted_cas)

    def recheck(
        self,
        username: str,
        cert: SSHOpenSSHCertificate,
        held: Held,
        state: tuple[RevocationList | None, tuple[bytes, ...]] | None = None,
    ) -> str | None:
        """:meth:`check` of a connection that passed before, by what can change its verdict:
        :meth:`trust_state` (``state``: taken once for many connections) and the time
        reaching the certificate's ``valid_before``. While none has changed since it last
        passed, it passes without the check (the tick asks about every connection every
        second); ``held`` remembers what it passed under."""
        revoked, cas = self.trust_state() if state is None else state
        if held.revoked is revoked and held.cas == cas and self.clock() < held.until:
            return None
        reason = self.check(username, cert)
        if reason is None:
            held.revoked, held.cas = revoked, cas
            held.until = certificate_info(cert).valid_before
        return reason

    def is_trusted_ca(self, key: asyncssh.SSHKey) -> bool:
        blob = key.public_data
        return any(ca.public_data == blob for ca in self.trusted_cas)


class ConnectionAuth(EnrollmentLogin, asyncssh.SSHServer):
    """Per-connection callbacks: certificate auth, and remote forwards as published
    endpoints. asyncssh's defaults refuse everything else (shells, local forwards...)."""

    _policy: CertificatePolicy

    def __init__(
        self,
        policy: CertificatePolicy,
        endpoints: EndpointTable | None,
        live: set[ConnectionAuth] | None = None,
    ) -> None:
        self._policy = policy
        self._live = live  # every certificate-authenticated connection, for revalidation
        self._endpoints = endpoints
        self._conn: asyncssh.SSHServerConnection | None = None
        self._username = ""
        self._reason = ""
        self._detail = ""
        self._authenticated = False
        self.certificate: SSHOpenSSHCertificate | None = None  # the accepted one
        self.held = Held()  # what it passed under when the tick last rechecked it
        self._peer: tuple[str, int] | None = None

    def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
        self._conn = conn
        self._peer = conn.get_extra_info("peername")

        def check(username: str, cert: SSHOpenSSHCertificate) -> bool:
            reason = self._policy.check(username, cert)
            if reason is not None:
                self._refuse(username, reason, describe(reason, username, cert))
            return reason is None

        def accepted(cert: SSHOpenSSHCertificate) -> None:
            self.certificate = cert

        # asyncssh validates certificates itself but does not say *why* one failed. Check
        # first with our policy (which also knows revocations), then let asyncssh re-check.
        hook_certificate_validation(conn, check, accepted)

        def undecodable(username: str, why: str) -> None:
            detail = f"node {username!r} offered a certificate that cannot be used: {why!r}"
            self._refuse(username, "bad_certificate", detail)

        hook_undecodable_certificate(conn, undecodable)

    def _refuse(self, username: str, reason: str, detail: str) -> None:
        self._username, self._reason, self._detail = username, reason, detail

    def begin_auth(self, username: str) -> bool:
        self._username = username
        self.enrollment_begins(username)
        return True

    def public_key_auth_supported(self) -> bool:
        return True

    def validate_public_key(self, username: str, key: asyncssh.SSHKey) -> bool:
        # asyncssh also lands here after a refused certificate: keep the better reason.
        if not self._reason:
            self._refuse(username, "not_a_certificate", f"node {username!r} offered a plain key")
        return False

    def validate_ca_key(self, username: str, key: asyncssh.SSHKey) -> bool:
        return self._policy.is_trusted_ca(key)

    @property
    def node(self) -> str:
        return self._username

    @property
    def connection(self) -> asyncssh.SSHServerConnection | None:
        return self._conn

    def auth_completed(self) -> None:
        self._authenticated = True
        if self._live is not None and self.certificate is not None:
            self._live.add(self)  # re-checked on every tick until it is gone
        if self._conn is not None:
            self.enrollment_authenticated(self._conn)  # an enroll: connection's idle timer

    def server_requested(self, listen_host: str, listen_port: int) -> bool | PublishedListener:
        """An agent offers NODE:PORT through its tunnel (an SSH remote forward)."""
        if not self._authenticated or self._endpoints is None or self._conn is None:
            return False
        if self.enrolling is not None:  # an enroll: connection gets its certificate only
            return False
        node = self._username
        reason = self._endpoints.offer(
            via=node, name=listen_host, port=listen_port, conn=self._conn
        )
        if reason is not None:
            self._endpoints.refused += 1
            node_log(node).warning(
                "refused to publish %r port %d: %s", listen_host, listen_port, reason
            )
            return False
        node_log(node).info("publishes %r port %d", listen_host, listen_port)
        return PublishedListener(self._endpoints, listen_host, listen_port, self._conn)

    def connection_lost(self, exc: Exception | None) -> None:
        self.enrollment_opened()  # no idle timer left behind
        if self._live is not None:
            self._live.discard(self)
        if not self._authenticated and self._reason:
            self._policy.failures[self._reason] += 1
            if self._reason == "enroll_throttled":
                return  # logged by the limiter, throttled itself
            # the address saved at connect: the transport is gone by now
            peer = f"{self._peer[0]}:{self._peer[1]}" if self._peer else "an unknown address"
            log.warning(
                "refused %r from %s: %s (%s)",
                self._username,
                peer,
                self._reason,
                self._detail,
            )
