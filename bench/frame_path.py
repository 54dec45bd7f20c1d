"""Which gateway modules one BATCH enters, and how often: the frame's way through, traced.

A node's session is opened as the SSH server opens it (HELLO, DECLARE), then one BATCH
is handed to it with :func:`sys.setprofile` on, following the call stack. Printed, for
remote write off and on: the modules the BATCH enters, in order of first entry; the
*re-entries*, calls into a module that is already on the stack below another one (a
callback: delivery calling a closure back in ingest is one); and which module's code
writes the ACK frame (the function that calls the channel's ``send``).

The counts are the same on any machine (no timing): they describe the code. Run on an
older commit to compare (the script only uses ``Ingest``, ``open_session`` and
``handle``, which every version has).

Run: .venv/bin/python bench/frame_path.py
"""

from __future__ import annotations

import asyncio
import inspect
import sys
from types import FrameType
from typing import Any

from cloud_gateway.ingest import session as session_module
from cloud_gateway.ingest.delivery import Delivery
from cloud_gateway.registry.store import Registry
from gpurelay.wire import Ack, Batch, Declare, Frame, Hello, SeriesDecl

SESSION_MODULE = session_module.__name__


def module_of(frame: FrameType | None) -> str:
    return "" if frame is None else str(frame.f_globals.get("__name__", ""))


def trace_batch(remote_write: bool) -> tuple[list[str], list[str], list[str]]:
    """(modules entered, in order; re-entries; the modules whose code wrote an ACK)."""
    ack_writers: list[str] = []

    def send(frame: Frame) -> None:
        if isinstance(frame, Ack):
            ack_writers.append(module_of(sys._getframe(1)))

    ingest = make_ingest(remote_write)
    session = ingest.open_session("edge-1", "10.0.0.1:1", lambda reason: None, send)
    session.handle(Hello(agent_version="0", node="edge-1", interval_seconds=1.0))
    decl = SeriesDecl(id=0, name="DCGM_FI_DEV_GPU_UTIL", type="gauge", help="", labels=())
    session.handle(Declare(series=(decl,)))
    batch = Batch(seq=1, timestamp=1.0, values=((0, 1.0),))
    entered: list[str] = []
    reentries: list[str] = []
    stack: list[str] = [module_of(sys._getframe(0))]

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            callee = module_of(frame)
            if callee.startswith("cloud_gateway") and callee != stack[-1] and callee in stack:
                reentries.append(f"{stack[-1]} -> {callee}")
            if callee.startswith("cloud_gateway") and callee not in entered:
                entered.append(callee)
            stack.append(callee)
        elif event == "return" and len(stack) > 1:
            stack.pop()

    sys.setprofile(profile)
    try:
        replies = session.handle(batch)
    finally:
        sys.setprofile(None)
    if replies:  # older versions returned the ACK for the SSH server to write
        ack_writers.append("the caller (the SSH server), to which handle() returned it")
    return entered, reentries, ack_writers


def make_ingest(remote_write: bool) -> Any:
    if not remote_write:
        return session_module.Ingest(Registry(), clock=lambda: 1.0)
    return session_module.Ingest(Registry(), clock=lambda: 1.0, **remote_write_kwargs())


class HeldWriter:
    """A remote writer that never answers (the ACK then comes later; not traced here)."""

    async def send(self, series: object) -> None:
        await asyncio.Event().wait()


def remote_write_kwargs() -> dict[str, Any]:
    """Remote write on, as this version's ``Ingest`` takes it (older ones took the writer)."""
    if "delivery" in inspect.signature(session_module.Ingest).parameters:
        return {"delivery": Delivery(remote_write=HeldWriter())}  # type: ignore[arg-type]
    return {"remote_write": HeldWriter()}


async def main() -> None:
    short = lambda m: m.removeprefix("cloud_gateway.")  # noqa: E731
    for remote_write in (False, True):
        entered, reentries, writers = trace_batch(remote_write)
        print(f"remote write {'on' if remote_write else 'off'}:")
        print(f"  {len(entered)} modules entered: " + ", ".join(map(short, entered)))
        print(f"  {len(reentries)} re-entries (callbacks): " + ("; ".join(reentries) or "none"))
        print(f"  ACK written by: {', '.join(writers) or '(later, once remote write took it)'}")


if __name__ == "__main__":
    asyncio.run(main())
