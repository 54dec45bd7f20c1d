"""What stops at shutdown stops, even when a cancellation was lost on the way.

The 78-minute CI hang (see gpurelay.tasks and tests/unit/agent/test_tunnel_cancel.py) was a
cancellation lost in a retry loop and a shutdown that awaited that loop without a bound.
These tests put a lost cancellation in the other places that await a task at shutdown:
the gateway's remote write forwarders (Gateway.shutdown -> Ingest.aclose ->
Delivery.aclose) and the harness's running_gateway/running_agent teardown, which tests
use everywhere (a hung teardown costs pytest-timeout's 600 s and names nothing)."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any

import pytest

import harness.fleet
from cloud_gateway.ingest.delivery import Delivery
from cloud_gateway.remote_write.client import RemoteWriteUnavailable
from cloud_gateway.remote_write.forwarder import QueuedCollection
from gpurelay.tasks import stop_tasks
from harness.process import HarnessError

LOG = logging.getLogger("test.cancellation_audit")


class LosesOneCancellation:
    """A remote writer whose send, cancelled, raises RemoteWriteUnavailable instead (once):
    a client library's timeout that dropped the cancellation arriving with its expiry
    (Python 3.11's wait_for does that) looks exactly like this to the forwarder."""

    def __init__(self) -> None:
        self.sends = 0
        self.lost = 0

    async def send(self, series: object) -> None:
        self.sends += 1
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if self.lost:
                raise
            self.lost += 1
            raise RemoteWriteUnavailable(None, "read timed out", "http://receiver") from None


async def test_gateway_forwarders_stop_even_if_one_lost_its_cancellation() -> None:
    writer = LosesOneCancellation()
    delivery = await sending(writer)
    assert writer.sends == 1
    # Before: aclose awaited the forwarder once cancelled; it took the lost cancellation
    # for a failed send and waited for more to send, and Gateway.shutdown with it. (This
    # timeout did not even fail: aclose swallowed its cancellation, see the next test.)
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with asyncio.timeout(5):
        await delivery.aclose()
    assert loop.time() - started < 2.0  # cancelled again 0.5 s later: it stops then
    assert writer.lost == 1


class Held:
    """A remote writer whose send never ends (until cancelled)."""

    def __init__(self) -> None:
        self.sends = 0

    async def send(self, series: object) -> None:
        self.sends += 1
        await asyncio.sleep(3600)


async def test_closing_the_forwarders_keeps_a_cancellation_of_its_caller() -> None:
    """Before: ``with suppress(CancelledError): await task`` also swallowed the
    cancellation of the task calling aclose (a shutdown under a timeout): it returned as
    if done, and that timeout never fired."""
    writer = Held()
    delivery = await sending(writer)
    closer = asyncio.create_task(delivery.aclose())
    await asyncio.sleep(0)  # aclose has cancelled the forwarder and waits for it
    closer.cancel()
    await asyncio.wait([closer], timeout=5)
    assert closer.cancelled()


async def test_stop_tasks_stops_them_together_and_names_what_stayed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    release = asyncio.Event()

    async def stubborn() -> None:  # swallows every cancellation until released
        while not release.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(3600)

    quick = [asyncio.create_task(asyncio.sleep(3600)) for _ in range(3)]
    stuck = asyncio.create_task(stubborn(), name="stubborn")
    loop = asyncio.get_running_loop()
    started = loop.time()
    left = await stop_tasks([*quick, stuck], grace=0.3, every=0.05, what="test task")
    assert loop.time() - started < 1.0  # together: not one grace after another
    assert left == [stuck] and all(t.cancelled() for t in quick)
    assert "stubborn" in caplog.text and "did not stop" in caplog.text
    release.set()
    stuck.cancel()
    await asyncio.wait([stuck])


class FakeApp:
    """An Agent or Gateway as the harness drives it: startup, run, stop, shutdown. Its run
    ignores ``stop`` and swallows the first ``swallow`` cancellations (a lost one)."""

    def __init__(self, cfg: Any, *, swallow: int = 1, ignore_stop: bool = True) -> None:
        self.stop = asyncio.Event()
        self.swallow = swallow
        self.ignore_stop = ignore_stop
        self.shut_down = False

    async def startup(self) -> None:
        pass

    async def run(self) -> None:
        while True:
            try:
                if self.ignore_stop:
                    await asyncio.sleep(3600)
                else:
                    await self.stop.wait()
                    return
            except asyncio.CancelledError:
                if self.swallow <= 0:
                    raise
                self.swallow -= 1

    async def shutdown(self) -> None:
        self.shut_down = True


@pytest.mark.parametrize("which", ["running_agent", "running_gateway"])
async def test_a_run_that_ignores_stop_fails_the_teardown_instead_of_hanging(
    monkeypatch: pytest.MonkeyPatch, which: str
) -> None:
    apps: list[FakeApp] = []

    def make(cfg: Any) -> FakeApp:
        apps.append(FakeApp(cfg))
        return apps[-1]

    monkeypatch.setattr(harness.fleet, "Agent", make)
    monkeypatch.setattr(harness.fleet, "Gateway", make)
    monkeypatch.setattr(harness.fleet, "STOP_SECONDS", 0.2)
    running = getattr(harness.fleet, which)
    with pytest.raises(HarnessError, match=r"did not stop within 0\.2 s"):
        async with asyncio.timeout(10):  # before: the teardown awaited run() for ever
            async with running(object()):
                pass
    assert apps[0].shut_down  # shut down all the same: its sockets and tasks go


async def test_a_run_that_stops_when_told_tears_down_quietly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = FakeApp(None, swallow=0, ignore_stop=False)
    monkeypatch.setattr(harness.fleet, "Agent", lambda _cfg: app)
    async with harness.fleet.running_agent(object()) as agent:  # type: ignore[arg-type]
        assert agent is app
    assert app.shut_down


async def test_a_shutdown_that_hangs_fails_the_teardown(monkeypatch: pytest.MonkeyPatch) -> None:
    app = FakeApp(None, swallow=0, ignore_stop=False)

    async def hang() -> None:
        await asyncio.sleep(3600)

    app.shutdown = hang  # type: ignore[method-assign]
    monkeypatch.setattr(harness.fleet, "Agent", lambda _cfg: app)
    monkeypatch.setattr(harness.fleet, "STOP_SECONDS", 0.2)
    with pytest.raises(HarnessError, match=r"shutdown did not finish within 0\.2 s"):
        async with asyncio.timeout(10):
            async with harness.fleet.running_agent(object()):  # type: ignore[arg-type]
                pass


# ---- no asyncio.wait_for under product code, ours or asyncssh's ------------------------

PRODUCT = ("gpurelay", "edge_agent", "cloud_gateway")
# asyncssh wraps every connect/listen (connect, listen, *_reverse, run_client, run_server,
# get_server_*) in asyncio.wait_for(..., connect_timeout): None, the default, awaits
# directly. Client options also read ConnectTimeout from ~/.ssh/config unless config=None.
ASYNCSSH_CLIENT = {
    "connect",
    "listen_reverse",
    "run_client",
    "get_server_host_key",
    "get_server_auth_methods",
}


def wait_for_uses(source: str) -> list[str]:
    """Where ``source`` calls asyncio.wait_for (however imported), or has asyncssh do it:
    any asyncssh call with a connect_timeout, one of ASYNCSSH_CLIENT without config=None."""
    found = []
    tree = ast.parse(source)
    names = {"asyncio.wait_for"} | {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "asyncio"
        for alias in node.names
        if alias.name == "wait_for"
    }
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        called = ast.unparse(node.func)
        if called in names:
            found.append(f"line {node.lineno}: {called}")
        module, _, name = called.rpartition(".")
        if module == "asyncssh":
            kwargs = {k.arg: ast.unparse(k.value) for k in node.keywords}
            if "connect_timeout" in kwargs or (
                name in ASYNCSSH_CLIENT and kwargs.get("config") != "None"
            ):
                found.append(f"line {node.lineno}: {called} (its wait_for on connect_timeout)")
    return found


def test_the_check_finds_what_it_looks_for() -> None:
    assert wait_for_uses("import asyncio\nasync def f(c): await asyncio.wait_for(c, 1)\n")
    assert wait_for_uses("from asyncio import wait_for as w\nasync def f(c): await w(c, 1)\n")
    assert wait_for_uses(
        "async def f(): await asyncssh.connect('h', config=None, connect_timeout=5)"
    )
    assert wait_for_uses("async def f(): await asyncssh.connect('h')")  # ~/.ssh/config's
    assert not wait_for_uses("async def f(): await asyncssh.connect('h', config=None)")
    assert wait_for_uses("async def f(): await asyncssh.listen('h', 22, connect_timeout=5)")
    assert not wait_for_uses("async def f(): await asyncssh.listen('h', 22, login_timeout=5)")
    assert not wait_for_uses("async def f(cond): await cond.wait_for(lambda: True)")


def test_product_code_never_calls_asyncio_wait_for() -> None:
    """Python 3.11's wait_for drops a cancellation that arrives as the awaited call ends
    (gpurelay.tasks); asyncio.timeout keeps it. asyncpg (its own wait_for on 3.11, built
    on asyncio.timeout), aiohttp and httpx/anyio (4.16: keeps a cancellation landing with
    its deadline) do not use it."""
    root = Path(__file__).resolve().parents[2]
    found = [
        f"{path.relative_to(root)} {where}"
        for package in PRODUCT
        for path in sorted((root / package).rglob("*.py"))
        for where in wait_for_uses(path.read_text())
    ]
    assert found == []


async def sending(writer: LosesOneCancellation | Held) -> Delivery:
    """A delivery whose one node's forwarder is in ``writer.send`` with a batch."""
    delivery = Delivery(remote_write=writer)  # type: ignore[arg-type]
    session = delivery.open("n", log=LOG, acknowledge=lambda _s: None, failed=lambda _r: None)
    session.settle(
        1,
        session.judge(1),
        QueuedCollection(
            seq=1, timestamp_ms=1, samples=[((("__name__", "x"),), 1.0)], replayed=False
        ),
    )
    for _ in range(100):
        if writer.sends:
            break
        await asyncio.sleep(0.01)
    return delivery
