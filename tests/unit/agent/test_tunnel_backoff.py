"""Reconnect timing and liveness of the agent's tunnel, without a network (issue 13).

A gateway kill -9'd and back 5.5 s later saw agents return 12-54 s later: a session that
was established and then broke counted as one more failed attempt of the *previous*
outage, so its wait was drawn from up to backoff_max_seconds (60 s)."""

from __future__ import annotations

import asyncio
import random
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from edge_agent.config import TunnelConfig
from edge_agent.dial import PathSilent, dial
from edge_agent.tunnel import Tunnel
from edge_agent.tunnel_types import (
    RETRIED,
    GatewaySilent,
    Refused,
    SessionEnded,
    TunnelError,
    Unanswered,
)
from gpurelay.wire import Frame, FrameEncoder, Heartbeat, Hello
from harness.fleet import make_pki


class Stop(Exception):
    """Ends Tunnel.run after the sleeps a test wants to see."""


def tunnel(tmp_path: Path, node: str = "edge-a", **where: Any) -> Tunnel:
    """A tunnel of ``node`` dialling 127.0.0.1:9, or ``where`` (address= or addresses=)."""
    pki = make_pki(tmp_path)
    creds = pki.node(node)
    cfg = TunnelConfig(
        **(where or {"address": "127.0.0.1:9"}),
        known_hosts=pki.ca.known_hosts,
        key=creds.private_key,
        certificate=creds.certificate,
        backoff_initial_seconds=1.0,
        backoff_max_seconds=60.0,
    )
    return Tunnel(cfg, node=node, hello=lambda: Hello(agent_version="0", node=node))


async def run_until_slept(
    t: Tunnel,
    session: Callable[[str, int], Awaitable[None]],
    times: int,
    *,
    on_sleep: Callable[[float], object] = lambda seconds: None,
) -> list[float]:
    """Runs ``t`` with ``session`` in place of its SSH session (no network, no waiting)
    until it has slept ``times`` times; the waits it asked for, in order. ``on_sleep`` sees
    each as it comes (to interleave them with what ``session`` records)."""
    sleeps: list[float] = []

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        on_sleep(seconds)
        if len(sleeps) >= times:
            raise Stop

    t._session = session  # type: ignore[method-assign]
    t.sleep = sleep
    with pytest.raises(Stop):
        await t.run()
    return sleeps


async def test_a_session_that_worked_and_then_broke_starts_a_fresh_short_backoff(
    tmp_path: Path,
) -> None:
    random.seed(13)  # the jitter, so the outcome does not depend on luck
    t = tunnel(tmp_path)
    attempts: list[int] = []

    async def session(host: str, port: int) -> None:
        attempts.append(len(attempts) + 1)
        if len(attempts) <= 7:  # an outage: seven failed connects
            raise TunnelError("cannot reach gateway")
        if len(attempts) == 8:  # connected, data acknowledged, then the gateway crashed
            t._acked_this_session = True  # what the ACK reader sets
            raise ConnectionResetError("Connection reset by peer")
        raise TunnelError("cannot reach gateway (restarting)")

    sleeps = await run_until_slept(t, session, 9)
    # 7 backoff waits of the outage, then the short pause after the crash (0..10 x 1 s),
    # then the first wait of a *new* sequence (full jitter up to 1 x 2**0 .. s), not the
    # 8th wait of the old one (which may be up to 60 s)
    after_crash, first_retry = sleeps[7], sleeps[8]
    assert 0 <= after_crash <= 10.0, sleeps
    assert first_retry <= 2.0, sleeps


async def test_a_session_refused_before_any_ack_keeps_backing_off(tmp_path: Path) -> None:
    """A gateway that takes the connection and refuses at once is not a working session:
    the agent keeps growing its backoff rather than retrying every few seconds."""
    random.seed(13)
    t = tunnel(tmp_path)

    async def session(host: str, port: int) -> None:
        raise TunnelError("gateway sent ERROR refused")

    sleeps = await run_until_slept(t, session, 12)
    assert max(sleeps) > 10.0  # grew past the short pause: exponential, up to 60 s


def test_session_ended_is_not_a_retryable_failure() -> None:
    assert not issubclass(SessionEnded, TunnelError | OSError)
    assert asyncio.iscoroutinefunction(Tunnel.run)


async def test_a_dial_nobody_answers_is_retried_after_a_short_pause_that_does_not_grow(
    tmp_path: Path,
) -> None:
    """Issue 13, row 5: during a silent link, the backoff grew to 60 s and data resumed
    long after the link came back. A SYN nobody answered never reached the gateway, so
    retrying it soon costs the gateway nothing."""
    random.seed(13)
    t = tunnel(tmp_path)

    async def session(host: str, port: int) -> None:
        raise Unanswered("no answer within 3s")

    sleeps = await run_until_slept(t, session, 30)
    assert max(sleeps) <= 2.0, sleeps  # 2 x backoff_initial_seconds, attempt 30 as attempt 1


async def test_a_refused_dial_is_retried_within_the_herds_pause_and_does_not_grow(
    tmp_path: Path,
) -> None:
    """Issue 26: while a killed gateway restarted, the agents' dials were refused and grew
    their backoff; the fleet came back 88 s after the kill, 16 % of it in one second. A
    reset means nothing listens: retry within the pause a session's end gets (10 x
    backoff_initial_seconds), spread, and never longer."""
    random.seed(26)
    t = tunnel(tmp_path)

    async def session(host: str, port: int) -> None:
        raise Refused("connection refused")

    sleeps = await run_until_slept(t, session, 40)
    assert max(sleeps) <= 10.0, sleeps
    assert max(sleeps) > 5.0  # spread over the whole pause, not the unanswered dial's 2 s


async def test_a_reset_on_the_gateways_port_is_a_refused_dial(tmp_path: Path) -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    t = tunnel(tmp_path, address=f"127.0.0.1:{port}")
    with pytest.raises(Refused, match=f"127.0.0.1:{port}"):
        await t._session("127.0.0.1", port)
    assert t.stats.failures == {"connect": 1}


async def test_dial_tells_a_silent_path_from_a_refusal() -> None:
    """A listener whose accept queue is full drops SYNs without answering, as a dead
    uplink does; a closed port answers with a reset at once."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = server.getsockname()[1]
    held = [await dial("127.0.0.1", port, 5.0)]  # fills the accept queue
    try:
        started = time.monotonic()
        with pytest.raises(PathSilent, match=r"no answer from 127\.0\.0\.1"):
            held.append(await dial("127.0.0.1", port, 0.5))
        assert time.monotonic() - started < 5.0  # bounded by the dial timeout, not TCP's
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        free = closed.getsockname()[1]
        closed.close()
        with pytest.raises(ConnectionRefusedError):
            await dial("127.0.0.1", free, 5.0)
    finally:
        for sock in (*held, server):
            sock.close()


async def test_a_resolver_that_does_not_answer_is_a_silent_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The name lookup is bounded by the dial timeout too, and its timeout is a silent path
    (retried), on Python 3.10 as on 3.11: there a timeout is asyncio.TimeoutError, not an
    OSError, and one that escaped the dial ended the tunnel for good."""
    loop = asyncio.get_running_loop()

    async def hangs(*_args: Any, **_kwargs: Any) -> Any:
        await asyncio.sleep(3600)

    monkeypatch.setattr(loop, "getaddrinfo", hangs)
    started = time.monotonic()
    with pytest.raises(PathSilent, match=r"gateway\.example not resolved within 0\.2s"):
        await dial("gateway.example", 2222, 0.2)
    assert time.monotonic() - started < 5.0


def test_every_timeout_class_is_retried() -> None:
    assert issubclass(asyncio.TimeoutError, RETRIED) and issubclass(TimeoutError, RETRIED)


class SilentReader:
    """A channel on which the gateway sends ``frames`` and then nothing."""

    def __init__(self, *frames: Frame) -> None:
        self.data = [FrameEncoder().encode(f) for f in frames]

    async def read(self, n: int) -> bytes:
        if self.data:
            return self.data.pop(0)
        await asyncio.sleep(3600)
        return b""


async def test_a_gateway_that_sends_nothing_for_the_silence_timeout_is_dropped(
    tmp_path: Path,
) -> None:
    """Issue 13, row 3: the agent held a dead session for 59 s (until SSH keepalives gave
    up). The gateway sends an ACK or a HEARTBEAT about once an interval; nothing at all
    for the silence timeout ends the session, as an error the run loop reconnects on."""
    t = tunnel(tmp_path)
    reader = SilentReader(Heartbeat(received=0))
    started = time.monotonic()
    with pytest.raises(GatewaySilent, match=r"nothing from the gateway for 0\.3s"):
        await t._inbound().run(reader, 0.3)  # type: ignore[arg-type]
    assert time.monotonic() - started < 3.0
    assert t.stats.failures == {"silent": 1}
    assert t._acked_this_session  # the heartbeat showed the gateway took the session
