"""Reconnect timing of the agent's tunnel, without a network (issue 13, row 1).

A gateway kill -9'd and back 5.5 s later saw agents return 12-54 s later: a session that
was established and then broke counted as one more failed attempt of the *previous*
outage, so its wait was drawn from up to backoff_max_seconds (60 s)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from edge_agent.config import TunnelConfig
from edge_agent.tunnel import SessionEnded, Tunnel, TunnelError
from gpurelay.wire import Hello
from harness.fleet import make_pki


class Stop(Exception):
    """Ends Tunnel.run after the sleeps a test wants to see."""


def tunnel(tmp_path: Path) -> Tunnel:
    pki = make_pki(tmp_path)
    creds = pki.node("edge-a")
    cfg = TunnelConfig(
        address="127.0.0.1:9",
        known_hosts=pki.ca.known_hosts,
        key=creds.private_key,
        certificate=creds.certificate,
        backoff_initial_seconds=1.0,
        backoff_max_seconds=60.0,
    )
    return Tunnel(cfg, node="edge-a", hello=lambda: Hello(agent_version="0", node="edge-a"))


async def test_a_session_that_worked_and_then_broke_starts_a_fresh_short_backoff(
    tmp_path: Path,
) -> None:
    random.seed(13)  # the jitter, so the outcome does not depend on luck
    t = tunnel(tmp_path)
    attempts: list[int] = []
    sleeps: list[float] = []

    async def session(host: str, port: int) -> None:
        attempts.append(len(attempts) + 1)
        if len(attempts) <= 7:  # an outage: seven failed connects
            raise TunnelError("cannot reach gateway")
        if len(attempts) == 8:  # connected, data acknowledged, then the gateway crashed
            t._acked_this_session = True  # what the ACK reader sets
            raise ConnectionResetError("Connection reset by peer")
        raise TunnelError("cannot reach gateway (restarting)")

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) >= 9:
            raise Stop

    t._session = session  # type: ignore[method-assign]
    t.sleep = sleep
    with pytest.raises(Stop):
        await t.run()
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
    sleeps: list[float] = []

    async def session(host: str, port: int) -> None:
        raise TunnelError("gateway sent ERROR refused")

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) >= 12:
            raise Stop

    t._session = session  # type: ignore[method-assign]
    t.sleep = sleep
    with pytest.raises(Stop):
        await t.run()
    assert max(sleeps) > 10.0  # grew past the short pause: exponential, up to 60 s


def test_session_ended_is_not_a_retryable_failure() -> None:
    assert not issubclass(SessionEnded, TunnelError | OSError)
    assert asyncio.iscoroutinefunction(Tunnel.run)
