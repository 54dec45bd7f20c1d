"""A fleet reconnecting at once must not stop the gateway's clock: reads that carry
DECLAREs (a node's expensive first batch) run one per turn of the event loop, so timers
(the tick that sends heartbeats) run between them; HELLO is never held back."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from cloud_gateway.ssh.server import SshServer, _TelemetryChannel
from gpurelay.wire import Batch, Declare, Frame, Hello, SeriesDecl

HELLO = Hello(agent_version="1", node="n")
DECLARE = Declare(series=(SeriesDecl(id=0, name="x", type="gauge", help="", labels=()),))
BATCH = Batch(seq=1, timestamp=1.0, values=((0, 1.0),))


class Turns:
    """Counts turns of the event loop (a callback that puts itself back each turn)."""

    def __init__(self) -> None:
        self.n = 0
        self._stopped = False
        asyncio.get_running_loop().call_soon(self._turn)

    def _turn(self) -> None:
        self.n += 1
        if not self._stopped:
            asyncio.get_running_loop().call_soon(self._turn)

    def stop(self) -> None:
        self._stopped = True


class Recorder:
    def __init__(
        self,
        turns: Turns,
        log: list[tuple[str, int]],
        on_declare: Callable[[], None] = lambda: None,
    ) -> None:
        self.turns, self.log, self.on_declare = turns, log, on_declare

    def handle(self, frame: Frame) -> Sequence[Frame]:
        self.log.append((type(frame).__name__, self.turns.n))
        if isinstance(frame, Declare):
            self.on_declare()
            time.sleep(0.002)  # the expensive part
        return ()


def channel(server: SshServer, session: Recorder) -> _TelemetryChannel:
    ch = object.__new__(_TelemetryChannel)  # only what _handle uses
    ch._server = server
    ch._session = session  # type: ignore[assignment]
    ch._send = lambda frame: None  # type: ignore[method-assign]
    return ch


def server() -> SshServer:
    return SshServer(host_keys=(), policy=None, sessions=None, limits=None)  # type: ignore[arg-type]


async def test_reads_with_declares_run_one_per_turn_and_hellos_do_not_wait() -> None:
    turns = Turns()
    srv = server()
    log: list[tuple[str, int]] = []
    reads = [[HELLO, DECLARE, BATCH] for _ in range(8)]  # eight nodes, all ready at once
    sessions = [Recorder(turns, log) for _ in reads]
    await asyncio.gather(
        *(
            channel(srv, s)._handle(s, iter(frames))
            for s, frames in zip(sessions, reads, strict=True)
        )  # type: ignore[arg-type]
    )
    turns.stop()
    hellos = [t for name, t in log if name == "Hello"]
    declares = [t for name, t in log if name == "Declare"]
    assert len(hellos) == len(declares) == 8
    assert len(set(hellos)) == 1  # every HELLO in the first turn: none waited
    assert len(set(declares)) == 8, declares  # one read with DECLAREs per turn
    assert srv.declare_waits == 7
    # a batch stays with its DECLARE (same read, same turn)
    batches = [t for name, t in log if name == "Batch"]
    assert batches == declares


async def test_a_timer_runs_between_two_declare_reads() -> None:
    srv = server()
    fired: list[int] = []
    turns = Turns()
    log: list[tuple[str, int]] = []
    loop = asyncio.get_running_loop()

    def arm() -> None:  # a timer that is due as soon as the first DECLARE is handled
        if not fired:
            fired.append(-1)
            loop.call_later(0, lambda: fired.append(turns.n))

    sessions = [Recorder(turns, log, arm) for _ in range(3)]
    await asyncio.gather(*(channel(srv, s)._handle(s, iter([DECLARE])) for s in sessions))  # type: ignore[arg-type]
    turns.stop()
    declares = [t for _, t in log]
    assert len(fired) == 2 and declares[0] < fired[1] < declares[-1], (declares, fired)
