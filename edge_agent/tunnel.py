"""The tunnel: dial the gateway over SSH and push every collection on one channel.

The agent is the SSH client. It verifies the gateway's host key against the configured
known_hosts (an ``@cert-authority`` line for the fleet host CA, or a pinned key) and logs
in as its node name with its node certificate. Telemetry rides one session channel
(subsystem ``gpurelay``) as frames of :mod:`gpurelay.wire`.

Reconnects use exponential backoff with full jitter (tenacity); after an established
session ends (gateway restart or crash, GOODBYE, a dead link) the first reconnect is
delayed by a random share of ``backoff_initial_seconds`` x 10, so a thousand agents do not
return in the same second, and a new backoff sequence starts. A dial that nobody answers
(:mod:`edge_agent.dial`) is retried after a short pause instead, so data resumes within
seconds of a silent path returning.

With a list of gateways (``[gateway] addresses``, :class:`edge_agent.dial.Rotation`) a
failed attempt moves on to the next address at once; the backoff applies to rounds, after
every address failed in a row. A session that ended (the gateway that dropped it may be
dying) dials the next address first, after the same jittered pause.

Liveness is the protocol's: the agent asks the gateway in HELLO for a HEARTBEAT whenever
it has sent nothing (no ACK) for an interval (10 s at most, and at most half the silence
timeout), and drops a session on which nothing at all arrived for
``silence_timeout_seconds`` (default 3 x the interval, at most 5 s, + 5 s: 14 s at a 1 s
interval with the 3 s ACK delay, 20 s at 10 s); SSH keepalives are only the backstop. The local HTTP
endpoints keep serving whatever happens here.

The key and certificate are read again before every connection. Beside each session the
:class:`edge_agent.renew.Renewer` watches the certificate's age; once it has renewed it
over this connection, the session ends cleanly and the same gateway is dialled at once
with the new certificate (the spool replays whatever was not acknowledged).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace

import asyncssh
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    wait_random_exponential,
)

from edge_agent.config import TunnelConfig, heartbeat_seconds, silence_timeout
from edge_agent.dial import PathSilent, Rotation, show
from edge_agent.encode import SnapshotEncoder
from edge_agent.errors import AgentError
from edge_agent.outbox import Dispatch, Outbox
from edge_agent.proxy_connect import ProxyError, log_route, proxy_route
from edge_agent.renew import Renewer
from edge_agent.tunnel_greeting import Greeting
from edge_agent.tunnel_inbound import Inbound
from edge_agent.tunnel_stats import TUNNEL_FAMILIES, TunnelStats
from edge_agent.tunnel_types import (
    RETRIED,
    PublishedEndpoint,
    Refused,
    SessionEnded,
    TunnelError,
    Unanswered,
    load_client_key,
    load_known_hosts,
)
from gpurelay import compat
from gpurelay.asyncssh_hooks import hook_forwarded_open
from gpurelay.compat import TIMEOUTS
from gpurelay.model import SampleSink, Snapshot
from gpurelay.wire import (
    SUBSYSTEM,
    FrameEncoder,
    Hello,
    Replay,
    WireError,
)

log = logging.getLogger(__name__)


class Tunnel:
    """Owns the connection to the gateway. ``submit`` never blocks the collection loop."""

    def __init__(
        self,
        cfg: TunnelConfig,
        *,
        node: str,
        hello: Callable[[], Hello],
        encoder: SnapshotEncoder | None = None,
        publish: Sequence[PublishedEndpoint] = (),
        outbox: Outbox | None = None,
        replay_batches_per_second: float = 50.0,
    ) -> None:
        self._publish = tuple(publish)
        self._cfg = cfg
        self._node = node
        self._hello = hello
        self._key, self._cert = load_client_key(cfg)
        self._known_hosts = load_known_hosts(cfg)
        self._snapshots = encoder or SnapshotEncoder()
        # Sequence numbers (persisted in the spool) and what to send next.
        self.outbox = outbox or Outbox(None)
        self._replay_interval = 1.0 / replay_batches_per_second
        self._dispatch: Dispatch | None = None
        self._wakeup = asyncio.Event()
        self._acked_this_session = False
        self.sleep: Callable[[float], Awaitable[None]] = asyncio.sleep  # a test's clock
        self._backoff = wait_random_exponential(
            multiplier=cfg.backoff_initial_seconds, max=cfg.backoff_max_seconds
        )
        self.stats = TunnelStats()
        self.log = logging.LoggerAdapter(log, {"node": node})
        self._rotation = Rotation(cfg.gateways, node)
        self._addresses = [show(a) for a in self._rotation.addresses]
        # Directly, or through an HTTP CONNECT proxy (edge_agent.proxy_connect).
        self._route = proxy_route(cfg.proxy, os.environ)
        log_route(self._route, cfg.proxy, self._rotation.addresses, self.log)
        self.renewer = Renewer(cfg, node=node) if cfg.renew else None
        if self.renewer is not None:
            self.renewer.loaded(self._cert)
        self._renewed = False  # the session ended for a renewed certificate: redial now

    def metrics(self, sink: SampleSink) -> None:
        """The tunnel's own series, added to every collection."""
        st = self.stats
        for fam in TUNNEL_FAMILIES:
            sink.declare(fam)
        sink.add("gpurelay_agent_gateway_connected", (), 1.0 if st.connected else 0.0)
        for address in self._addresses:  # one series per configured address
            up = st.connected and st.address == address
            sink.add("gpurelay_agent_gateway_address", (("address", address),), 1.0 if up else 0.0)
        sink.add("gpurelay_agent_gateway_connects_total", (), st.connects)
        for reason, n in sorted(st.failures.items()):
            sink.add("gpurelay_agent_gateway_failures_total", (("reason", reason),), n)
        sink.add("gpurelay_agent_gateway_sent_batches_total", (), st.batches_sent)
        sink.add("gpurelay_agent_gateway_sent_bytes_total", (), st.bytes_sent)
        sink.add("gpurelay_agent_gateway_acked_seq", (), st.acked_seq)
        sink.add("gpurelay_agent_proxy_refused_total", (), st.proxy_refused)
        sink.add("gpurelay_agent_replayed_batches_total", (), self.outbox.replayed)
        dispatch = self._dispatch
        in_flight = len(dispatch.in_flight) if dispatch is not None and st.connected else 0
        sink.add("gpurelay_agent_gateway_in_flight_batches", (), in_flight)
        self.outbox.metrics(sink)
        if self.renewer is not None:
            self.renewer.metrics(sink)

    def publish(self, endpoints: Sequence[PublishedEndpoint]) -> None:
        """The endpoints offered on the next connection (the agent's port is known late)."""
        self._publish = tuple(endpoints)

    def submit(self, snapshot: Snapshot) -> None:
        """Number and spool the newest collection; it goes out next as the live batch (an
        older one not sent yet is superseded live and goes out later from the spool)."""
        self.outbox.put(snapshot)
        self._wakeup.set()

    async def run(self) -> None:
        """Connect, push, reconnect; until cancelled."""
        while True:
            retrying = AsyncRetrying(
                wait=self._wait,
                retry=retry_if_exception_type(RETRIED),
                before_sleep=self._before_sleep,
                sleep=self.sleep,
                reraise=True,
            )
            try:
                await retrying(self._round)
                why = "the session ended"
            except SessionEnded as exc:
                why = f"the session ended: {exc}"
            if self._renewed:  # the same gateway at once, with the new certificate
                self._renewed = False
                continue
            # An established session ended (gateway gone, restarting or crashed, or the link
            # died): a fresh backoff sequence, after a pause that spreads the herd; with a
            # list, from the next gateway on (the one that dropped it may be dying).
            ended = show(self._rotation.current)
            if len(self._rotation) > 1:
                self._rotation.advance()
            delay = random.uniform(0, 10 * self._cfg.backoff_initial_seconds)
            self.log.info(
                "node %s: %s (gateway %s); reconnecting to %s in %.1fs",
                self._node,
                why,
                ended,
                show(self._rotation.current),
                delay,
            )
            await self.sleep(delay)

    async def _round(self) -> None:
        """Dial the gateway addresses in turn from the current one, moving on at once when
        one fails; returns (or raises :class:`SessionEnded`) when a session that worked
        ended. After every address failed, raises for the backoff: :class:`Unanswered`
        when nobody answered anywhere, else the last other failure."""
        count = len(self._rotation)
        failures: list[BaseException] = []
        for tried in range(1, count + 1):
            host, port = self._rotation.current
            if count > 1:
                self.log.info(
                    "node %s: dialling gateway %s:%d (%d of %d this round)",
                    self._node,
                    host,
                    port,
                    tried,
                    count,
                )
            try:
                await self._attempt(host, port)
                return
            except RETRIED as exc:
                if count == 1:
                    raise
                failures.append(exc)
                nxt = show(self._rotation.advance())
                if tried < count:
                    self.log.warning(
                        "node %s: gateway %s:%d failed (%s); trying %s now",
                        self._node,
                        host,
                        port,
                        exc,
                        nxt,
                    )
        raise next((e for e in reversed(failures) if not isinstance(e, Unanswered)), failures[-1])

    async def _attempt(self, host: str, port: int) -> None:
        """One connection: a failure before the gateway acknowledged anything is a failed
        attempt (backoff goes on); after, it is the end of a session that worked."""
        self._acked_this_session = False
        try:
            await self._session(host, port)
        except (TunnelError, OSError, asyncssh.Error, WireError) as exc:
            if self._acked_this_session:
                raise SessionEnded(str(exc) or type(exc).__name__) from exc
            raise

    def _wait(self, state: RetryCallState) -> float:
        """Full-jitter exponential backoff; a dial nobody answered (the gateway never saw
        it) waits at most 2 x ``backoff_initial_seconds``, a dial refused (nothing
        listening: the gateway is restarting) at most 10 x, the pause after a session
        ended; neither grows the backoff."""
        outcome = state.outcome
        failure = outcome.exception() if outcome is not None else None
        if isinstance(failure, Unanswered):
            return random.uniform(0, 2 * self._cfg.backoff_initial_seconds)
        if isinstance(failure, Refused):
            return random.uniform(0, 10 * self._cfg.backoff_initial_seconds)
        return float(self._backoff(state))

    def _before_sleep(self, state: object) -> None:
        outcome = getattr(state, "outcome", None)
        exc = outcome.exception() if outcome is not None else None
        sleep = getattr(getattr(state, "next_action", None), "sleep", 0.0)
        if len(self._rotation) > 1:
            self.log.warning(
                "node %s: all %d gateway addresses failed (the last: %s); retrying from %s "
                "in %.1fs",
                self._node,
                len(self._rotation),
                exc,
                show(self._rotation.current),
                sleep,
            )
        else:
            self.log.warning("gateway connection failed: %s; retrying in %.1fs", exc, sleep)

    async def _session(self, host: str, port: int) -> None:
        """One connection. Returns after an established session ends; raises before that."""
        self._reload_credentials()
        try:
            sock = await self._route.open(
                host,
                port,
                dial_timeout=self._cfg.dial_timeout_seconds,
                answer_timeout=self._cfg.connect_timeout_seconds,
            )
        except PathSilent as exc:
            self.stats.fail("unanswered", str(exc))
            raise Unanswered(f"cannot reach gateway {host}:{port}: {exc}") from exc
        except ProxyError as exc:
            self.stats.fail("proxy", str(exc))
            raise TunnelError(f"cannot reach gateway {host}:{port}: {exc}") from exc
        except ConnectionRefusedError as exc:
            self.stats.fail("connect", str(exc))
            raise Refused(f"cannot reach gateway {host}:{port}: {exc}") from exc
        except OSError as exc:
            self.stats.fail("connect", str(exc))
            raise TunnelError(f"cannot reach gateway {host}:{port}: {exc}") from exc
        try:
            conn = await self._handshake(host, port, sock)
        except BaseException:
            # asyncssh may own the socket by now: its transport unregisters and closes it
            # a loop iteration or two later. Closing it here would free the fd number for
            # a new socket (even the gateway's, in one process) that the old transport
            # then unregisters. Close it after that: a no-op then, and the socket is still
            # freed where asyncssh never took it.
            asyncio.get_running_loop().call_later(1.0, sock.close)
            raise
        async with conn:
            try:
                writer, reader, _stderr = await conn.open_session(
                    subsystem=SUBSYSTEM, encoding=None
                )
            except asyncssh.Error as exc:
                self.stats.fail("channel", str(exc))
                raise TunnelError(f"gateway refused the telemetry channel: {exc}") from exc
            await self._offer_endpoints(conn)
            self.stats.address = show((host, port))
            self.stats.connected = True
            self.stats.connects += 1
            self.stats.connected_since = time.time()
            self.log.info("connected to gateway %s:%d as %s", host, port, self._node)
            try:
                await self._exchange(writer, reader, conn)
            finally:
                self.stats.connected = False

    def _reload_credentials(self) -> None:
        """The key and certificate as they are on disk now; the last good ones if they
        cannot be read (logged), so a bad file never stops a tunnel that worked."""
        try:
            self._key, self._cert = load_client_key(self._cfg)
        except (AgentError, OSError) as exc:
            self.log.error(
                "node %s: %s; connecting with the credentials read before", self._node, exc
            )
        if self.renewer is not None:
            self.renewer.loaded(self._cert)

    async def _handshake(
        self, host: str, port: int, sock: socket.socket
    ) -> asyncssh.SSHClientConnection:
        """SSH over the dialled socket: key exchange, host key check, login."""
        greeting = Greeting(sock)  # what answered, should it not be an SSH server
        try:
            # asyncio.timeout, not wait_for: wait_for (3.11) drops a cancellation that
            # comes as the login ends, and the agent never stops (gpurelay.tasks)
            async with compat.timeout(self._cfg.connect_timeout_seconds):
                conn = await asyncssh.connect(
                    host,
                    port,
                    tunnel=greeting,
                    username=self._node,
                    client_keys=[(self._key, self._cert)],
                    known_hosts=self._known_hosts,
                    agent_path=None,
                    config=None,
                    keepalive_interval=self._cfg.keepalive_seconds,
                    keepalive_count_max=self._cfg.keepalive_count_max,
                    encryption_algs=list(self._cfg.ciphers),
                )
        except asyncssh.PermissionDenied as exc:
            self.stats.fail("auth", str(exc))
            raise TunnelError(
                f"the gateway refused node {self._node}'s certificate ({exc.reason}); "
                "check that it is signed by the fleet user CA, not expired and not revoked"
            ) from exc
        except asyncssh.HostKeyNotVerifiable as exc:
            self.stats.fail("host_key", str(exc))
            raise TunnelError(
                f"the gateway's host key is not trusted by {self._cfg.known_hosts}: {exc.reason}"
            ) from exc
        except asyncssh.KeyExchangeFailed as exc:
            if "host key" not in exc.reason:  # no common cipher, MAC, ...
                self.stats.fail("connect", str(exc))
                raise TunnelError(
                    f"cannot agree on SSH algorithms with {host}:{port}: {exc}"
                ) from exc
            self.stats.fail("host_key", str(exc))
            raise TunnelError(
                f"the gateway {host}:{port} offers no host key that {self._cfg.known_hosts} "
                f"trusts ({exc.reason}): an @cert-authority line needs a gateway with a host "
                "certificate (cloud-gateway certs issue-gateway HOST, then ssh.host_certificate "
                "or <host_key>-cert.pub on the gateway); or pin the gateway's host key instead"
            ) from exc
        except (OSError, *TIMEOUTS, asyncssh.Error) as exc:
            reason, why = greeting.failure(
                show((host, port)), self._cfg.connect_timeout_seconds, exc
            )
            self.stats.fail(reason, why)
            raise TunnelError(why) from exc
        return conn

    async def _offer_endpoints(self, conn: asyncssh.SSHClientConnection) -> None:
        """Offer each allowlisted endpoint as a remote forward. asyncssh refuses any
        forwarded connection that matches none of them; count and log those refusals."""
        for ep in self._publish:
            try:
                await conn.forward_remote_port(ep.node, ep.port, ep.host, ep.target_port)
            except (asyncssh.Error, asyncssh.ChannelListenError, OSError) as exc:
                self.stats.fail("publish", str(exc))
                self.log.warning(
                    "gateway refused to publish %s:%d (%s): %s", ep.node, ep.port, ep.name, exc
                )

        def refused(exc: asyncssh.ChannelOpenError) -> None:
            self.stats.proxy_refused += 1
            self.log.warning(
                "refused a connection from the gateway to an endpoint that is "
                "not published (%d refused so far): %s",
                self.stats.proxy_refused,
                exc.reason,
            )

        hook_forwarded_open(conn, refused)

    async def _exchange(
        self,
        writer: asyncssh.SSHWriter[bytes],
        reader: asyncssh.SSHReader[bytes],
        conn: asyncssh.SSHClientConnection,
    ) -> None:
        frames = FrameEncoder()
        self._snapshots.reset()
        self._dispatch = None
        hello = self._hello()
        interval = hello.interval_seconds
        delay = self._cfg.ack_delay_seconds
        silence = silence_timeout(self._cfg, interval)
        beat = heartbeat_seconds(interval, delay, silence)
        hello = replace(hello, heartbeat_seconds=beat, ack_delay_seconds=delay)
        self._write(writer, frames.encode(hello))
        receiver = asyncio.create_task(self._inbound().run(reader, silence))
        sender = asyncio.create_task(self._send_loop(writer, frames))
        tasks = {receiver, sender}
        renewal: asyncio.Task[None] | None = None
        if self.renewer is not None:  # returns once a renewed certificate is on disk
            renewal = asyncio.create_task(self.renewer.watch(conn, interval))
            tasks.add(renewal)
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # raises GatewayRefused / TunnelError where applicable
            self._renewed = renewal in done
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            writer.close()

    async def _send_loop(self, writer: asyncssh.SSHWriter[bytes], frames: FrameEncoder) -> None:
        """Live first, backlog between live batches (see edge_agent.outbox)."""
        dispatch = self._dispatch = self.outbox.dispatch()
        next_replay = time.monotonic()
        while True:
            self._wakeup.clear()  # before looking: a submit or an ACK after this wakes us
            live = dispatch.next_live()
            if live is not None:
                seq, snapshot = live
                # One write (one SSH packet and socket write while it fits) per collection,
                # DECLAREs and BATCH together.
                encoded = [
                    frames.encode(frame) for frame in self._snapshots.frames(snapshot, seq=seq)
                ]
                self._write(writer, b"".join(encoded), len(encoded))
                dispatch.sent_live(seq)
                self.stats.batches_sent += 1
                await writer.drain()
                continue
            timeout: float | None = None
            if dispatch.room():
                now = time.monotonic()
                if now < next_replay:
                    timeout = next_replay - now
                elif (batch := dispatch.next_replay()) is not None:
                    try:
                        data = frames.encode(Replay(seq=batch.seq, record=batch.payload))
                    except WireError as exc:  # over the frame limit: can never be sent
                        self.log.error("spooled batch %d cannot be sent: %s", batch.seq, exc)
                        dispatch.discard(batch.seq)
                        continue
                    self._write(writer, data)
                    dispatch.sent_replay(batch.seq)
                    next_replay = max(next_replay + self._replay_interval, now - 1.0)
                    await writer.drain()
                    continue
            with contextlib.suppress(*TIMEOUTS):
                async with compat.timeout(timeout):
                    await self._wakeup.wait()

    def _inbound(self) -> Inbound:
        """The reader of what the gateway sends on this session."""
        return Inbound(self.stats, self.log, self._wakeup, self._taken, lambda: self._dispatch)

    def _taken(self) -> None:
        self._acked_this_session = True  # the gateway took this session

    def _write(self, writer: asyncssh.SSHWriter[bytes], data: bytes, frames: int = 1) -> None:
        writer.write(data)
        self.stats.frames_sent += frames
        self.stats.bytes_sent += len(data)
