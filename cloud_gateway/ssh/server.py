"""The gateway's SSH server: authenticate agents by node certificate, carry their frames.

asyncssh owns connections and channels; this module supplies the callbacks. A client is
accepted only with an OpenSSH user certificate that :class:`CertificatePolicy` accepts
(trusted user CA, valid now, exactly one principal equal to the login name, not revoked).
The login name *is* the node name from then on. Every refusal is counted by reason and
logged once per connection, with the node, key id and serial it was about.

Each authenticated connection may open one session channel with the ``gpurelay``
subsystem. Bytes are decoded into frames here and handed to a :class:`Session` supplied
by the application (the ingest stage); what it sends the agent (ACKs, HEARTBEATs) it
writes through the ``send`` it was opened with, when it decides. This module only tells
it when a read's frames were all handled (:meth:`Session.read_done`) and when the
connection is about to end (:meth:`Session.flush`).
After each chunk the channel awaits :meth:`Session.flow`: while a session is over its
queue bound the channel stops reading, and SSH flow control holds the agent. A frame that
breaks the contract gets an ERROR frame back and the connection is closed; other nodes are
not affected.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import suppress
from typing import Any, Protocol

import asyncssh
from asyncssh.public_key import SSHOpenSSHCertificate

from cloud_gateway.cluster.admission import Admission, AdmissionRefused
from cloud_gateway.errors import listen_error
from cloud_gateway.metrics import FamilySamples, fixed, one
from cloud_gateway.relay.endpoints import EndpointTable
from cloud_gateway.ssh.balancer_header import REFUSALS
from cloud_gateway.ssh.balancer_listener import ProxiedListener
from cloud_gateway.ssh.enrollment import serve_enrollment, wants_enrollment
from cloud_gateway.ssh.logins import AUTH_REASONS, CertificatePolicy, ConnectionAuth, node_log
from cloud_gateway.trust.auth_policy import describe
from gpurelay.enrollment import EXIT_REFUSED, error_line
from gpurelay.wire import (
    READ_CHUNK,
    SUBSYSTEM,
    Declare,
    ErrorFrame,
    Frame,
    FrameDecoder,
    FrameEncoder,
    Goodbye,
    Hello,
    Limits,
    WireError,
)
from gpurelay.wire.frames import WIRE_ERROR_CODES

log = logging.getLogger("cloud_gateway.ssh_server")


# The kernel completes this many TCP handshakes while the loop is busy (a fleet
# reconnecting at once); beyond it a SYN is dropped, which an agent cannot tell from a dead
# uplink. asyncssh's default is 100; Linux caps it at net.core.somaxconn (4096 here).
LISTEN_BACKLOG = 4096


class Session(Protocol):
    """One authenticated telemetry channel, as the ingest stage sees it."""

    def handle(self, frame: Frame) -> None:
        """Apply one frame. Raise WireError to reject it."""

    async def flow(self) -> None:
        """Return when the session can take more (at once, unless it is over a bound)."""

    def received(self, nbytes: int) -> None:
        """``nbytes`` more bytes arrived on the channel (for per-node accounting)."""

    def read_done(self) -> None:
        """The frames of one read were all handled."""

    def flush(self) -> None:
        """The connection is about to end: write what waits (gathered ACKs)."""

    def closed(self, reason: str) -> None:
        """The channel is gone (for whatever reason); called exactly once."""


class SessionFactory(Protocol):
    def open_session(
        self,
        node: str,
        remote: str,
        close: Callable[[str], None],
        send: Callable[[Frame], None],
    ) -> Session:
        """``close(reason)`` lets the ingest stage drop this connection (a newer one won);
        ``send(frame)`` writes a frame to the agent (ACKs, HEARTBEATs)."""


class SshServer:
    """Listens, authenticates, and runs one :class:`Session` per telemetry channel."""

    def __init__(
        self,
        *,
        host_keys: Sequence[tuple[asyncssh.SSHKey, asyncssh.SSHCertificate | None]],
        policy: CertificatePolicy,
        sessions: SessionFactory,
        limits: Limits,
        login_timeout: float = 30.0,
        frame_timeout: float = 60.0,
        max_channels_per_connection: int = 1,
        keepalive_seconds: float = 30.0,
        keepalive_count_max: int = 3,
        endpoints: EndpointTable | None = None,
        proxied: ProxiedListener | None = None,
    ) -> None:
        self.frame_timeout = frame_timeout
        self.keepalive_seconds = keepalive_seconds
        self.keepalive_count_max = keepalive_count_max
        self.max_channels_per_connection = max_channels_per_connection
        self.endpoints = endpoints
        self._host_keys = host_keys
        self.policy = policy
        self._sessions = sessions
        self._limits = limits
        self._login_timeout = login_timeout
        self._server: asyncssh.SSHAcceptor | None = None
        self._channels: set[_TelemetryChannel] = set()
        self._authenticated: set[ConnectionAuth] = set()  # by certificate, still open
        self._enrolling: set[asyncssh.SSHServerConnection] = set()  # a renewal in progress
        self.protocol_errors: Counter[str] = Counter()
        self.port = 0
        # One read with DECLAREs at a time per turn of the event loop (see _handle).
        self.declare_gate = asyncio.Semaphore(1)
        self.declare_waits = 0  # reads that waited for it
        self.admission: Admission | None = None  # the node directory, when there is one
        self.refused: Counter[str] = Counter()  # nodes not admitted, by code
        # ssh.proxy_protocol: connections from a balancer start with a PROXY header
        self.proxied = proxied

    async def start(self, host: str, port: int) -> int:
        keys: list[Any] = [(k, c) if c is not None else k for k, c in self._host_keys]
        extra: dict[str, Any] = {}
        if self.proxied is not None:  # it binds the socket, and reads the header first
            self.proxied.backlog = LISTEN_BACKLOG
            extra["tunnel"] = self.proxied
        try:
            self._server = await asyncssh.listen(
                host,
                port,
                server_host_keys=keys,
                server_factory=lambda: ConnectionAuth(
                    self.policy, self.endpoints, self._authenticated
                ),
                process_factory=self._process,
                encoding=None,
                allow_scp=False,
                agent_forwarding=False,
                x11_forwarding=False,
                login_timeout=self._login_timeout,
                # No GSS-API (logins are by certificate): without this asyncssh looks up
                # this host's FQDN (socket.getfqdn, DNS) again for every login, in its
                # small thread pool, which a fleet reconnecting at once queues behind.
                gss_host=None,
                keepalive_interval=self.keepalive_seconds,
                keepalive_count_max=self.keepalive_count_max,
                backlog=LISTEN_BACKLOG,
                **extra,
            )
        except OSError as exc:  # taken, not this machine's address, no permission
            raise listen_error("SSH", "ssh.listen", host, port, exc) from exc
        self.port = self._server.get_port()
        return self.port

    async def _process(self, process: asyncssh.SSHServerProcess[bytes]) -> None:
        node = str(process.get_extra_info("username"))
        peer = process.get_extra_info("peername")
        remote = f"{peer[0]}:{peer[1]}" if peer else "?"
        if wants_enrollment(process, node):  # gpurelay-enroll/-renew, anything of enroll:
            await self._enrollment(process, node)
            return
        if process.subsystem != SUBSYSTEM:
            process.stderr.write(b"only the gpurelay subsystem is offered here\n")
            process.exit(1)
            return
        conn = process.get_extra_info("connection")
        open_here = sum(1 for c in self._channels if c.conn is conn)
        if open_here >= self.max_channels_per_connection:
            self.protocol_errors["too_many_channels"] += 1
            node_log(node).warning(
                "refused a telemetry channel from %s: %d already open on this connection "
                "(ssh.max_channels_per_connection)",
                remote,
                open_here,
            )
            process.stderr.write(b"too many telemetry channels on this connection\n")
            process.exit(1)
            return
        channel = _TelemetryChannel(self, process, node, remote)
        self._channels.add(channel)
        try:
            await channel.run()
        finally:
            self._channels.discard(channel)

    async def _enrollment(self, process: asyncssh.SSHServerProcess[bytes], node: str) -> None:
        """One enrollment or renewal at a time per connection: a second channel is refused
        at once, before it can hold a slot (or a signer) for the key it never sends."""
        conn = process.get_extra_info("connection")
        if conn in self._enrolling:
            self.protocol_errors["too_many_renewals"] += 1
            node_log(node).warning("refused %s: one at a time per connection", process.subsystem)
            process.stderr.write(error_line("one renewal at a time per connection").encode())
            process.exit(EXIT_REFUSED)
            return
        self._enrolling.add(conn)
        try:
            await serve_enrollment(self.policy.enrollment, process, node)
        finally:
            self._enrolling.discard(conn)

    def revalidate(self) -> dict[str, SSHOpenSSHCertificate]:
        """Re-check every certificate-authenticated connection (revoked or expired since it
        connected), whatever it holds: telemetry, published endpoints, a renewal, nothing.
        Close those that no longer pass (their endpoints go with them); the others'
        certificates, by node."""
        passed: dict[str, SSHOpenSSHCertificate] = {}
        state = self.policy.trust_state()
        for auth in list(self._authenticated):
            cert, conn, node = auth.certificate, auth.connection, auth.node
            if cert is None or conn is None:
                continue
            reason = self.policy.recheck(node, cert, auth.held, state)
            if reason is None:
                passed[node] = cert
                continue
            self._authenticated.discard(auth)  # counted and logged once
            self.policy.failures[reason] += 1
            node_log(node).warning(
                "certificate no longer accepted (%s): %s", reason, describe(reason, node, cert)
            )
            channels = [c for c in self._channels if c.conn is conn]
            for channel in channels:
                channel.close(f"certificate {reason}")
            if not channels:
                conn.close()
        return passed

    @property
    def channels(self) -> int:
        return len(self._channels)

    def families(self) -> list[FamilySamples]:
        """The SSH port's own metrics: refused logins, protocol errors, open channels, and
        (when on) refused PROXY headers and certificates issued by enrollment."""
        families = [
            fixed(
                "gpurelay_gateway_auth_failures_total",
                "reason",
                self.policy.failures,
                AUTH_REASONS,
                zeros=True,
            ),
            fixed(
                "gpurelay_gateway_protocol_errors_total",
                "code",
                self.protocol_errors,
                WIRE_ERROR_CODES,
            ),
            one("gpurelay_gateway_channels", self.channels),
        ]
        if self.proxied is not None:  # ssh.proxy_protocol on
            families.append(
                fixed(
                    "gpurelay_gateway_proxy_header_refused_total",
                    "reason",
                    self.proxied.refused,
                    REFUSALS,
                    zeros=True,
                )
            )
        enrollment = self.policy.enrollment
        if enrollment is not None:  # [enroll] on
            families.append(
                fixed(
                    "gpurelay_gateway_certificates_issued_total",
                    "reason",
                    enrollment.issued,
                    ("enroll", "renew"),
                    zeros=True,
                )
            )
        return families

    def let_go(self, reason: str, node: str | None = None) -> int:
        """GOODBYE to every agent (or ``node``'s) and close: they reconnect, through the
        balancer, to a gateway that may own them. The number let go."""
        let_go = [c for c in self._channels if node is None or c.node == node]
        for channel in let_go:
            channel.goodbye(reason)
            channel.close(reason)
        return len(let_go)

    async def stop(self, drain_seconds: float) -> None:
        """Stop accepting, tell every agent GOODBYE, give them ``drain_seconds``, close."""
        if self._server is not None:
            self._server.close()
        for channel in list(self._channels):
            channel.goodbye("gateway shutting down")
        deadline = time.monotonic() + drain_seconds
        while self._channels and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for channel in list(self._channels):
            channel.close("gateway shut down")
        if self._server is not None:
            await self._server.wait_closed()


class _TelemetryChannel:
    def __init__(
        self, server: SshServer, process: asyncssh.SSHServerProcess[bytes], node: str, remote: str
    ) -> None:
        self._server = server
        self._process = process
        self.node = node
        self.remote = remote
        self.log = node_log(node)
        self._encoder = FrameEncoder(limits=server._limits)
        self.conn: asyncssh.SSHServerConnection = process.get_extra_info("connection")
        owner = self.conn.get_owner()
        self.auth = owner if isinstance(owner, ConnectionAuth) else None
        self._closing = ""
        self._session: Session | None = None  # until closed() was called on it
        self._epoch: int | None = None  # the admission's claim, once admitted
        self._partial_since: float | None = None  # when the frame now partial began

    def _send(self, frame: Frame) -> None:
        with suppress(OSError, asyncssh.Error):  # going away; reading will notice
            self._process.stdout.write(self._encoder.encode(frame))

    def _flush(self) -> None:
        """The connection is about to end: the session writes what waits."""
        session = self._session
        if session is not None:
            session.flush()

    def goodbye(self, reason: str) -> None:
        self._flush()
        self._send(Goodbye(reason=reason))

    def close(self, reason: str) -> None:
        if not self._closing:
            self._closing = reason
            self.log.info("closing connection from %s: %s", self.remote, reason)
            self._flush()
        self.conn.close()

    def _end(self, reason: str) -> None:
        """Tell the session it is over, exactly once."""
        session, self._session = self._session, None
        if session is not None:
            session.closed(self._closing or reason)
        epoch, self._epoch = self._epoch, None
        if epoch is not None and self._server.admission is not None:
            self._server.admission.departed(self.node, epoch, self._closing or reason)

    async def _watch(self) -> None:
        """End the session as soon as the channel closes, even while reading is held
        (the session's forwarder stops and :meth:`Session.flow` returns)."""
        await self._process.channel.wait_closed()
        self._end("agent disconnected")

    async def _read(self, decoder: FrameDecoder) -> bytes:
        """The next chunk; while a frame is partial, only until that frame's deadline."""
        if self._partial_since is None:
            return await self._process.stdin.read(READ_CHUNK)
        timeout = self._server.frame_timeout
        left = self._partial_since + timeout - asyncio.get_running_loop().time()
        try:
            async with asyncio.timeout(max(left, 0)):
                return await self._process.stdin.read(READ_CHUNK)
        except TimeoutError:
            raise WireError(
                "incomplete",
                f"a frame stayed incomplete for {timeout:g}s ({decoder.pending} bytes held; "
                "ssh.frame_timeout_seconds)",
            ) from None

    async def _handle(self, session: Session, frames: Iterator[Frame]) -> int:
        """Hand the frames of one read to the session, each decoded as it is handled (one
        frame's objects at a time); returns how many. The frames from the first DECLARE on
        wait for the server's declare gate: a node's first batch after a (re)connect costs
        ~20x a steady one (declaring ~500 series), and when a whole fleet reconnects at once
        their reads are all ready in the same turn of the event loop, which runs them all
        before it looks at its timers again: 1,000 of them held the gateway's tick (and its
        heartbeats) for ~16 s on 2 cores, long enough for agents to drop their sessions as
        silent and reconnect, over and over. Through the gate, each turn runs one of them
        and then the timers; HELLO (which asks for heartbeats) never waits."""
        handled = 0
        for frame in frames:
            handled += 1
            if isinstance(frame, Declare):
                return handled + await self._handle_gated(session, frame, frames)
            if isinstance(frame, Hello) and self._server.admission is not None:
                await self._admit(self._server.admission, frame)
            session.handle(frame)
        return handled

    async def _handle_gated(self, session: Session, first: Frame, rest: Iterator[Frame]) -> int:
        """The rest of a read from its first DECLARE on, through the declare gate; how many
        frames after ``first`` were handled."""
        gate = self._server.declare_gate
        if gate.locked():
            self._server.declare_waits += 1
        handled = 0
        async with gate:
            frame: Frame | None = first
            while frame is not None:
                if self._session is None:
                    return handled  # closed while waiting
                session.handle(frame)
                frame = next(rest, None)
                handled += frame is not None
            await asyncio.sleep(0)  # the next waiter runs in the next turn, after timers
        return handled

    async def _admit(self, admission: Admission, hello: Hello) -> None:
        cert = self.auth.certificate if self.auth is not None else None
        epoch = await admission.admit(self.node, hello, self.remote, cert)
        if self._session is None:  # closed while the directory answered
            admission.departed(self.node, epoch, self._closing or "agent disconnected")
        else:
            self._epoch = epoch

    async def run(self) -> None:
        session = self._server._sessions.open_session(
            self.node, self.remote, self.close, self._send
        )
        self._session = session
        decoder = FrameDecoder(limits=self._server._limits)
        reason = "agent disconnected"
        watch = asyncio.get_running_loop().create_task(self._watch())
        try:
            while self._session is not None:
                data = await self._read(decoder)
                if not data or self._session is None:
                    break
                session.received(len(data))
                handled = await self._handle(session, decoder.frames(data))
                if handled or not decoder.pending:  # a new partial frame gets a new deadline
                    self._partial_since = None
                if decoder.pending and self._partial_since is None:
                    self._partial_since = asyncio.get_running_loop().time()
                if handled:  # a replay's ACK, or many, are written once per read
                    session.read_done()
                await session.flow()  # held: stop reading, SSH flow control holds the agent
        except WireError as exc:
            self._server.protocol_errors[exc.code] += 1
            self.log.warning("protocol error from %s (%s): %s", self.remote, exc.code, exc)
            self._flush()  # what was taken before the bad frame stays taken
            self._send(ErrorFrame(code=exc.code, message=str(exc)))
            reason = f"protocol error: {exc.code}"
            await asyncio.sleep(0.05)  # let the ERROR frame leave before closing
            self.close(reason)
        except AdmissionRefused as exc:
            self._server.refused["unavailable"] += 1
            self.log.warning("not admitted from %s: %s", self.remote, exc)
            self._send(ErrorFrame(code="unavailable", message=str(exc)))
            reason = "not admitted"
            await asyncio.sleep(0.05)  # let the ERROR frame leave before closing
            self.close(reason)
        except (asyncssh.Error, ConnectionError) as exc:
            reason = f"connection lost: {exc}"
        except Exception:  # a bug here: close this node's connection, keep the gateway
            self.log.exception("internal error on the connection from %s", self.remote)
            reason = "internal error"
            self.close(reason)
        finally:
            watch.cancel()
            self._end(reason)
            self._process.exit(0)
