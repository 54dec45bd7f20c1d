"""Enrollment and renewal on the gateway (issue 17 §1; the contract is gpurelay/enrollment.py).

A new node logs in as ``enroll:NODE`` with a one-time token as its password
(:meth:`Enrollment.check_login`: the token parses, a trusted user CA signed it, it names
NODE, it has not expired, NODE is not revoked, its nonce was not used), then sends its
public key on the ``gpurelay-enroll`` subsystem and gets a certificate back
(:meth:`Enrollment.serve`). A connected node renews on ``gpurelay-renew`` over its normal,
certificate-authenticated connection, always for its own node name.

The nonce of a used token is recorded in the node directory (SQLite, or PostgreSQL shared
by a cluster: a second use is refused on every gateway), or, for a gateway whose inventory
is in memory only, in memory (forgotten at a restart). Every refusal is counted and
logged with its reason and node; the token itself is never logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import asyncssh

from cloud_gateway.cluster.directory import DirectoryError
from cloud_gateway.cluster.nonces import MemoryNonces
from cloud_gateway.errors import GatewayConfigError, GatewayError
from cloud_gateway.names import node_name_problem
from cloud_gateway.trust.auth_policy import format_time, refusal
from cloud_gateway.trust.config import EnrollConfig
from cloud_gateway.trust.key_policy import check_node_key
from cloud_gateway.trust.login_limit import LoginLimiter
from cloud_gateway.trust.revocation import RevocationList, RevocationWatcher
from cloud_gateway.trust.signing import (
    LocalSigner,
    Signer,
    SigningRefused,
    parse_public_key,
)
from gpurelay.enrollment import (
    ENROLL_SUBSYSTEM,
    EXIT_OK,
    EXIT_REFUSED,
    MAX_PUBLIC_KEY_LINE,
    REASON_DISABLED,
    REASON_EXPIRED,
    REASON_NOT_A_KEY,
    REASON_OTHER_NODE,
    REASON_REVOKED,
    REASON_USED,
    RENEW_SUBSYSTEM,
    Token,
    TokenError,
    error_line,
    node_from_username,
    parse_token,
    verify_token,
)
from gpurelay.logs import node_logger

if TYPE_CHECKING:
    from cloud_gateway.cluster.link import DirectoryLink

log = logging.getLogger("cloud_gateway.enrollment")

SUBSYSTEMS = (ENROLL_SUBSYSTEM, RENEW_SUBSYSTEM)
KEY_TIMEOUT_SECONDS = 30.0  # to send the public key once the subsystem is open
# An enroll: connection that opens no gpurelay-enroll subsystem within this is closed; one
# that did is closed right after its answer (an idle token login must not hold a slot).
IDLE_SECONDS = 30.0
CLOSE_AFTER_ANSWER_SECONDS = 5.0  # for the client to take the answer and close its channel
# A node renews at most this often on one gateway: each certificate is an issued.log line,
# and a compromised node must not fill the CA's disk (an agent renews once a lifetime).
RENEW_INTERVAL_SECONDS = 10.0
RENEWED_PRUNE_AT = 1024  # nodes remembered as renewed before the old ones are dropped
WEEK = 7 * 86400


# Refused enrollment logins, by reason (gpurelay_gateway_auth_failures_total{reason}).
REFUSALS: tuple[str, ...] = (
    "password_for_node",  # a node name offered a password: nodes log in by certificate
    "enroll_disabled",
    "enroll_bad_node",
    "enroll_bad_token",
    "enroll_bad_signature",
    "enroll_other_node",
    "enroll_expired",
    "enroll_ttl_too_long",
    "enroll_revoked",
    "enroll_unavailable",  # the node directory could not say whether the token was used
    "enroll_used",
    "enroll_throttled",  # over the login limits (cloud_gateway.trust.login_limit), not checked
)


@dataclass(frozen=True, slots=True)
class Refusal:
    code: str  # gpurelay_gateway_auth_failures_total{reason}
    detail: str  # the log line's explanation; never the token


class NonceStore(Protocol):
    async def enrollment_nonce_used(self, nonce: str) -> bool: ...

    async def use_enrollment_nonce(
        self, nonce: str, node: str, exp: int, *, now: float
    ) -> bool: ...


def node_log(node: str) -> logging.Logger:
    return node_logger(log, node)


class Enrollment:
    def __init__(
        self,
        section: EnrollConfig,
        *,
        trusted_cas: Sequence[asyncssh.SSHKey],
        revocations: RevocationWatcher | None,
        nonces: NonceStore,
        signer: Signer,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.section = section
        self.trusted_cas = trusted_cas
        self.revocations = revocations
        self.nonces = nonces
        self.signer = signer
        self.clock = clock
        self.issued = {"enroll": 0, "renew": 0}
        self.renew_interval = RENEW_INTERVAL_SECONDS
        self._renewed: dict[str, float] = {}  # node -> time.monotonic() of its last renewal
        self.limiter = LoginLimiter()  # password logins per source address and in all
        self.idle_seconds = IDLE_SECONDS

    def _revoked(self) -> RevocationList:
        return self.revocations.current() if self.revocations else RevocationList()

    async def check_login(self, username: str, password: str) -> Token | Refusal:
        """The verdict on a password login: the token to enroll with, or why not."""
        node = node_from_username(username)
        if node is None:
            return Refusal(
                "password_for_node",
                f"node {username!r} offered a password: nodes log in with a certificate only",
            )
        problem = node_name_problem(node)
        if problem is not None:
            return Refusal("enroll_bad_node", f"enrollment as {username!r}: {problem}")
        try:
            token = parse_token(password)
        except TokenError as exc:
            return Refusal("enroll_bad_token", f"node {node!r}: not an enrollment token: {exc}")
        if not verify_token(token, self.trusted_cas):
            return Refusal(
                "enroll_bad_signature",
                f"node {node!r}: the token is not signed by a trusted user CA (ssh.user_ca)",
            )
        return await self._check_token(node, token)

    async def _check_token(self, node: str, token: Token) -> Token | Refusal:
        now = self.clock()
        if token.node != node:
            return Refusal(
                "enroll_other_node", f"node {node!r}: the token is for node {token.node!r}"
            )
        if now >= token.exp:
            return Refusal(
                "enroll_expired", f"node {node!r}: the token expired at {format_time(token.exp)}"
            )
        if token.exp - now > self.section.token_max_ttl_seconds:
            return Refusal(
                "enroll_ttl_too_long",
                f"node {node!r}: the token is valid until {format_time(token.exp)}, longer "
                f"than enroll.token_max_ttl_seconds ({self.section.token_max_ttl_seconds})",
            )
        rule = self._revoked().is_revoked(node=node)
        if rule is not None:
            return Refusal("enroll_revoked", f"node {node!r} is revoked ('{rule}')")
        try:
            used = await self.nonces.enrollment_nonce_used(token.nonce)
        except DirectoryError as exc:
            return Refusal("enroll_unavailable", f"node {node!r}: {exc}")
        if used:
            return Refusal("enroll_used", f"node {node!r}: the token was used already")
        return token

    async def serve(
        self,
        process: asyncssh.SSHServerProcess[bytes],
        *,
        username: str,
        token: Token | None,
        certificate: object,
    ) -> None:
        """One ``gpurelay-enroll`` or ``gpurelay-renew`` session, or a refusal of anything
        else on an ``enroll:`` connection."""
        kind = "enroll" if token is not None else "renew"
        node = token.node if token is not None else username
        wanted = ENROLL_SUBSYSTEM if token is not None else RENEW_SUBSYSTEM
        try:  # read first: a client that writes its key, then reads, is told why
            async with asyncio.timeout(KEY_TIMEOUT_SECONDS):
                public_key = await _read_key(process)
            if process.subsystem != wanted:
                raise SigningRefused(
                    f"only the {wanted} subsystem is offered on this connection",
                    f"asked for {process.subsystem or process.command or 'a shell'!r} "
                    f"on an {'enrollment' if token else 'authenticated'} connection",
                )
            check_node_key(public_key, min_rsa_bits=self.section.min_rsa_bits)
            if token is not None:
                await self._use(node, token, public_key)
            else:  # the whole login policy, now; then the budget's slot, before any await
                self._check_renewal(node, certificate)
                self._renew_budget(node)
            issued = await self.signer.sign(
                node, public_key, reason=kind, lifetime_seconds=self.section.lifetime_seconds
            )
            if token is None:  # revoked while the signer worked: never handed out
                self._check_renewal(node, certificate)
        except SigningRefused as exc:
            node_log(node).warning("refused to %s %r: %s", kind, node, exc)
            _finish(process, error_line(exc.reason), EXIT_REFUSED)
            return
        except TimeoutError:
            node_log(node).warning("refused to %s %r: no public key within 30s", kind, node)
            _finish(process, error_line("no public key received"), EXIT_REFUSED)
            return
        except (GatewayError, OSError) as exc:
            node_log(node).error("cannot %s %r: %s", kind, node, exc)
            _finish(process, error_line("the gateway cannot sign now"), EXIT_REFUSED)
            return
        self.issued[kind] += 1
        node_log(node).info("%s", issued.describe(kind))
        _finish(process, issued.certificate + "\n", EXIT_OK, stdout=True)

    async def _use(self, node: str, token: Token, public_key: str) -> None:
        parse_public_key(public_key)  # a bad request does not cost the token
        verdict = await self._check_token(node, token)  # time has passed since the login
        if isinstance(verdict, Refusal):
            raise SigningRefused(_agent_reason(verdict.code), verdict.detail)
        try:
            fresh = await self.nonces.use_enrollment_nonce(
                token.nonce, node, token.exp, now=self.clock()
            )
        except DirectoryError as exc:
            raise GatewayError(f"the token's use cannot be recorded: {exc}") from exc
        if not fresh:
            raise SigningRefused(REASON_USED, "the token was used meanwhile")

    def _note_renewal(self, node: str, now: float) -> None:
        if len(self._renewed) >= RENEWED_PRUNE_AT:  # bounded: only recent renewals matter
            interval = self.renew_interval
            self._renewed = {n: t for n, t in self._renewed.items() if now - t < interval}
        self._renewed[node] = now

    def _renew_budget(self, node: str) -> None:
        """Take the node's slot or refuse; taken before signing (an await), or 20 parallel
        renewals get 20 certificates. A refused signing still costs the slot."""
        now, last = time.monotonic(), self._renewed.get(node)
        if last is not None and now - last < self.renew_interval:
            budget = f"at most one renewal per {self.renew_interval:g}s per node on this gateway"
            raise SigningRefused("renewed too recently", budget)
        self._note_renewal(node, now)

    def _check_renewal(self, node: str, cert: object) -> None:
        """The certificate presented logs in *now* (it may be revoked or expired since)."""
        now, revoked = self.clock(), self._revoked()
        refused = refusal(node, cert, trusted_cas=self.trusted_cas, revoked=revoked, now=now)
        if refused is not None:
            code, detail = refused
            raise SigningRefused(REASON_REVOKED if code == "revoked" else code, detail)


def _agent_reason(code: str) -> str:
    return {
        "enroll_expired": REASON_EXPIRED,
        "enroll_used": REASON_USED,
        "enroll_revoked": REASON_REVOKED,
        "enroll_other_node": REASON_OTHER_NODE,
    }.get(code, code.removeprefix("enroll_").replace("_", " "))


async def _read_key(process: asyncssh.SSHServerProcess[bytes]) -> str:
    data = b""
    while len(data) <= MAX_PUBLIC_KEY_LINE:
        chunk = await process.stdin.read(MAX_PUBLIC_KEY_LINE + 1 - len(data))
        if not chunk:
            break
        data += chunk
    if len(data) > MAX_PUBLIC_KEY_LINE:
        raise SigningRefused(REASON_NOT_A_KEY, f"more than {MAX_PUBLIC_KEY_LINE} bytes sent")
    try:
        return data.decode("ascii")
    except UnicodeDecodeError:
        raise SigningRefused(REASON_NOT_A_KEY, "the public key line is not ASCII") from None


def _finish(
    process: asyncssh.SSHServerProcess[bytes], text: str, status: int, *, stdout: bool = False
) -> None:
    stream = process.stdout if stdout else process.stderr
    try:
        stream.write(text.encode())
        process.exit(status)
    except (OSError, asyncssh.Error):
        pass  # the client went away


async def refuse_disabled(process: asyncssh.SSHServerProcess[bytes], username: str) -> None:
    with contextlib.suppress(TimeoutError, SigningRefused, OSError, asyncssh.Error):
        async with asyncio.timeout(KEY_TIMEOUT_SECONDS):
            await _read_key(process)
    node_log(username).warning(
        "refused %s from %r: enrollment is disabled ([enroll] enabled = false)",
        process.subsystem,
        username,
    )
    _finish(process, error_line(REASON_DISABLED), EXIT_REFUSED)


def wants_enrollment(process: asyncssh.SSHServerProcess[bytes], username: str) -> bool:
    """Whether this session is :meth:`Enrollment.serve`'s (or a refusal of it)."""
    return process.subsystem in SUBSYSTEMS or node_from_username(username) is not None


class _Refuser(Protocol):
    enrollment: Enrollment | None


class EnrollmentLogin:
    """The password half of the SSH server's per-connection callbacks (a mixin of
    ``ssh_auth.ConnectionAuth``): password logins exist only for ``enroll:NODE`` and
    only while enrollment is on; node users stay certificate-only."""

    _policy: _Refuser
    _peer: tuple[str, int] | None  # the client's address (the PROXY header's, if any)
    enrolling: Token | None = None  # the token this connection logged in with
    _idle: asyncio.TimerHandle | None = None

    def _refuse(self, username: str, reason: str, detail: str) -> None:
        raise NotImplementedError

    def enrollment_begins(self, username: str) -> None:
        """From ``begin_auth``: an ``enroll:`` login while enrollment is off gets its reason."""
        if self._policy.enrollment is None and node_from_username(username) is not None:
            detail = f"{username!r}: enrollment is disabled ([enroll] enabled = false)"
            self._refuse(username, "enroll_disabled", detail)

    def password_auth_supported(self) -> bool:
        return self._policy.enrollment is not None

    def kbdint_auth_supported(self) -> bool:
        return False  # else asyncssh offers keyboard-interactive as a second password path

    async def validate_password(self, username: str, password: str) -> bool:
        enrollment = self._policy.enrollment
        if enrollment is None:
            return False
        over = enrollment.limiter.allow(self._peer[0] if self._peer else "?")
        if over is not None:
            enrollment.limiter.log_refusal(username, over)
            self._refuse(username, "enroll_throttled", over)
            return False
        verdict = await enrollment.check_login(username, password)
        if isinstance(verdict, Refusal):
            self._refuse(username, verdict.code, verdict.detail)
            return False
        self.enrolling = verdict
        return True

    def enrollment_authenticated(self, conn: asyncssh.SSHServerConnection) -> None:
        """From ``auth_completed``: an ``enroll:`` connection has ``idle_seconds`` to open
        the ``gpurelay-enroll`` subsystem, then it is closed."""
        enrollment, token = self._policy.enrollment, self.enrolling
        if enrollment is None or token is None:
            return

        def idle() -> None:
            node_log(token.node).warning(
                "closed the enrollment connection of %r: no %s subsystem within %gs",
                token.node,
                ENROLL_SUBSYSTEM,
                enrollment.idle_seconds,
            )
            conn.close()

        self._idle = asyncio.get_running_loop().call_later(enrollment.idle_seconds, idle)

    def enrollment_opened(self) -> None:
        """The ``gpurelay-enroll`` subsystem is open (or the connection is gone)."""
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None


async def serve_enrollment(
    enrollment: Enrollment | None, process: asyncssh.SSHServerProcess[bytes], username: str
) -> None:
    """A session :func:`wants_enrollment` picked: served, or refused."""
    if enrollment is None:
        await refuse_disabled(process, username)
        return
    conn = process.get_extra_info("connection")
    owner = conn.get_owner()
    token = getattr(owner, "enrolling", None)
    answering = token is not None and process.subsystem == ENROLL_SUBSYSTEM
    if answering and isinstance(owner, EnrollmentLogin):
        owner.enrollment_opened()
    await enrollment.serve(
        process, username=username, token=token, certificate=getattr(owner, "certificate", None)
    )
    if answering:  # answered: nothing more to do here, whatever the answer was
        with contextlib.suppress(TimeoutError):  # the client takes it and closes its channel
            async with asyncio.timeout(CLOSE_AFTER_ANSWER_SECONDS):
                await process.channel.wait_closed()
        conn.close()


def build_enrollment(
    section: EnrollConfig,
    *,
    trusted_cas: Sequence[asyncssh.SSHKey],
    revocations: RevocationWatcher | None,
    link: DirectoryLink,
    clock: Callable[[], float] = time.time,
) -> Enrollment | None:
    """The gateway's enrollment (None: disabled). Its nonces go where its inventory is."""
    if not section.enabled:
        return None
    signer: Signer
    if section.user_ca_key:
        try:
            local = LocalSigner(Path(section.user_ca_key), revocations=revocations)
        except GatewayError as exc:
            raise GatewayConfigError(f"enroll.user_ca_key: {exc}") from exc
        blob = local.ca_key.public_data
        if not any(ca.public_data == blob for ca in trusted_cas):
            raise GatewayConfigError(
                f"enroll.user_ca_key {section.user_ca_key} is not one of the CAs in "
                "ssh.user_ca: the certificates it signs would be refused"
            )
        signer = local
    else:
        from cloud_gateway.trust.signer_socket import SocketSigner

        signer = SocketSigner(Path(section.signer_socket))
    nonces: NonceStore
    if link.cluster is not None:
        nonces = link.cluster.directory
    elif link.directory is not None:
        nonces = link.directory
    else:
        nonces = MemoryNonces()
    log.info(
        "enrollment on: %s signs, certificates for %ds, used tokens recorded in %s",
        f"CA key {section.user_ca_key}" if section.user_ca_key else section.signer_socket,
        section.lifetime_seconds,
        link.where,
    )
    return Enrollment(
        section,
        trusted_cas=trusted_cas,
        revocations=revocations,
        nonces=nonces,
        signer=signer,
        clock=clock,
    )
