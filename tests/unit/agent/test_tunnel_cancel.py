"""An agent told to stop stops, whatever its tunnel was doing at that moment.

.ci/run hung for 78 minutes in tests/integration/test_tunnel_e2e.py's expired-certificate
case: the agent, refused at every login and redialling, was cancelled at the moment a
login ended. Python 3.11's ``asyncio.wait_for`` returns (or raises) the inner result when
the inner call finished in the same loop iteration as the cancellation, and drops the
cancellation: the tunnel took the refusal as one more failed attempt, backed off, and went
on redialling; ``Agent.shutdown`` awaited it forever. These tests put a cancellation
exactly there."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncssh
import pytest

from edge_agent.config import TunnelConfig
from edge_agent.tunnel import Tunnel
from gpurelay.tasks import stop_task
from gpurelay.wire import Hello
from harness.fleet import make_pki


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """Takes TCP connections and never speaks: the dial succeeds, SSH is faked."""
    with socket.create_server(("127.0.0.1", 0), backlog=64) as sock:
        yield sock


def tunnel(tmp_path: Path, port: int) -> Tunnel:
    pki = make_pki(tmp_path)
    creds = pki.node("edge-a")
    cfg = TunnelConfig(
        address=f"127.0.0.1:{port}",
        known_hosts=pki.ca.known_hosts,
        key=creds.private_key,
        certificate=creds.certificate,
        backoff_initial_seconds=0.05,
        backoff_max_seconds=0.1,
        connect_timeout_seconds=30.0,
    )
    return Tunnel(cfg, node="edge-a", hello=lambda: Hello(agent_version="0", node="edge-a"))


async def cancelled_as_login_ends(
    monkeypatch: pytest.MonkeyPatch, t: Tunnel, outcome: BaseException
) -> asyncio.Task[None]:
    """Runs the tunnel until its login is under way, then ends the login with ``outcome``
    and cancels the tunnel in the same loop iteration. Returns the tunnel's task."""
    entered = asyncio.Event()
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def connect(*args: Any, **kwargs: Any) -> asyncssh.SSHClientConnection:
        entered.set()
        await gate
        raise outcome

    monkeypatch.setattr(asyncssh, "connect", connect)
    task = asyncio.create_task(t.run())
    await asyncio.wait_for(entered.wait(), 10)
    gate.set_result(None)  # the login ends...
    task.cancel()  # ...as the agent is told to stop
    await asyncio.wait({task}, timeout=5)
    return task


@pytest.mark.parametrize(
    "outcome",
    [
        asyncssh.PermissionDenied("certificate expired"),
        ConnectionResetError("Connection reset by peer"),
    ],
    ids=["refused", "reset"],
)
async def test_a_tunnel_cancelled_as_its_login_ends_stops(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    listener: socket.socket,
    outcome: BaseException,
) -> None:
    task = await cancelled_as_login_ends(
        monkeypatch, tunnel(tmp_path, listener.getsockname()[1]), outcome
    )
    try:
        assert task.done(), "the cancellation was lost: the tunnel went on redialling"
        assert task.cancelled()
    finally:
        await stop_task(task, grace=5)


async def test_stop_task_cancels_again_a_task_that_swallowed_its_cancellation() -> None:
    swallowed = 0

    async def stubborn() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                swallowed += 1
                if swallowed >= 3:
                    raise

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    assert await stop_task(task, grace=5, every=0.01)
    assert task.cancelled() and swallowed == 3


async def test_stop_task_gives_up_after_its_grace_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    release = False

    async def immortal() -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if release:
                    raise

    task = asyncio.create_task(immortal())
    await asyncio.sleep(0)
    assert not await stop_task(task, grace=0.2, every=0.01, what="the test's task")
    assert not task.done()
    assert "the test's task did not stop within 0.2 s" in caplog.text
    release = True
    assert await stop_task(task, grace=5)
