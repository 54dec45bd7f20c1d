"""The gateway's revocation watcher never waits for the file on the event loop: a stat
on a hung NFS mount or a Secret volume being swapped would stall every tunnel and login.
os.stat is made slow (or hung) for the revocation file only, in whatever thread asks."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from cloud_gateway.trust.revocation import RevocationWatcher
from tests.unit.loop_lag import loop_lag

BLOCKED = 2.0  # seconds a stat of the file takes; the loop's lag must stay far below
BOUND = 1.0  # a blocked loop shows BLOCKED; a busy machine, milliseconds


_MTIMES = itertools.count(1_000_000_000_000_000_000, 1_000_000_000)


def rewrite(path: Path, text: str) -> None:
    """Write ``text`` with a new mtime, without a stat of its own (the test's stat hangs)."""
    path.write_text(text, encoding="utf-8")
    mtime = next(_MTIMES)
    os.utime(path, ns=(mtime, mtime))


class SlowStat:
    """os.stat, but a stat of ``path`` waits ``delay`` seconds, or for ``release``."""

    def __init__(self, path: Path, *, delay: float | None = None) -> None:
        self.path = str(path)
        self.delay = delay
        self.release = threading.Event()
        self.threads: list[str] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self._real: Callable[..., os.stat_result] = os.stat
        self._lock = threading.Lock()

    def __call__(self, path: object, *args: object, **kwargs: object) -> os.stat_result:
        if isinstance(path, str | os.PathLike) and os.fspath(path) == self.path:
            with self._lock:
                self.threads.append(threading.current_thread().name)
                self.in_flight += 1
                self.most_in_flight = max(self.most_in_flight, self.in_flight)
            try:
                if self.delay is not None:
                    time.sleep(self.delay)
                else:
                    self.release.wait(30)
            finally:
                with self._lock:
                    self.in_flight -= 1
        return self._real(path, *args, **kwargs)  # type: ignore[arg-type]


async def eventually(check: Callable[[], bool], within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, "not within time"
        await asyncio.sleep(0.02)


async def test_a_slow_stat_does_not_stall_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "revocations"
    rewrite(path, "node edge-1\n")
    watcher = RevocationWatcher(path, interval=0.1)
    rewrite(path, "node edge-1\nnode edge-2\n")
    slow = SlowStat(path, delay=BLOCKED)
    monkeypatch.setattr(os, "stat", slow)
    await asyncio.sleep(0.15)  # the interval has passed: the next login looks
    async with loop_lag() as lag:
        started = time.monotonic()
        while time.monotonic() - started < BLOCKED + 0.5:  # logins all along
            assert watcher.current().nodes <= {"edge-1", "edge-2"}
            await asyncio.sleep(0.05)
    assert lag.worst < BOUND, f"the loop stood still for {lag.worst:.2f} s"
    assert slow.threads and threading.main_thread().name not in slow.threads
    # it took effect all the same (once the blocked look, in its thread, came back)
    await eventually(lambda: watcher.current().nodes == {"edge-1", "edge-2"})


async def test_a_hung_stat_is_one_look_reported_once_and_the_list_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "revocations"
    rewrite(path, "node edge-1\n")
    watcher = RevocationWatcher(path, interval=0.05)
    before = {t for t in threading.enumerate() if t.name == "revocation-look"}
    hung = SlowStat(path)
    monkeypatch.setattr(os, "stat", hung)
    caplog.set_level(logging.INFO, logger="cloud_gateway.revocation")
    try:
        for _ in range(20):  # 20 intervals of logins and timer ticks while it hangs
            assert watcher.current().nodes == {"edge-1"}
            await asyncio.sleep(0.05)
        assert hung.most_in_flight == 1 and len(hung.threads) == 1  # no pile of threads
        looking = {t for t in threading.enumerate() if t.name == "revocation-look"}
        assert len(looking - before) == 1
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and "has not answered for" in errors[0].getMessage()
        assert "the 1 rules loaded before stay in force" in errors[0].getMessage()
        assert watcher.last_error is not None and "has not answered" in watcher.last_error
        rewrite(path, "node edge-1\nnode edge-3\n")
    finally:
        hung.release.set()
    await eventually(lambda: watcher.current().nodes == {"edge-1", "edge-3"})
    assert watcher.last_error is None
    assert "answered again after" in caplog.text


async def test_a_change_takes_effect_within_the_interval_without_a_login(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first login after a revocation is refused: the loop's timer looked meanwhile
    (in a worker thread, never on the loop's)."""
    path = tmp_path / "revocations"
    rewrite(path, "node edge-1\n")
    watcher = RevocationWatcher(path, interval=0.1)
    seen = SlowStat(path, delay=0.0)
    monkeypatch.setattr(os, "stat", seen)
    rewrite(path, "node edge-1\nnode edge-2\n")
    # no login meanwhile: the timer's looks, one at a time, each a stat; a second has begun
    # only once the first (which saw the change) was applied
    await eventually(lambda: len(seen.threads) >= 2)
    assert watcher.current().nodes == {"edge-1", "edge-2"}
    assert seen.threads and set(seen.threads) == {"revocation-look"}


def test_a_hung_look_does_not_hold_up_the_loops_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """asyncio.run waits for its default executor at the end (3.11: without a bound); the
    look runs in a daemon thread of its own, so a gateway with a hung mount still exits,
    and the watcher looks again on the next loop once the file answers."""
    path = tmp_path / "revocations"
    rewrite(path, "node edge-1\n")
    clock = [0.0]
    watcher = RevocationWatcher(path, lambda: clock[0], interval=1.0)
    hung = SlowStat(path)
    monkeypatch.setattr(os, "stat", hung)

    async def login() -> None:
        clock[0] += 1
        watcher.current()
        await asyncio.sleep(0.05)

    try:
        started = time.monotonic()
        asyncio.run(login())
        assert time.monotonic() - started < BOUND
        assert len(hung.threads) == 1
        rewrite(path, "node edge-2\n")
    finally:
        hung.release.set()
    deadline = time.monotonic() + 5
    while any(t.name == "revocation-look" for t in threading.enumerate()):
        assert time.monotonic() < deadline
        time.sleep(0.02)

    async def logins() -> set[str]:
        clock[0] += 1
        watcher.current()  # the look the closed loop never heard back from is over
        for _ in range(100):
            await asyncio.sleep(0.02)
            if watcher.current().nodes == {"edge-2"}:
                break
        return set(watcher.current().nodes)

    assert asyncio.run(logins()) == {"edge-2"}
