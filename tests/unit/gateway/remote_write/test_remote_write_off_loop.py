"""Remote write reads ``bearer_token_file`` again for every request (tokens rotate), in a
thread: on a slow or hung mount (a Kubernetes Secret volume being swapped) a read on the
loop would stall every tunnel. Path.read_text is made slow (or hung) for the token only."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from cloud_gateway.remote_write.client import RemoteWriteUnavailable
from tests.unit.gateway.remote_write.test_remote_write import SERIES, Recorder
from tests.unit.loop_lag import loop_lag

BLOCKED = 2.0  # seconds a read of the token takes; the loop's lag must stay far below
BOUND = 1.0  # a blocked loop shows BLOCKED; a busy machine, milliseconds


class SlowToken:
    """Path.read_text, but reading ``path`` waits ``delay`` seconds, or for ``release``."""

    def __init__(self, path: Path, *, delay: float | None = None) -> None:
        self.path = path
        self.delay = delay
        self.release = threading.Event()
        self.threads: list[str] = []
        self._real = Path.read_text

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def read_text(path: Path, *args: object, **kwargs: object) -> str:
            return self(path, *args, **kwargs)

        monkeypatch.setattr(Path, "read_text", read_text)

    def __call__(self, path: Path, *args: object, **kwargs: object) -> str:
        if path == self.path:
            self.threads.append(threading.current_thread().name)
            if self.delay is not None:
                time.sleep(self.delay)
            else:
                self.release.wait(30)
        return self._real(path, *args, **kwargs)  # type: ignore[arg-type]


async def test_a_slow_token_file_does_not_stall_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    token = tmp_path / "token"
    token.write_text("rotated\n")
    slow = SlowToken(token, delay=BLOCKED)
    slow.install(monkeypatch)
    rec = Recorder()
    writer = rec.writer(bearer_token_file=token, timeout_seconds=10.0)
    async with loop_lag() as lag:
        await writer.send(SERIES)
    assert lag.worst < BOUND, f"the loop stood still for {lag.worst:.2f} s"
    assert slow.threads == ["remote-write-token"]
    assert rec.requests[0].headers["Authorization"] == "Bearer rotated"


async def test_a_hung_token_file_is_one_read_and_requests_fail_after_their_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    token = tmp_path / "token"
    token.write_text("first\n")
    hung = SlowToken(token)
    hung.install(monkeypatch)
    rec = Recorder()
    writer = rec.writer(bearer_token_file=token, timeout_seconds=0.3)
    try:
        async with loop_lag() as lag:
            outcomes = await asyncio.gather(
                *(writer.send(SERIES) for _ in range(10)), return_exceptions=True
            )
        assert lag.worst < BOUND
        assert all(isinstance(o, RemoteWriteUnavailable) for o in outcomes)
        assert "bearer_token_file" in str(outcomes[0]) and "not read within 0.3 s" in str(
            outcomes[0]
        )
        assert len(hung.threads) == 1  # ten requests, one read: no pile of threads
        assert rec.requests == [] and writer.stats.retried_requests == 10
        token.write_text("second\n")
    finally:
        hung.release.set()
    deadline = time.monotonic() + 5
    while any(t.name == "remote-write-token" for t in threading.enumerate()):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    await writer.send(SERIES)  # the file answers again: the next request reads it again
    assert rec.requests[0].headers["Authorization"] == "Bearer second"
