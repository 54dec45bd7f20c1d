"""One agent per spool, with real ``edge-agent run`` processes (issue 23, item 12).

A second agent beside the service (or a second demo on moved ports) shared the spool: a
negative ``gpurelay_agent_spool_batches``, orphan rows, ``meta.high_seq`` overwritten. Now
the second one exits non-zero with one line naming the holder, and a holder killed with
``kill -9`` leaves no stale lock behind."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx

from harness.fleet import make_pki
from harness.ports import free_ports
from harness.services import AgentProc
from harness.waiting import wait_until

NODE = "edge-spool"


def test_a_second_agent_on_the_same_spool_exits_naming_the_holder(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    creds = pki.node(NODE)
    key = creds.private_key
    assert key is not None
    (closed,) = free_ports(1)  # nothing listens: every batch waits in the spool
    spool = tmp_path / "spool"

    def agent(name: str) -> AgentProc:
        home = tmp_path / name
        home.mkdir()
        return AgentProc(
            pki,
            home,
            NODE,
            None,
            spool_dir=spool,
            address=f"127.0.0.1:{closed}",
            credentials=(key, creds.certificate),
        )

    first, second, third = agent("first"), agent("second"), agent("third")
    try:
        first.start()
        wait_until(
            lambda: first.metric("gpurelay_agent_spool_batches") >= 3,
            60,
            "the first agent spooling",
            alive=[first],
        )
        second.start()
        assert second.proc is not None
        status = second.proc.wait(timeout=60)
        log = second.log.read_text()
        assert status != 0, log
        assert "Traceback" not in log, log
        refused = [line for line in log.splitlines() if "in use by another" in line]
        assert len(refused) == 1, log
        line = refused[0]
        assert line.startswith("edge-agent: error: spool "), line
        assert str(spool / "spool.sqlite") in line, line
        assert f"pid {first.pid} on {socket.gethostname()}" in line, line
        assert "since " in line, line
        # The first agent goes on as before, its count never disturbed.
        spooled = first.metric("gpurelay_agent_spool_batches")
        assert spooled >= 3
        assert httpx.get(f"{first.url}/healthz", timeout=5).status_code == 200

        # kill -9 leaves no stale lock: the kernel released it with the process.
        first.kill9()
        third.start()
        wait_until(
            lambda: third.metric("gpurelay_agent_spool_batches") >= spooled,
            60,
            "the next agent taking over the spool and its batches",
            alive=[third],
        )
    finally:
        for proc in (third, second, first):
            proc.stop()
