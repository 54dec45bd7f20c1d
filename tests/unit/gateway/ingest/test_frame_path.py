"""One way through for a frame (issue 25): a BATCH goes down the stages and back by
returns, never by a callback into a module already on the stack, and the ACK is written by
the one module that decides when ACKs are written (cloud_gateway.ingest.acks).

Traced with bench/frame_path.py's tracer (sys.setprofile over the real session, registry
and delivery). Before the change, delivery called a closure back in the session for every
BATCH (and another for its remote-write collection) and the session returned the ACK for
the SSH server to write; both assertions below failed then."""

from __future__ import annotations

import pytest

from bench.frame_path import trace_batch


@pytest.mark.parametrize("remote_write", [False, True], ids=["direct", "remote-write"])
async def test_a_batch_enters_each_stage_once_and_never_calls_back(remote_write: bool) -> None:
    entered, reentries, writers = trace_batch(remote_write)
    assert reentries == []
    assert entered[0] == "cloud_gateway.ingest.session"
    assert "cloud_gateway.registry.store" in entered
    assert "cloud_gateway.ssh.server" not in entered  # the channel's send is all it needs
    if remote_write:
        assert "cloud_gateway.remote_write.forwarder" in entered
        assert writers == []  # acknowledged once the receiver took it
    else:
        assert writers == ["cloud_gateway.ingest.acks"]
