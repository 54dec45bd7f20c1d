"""Fuzz target: the gateway's ingest path end to end, in-process: what an SSH channel does
with a node's bytes (:class:`FrameDecoder`, then :class:`Ingest` on a :class:`Registry`),
then the ``/metrics`` exposition of whatever was accepted.

Contract: nothing but :class:`~gpurelay.wire.WireError` leaves decode and ingest, and the
exposition still renders and parses as Prometheus text. The fuzzing counterpart of
``tests/unit/gateway/test_gateway_fuzz.py``; slower per input than ``frames.py`` (it builds a
registry and renders it), so it finds less per second but looks further.

Input: a control byte (``common.py``: plain form, small limits, chunking), then the stream.
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports(include=["gpurelay", "cloud_gateway", "common"]):
    from common import PLAIN, SMALL, SMALL_LIMITS, plain_to_wire, split
    from prometheus_client.parser import text_string_to_metric_families

    from cloud_gateway.exposition.body import Exposition
    from cloud_gateway.ingest.session import Ingest
    from cloud_gateway.registry.store import Registry
    from gpurelay.wire import DEFAULT_LIMITS, FrameDecoder, WireError


def test_one_input(data: bytes) -> None:
    if not data:
        return
    control, stream = data[0], data[1:]
    if control & PLAIN:
        stream = plain_to_wire(stream)
    limits = SMALL_LIMITS if control & SMALL else DEFAULT_LIMITS
    registry = Registry()
    ingest = Ingest(registry, clock=lambda: 1000.0, limits=limits)
    session = ingest.open_session("fuzz-node", "127.0.0.1:1", lambda reason: None)
    decoder = FrameDecoder(limits=limits)
    try:
        for chunk in split(stream, control):
            session.received(len(chunk))
            for frame in decoder.feed(chunk):
                session.handle(frame)
    except WireError:
        pass  # the gateway sends an ERROR frame and closes the connection
    finally:
        session.closed("fuzz")
    body = Exposition(registry).body(openmetrics=False, gzip=False).decode()
    for _family in text_string_to_metric_families(body):
        pass


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
