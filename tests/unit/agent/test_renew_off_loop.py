"""The agent's renewal writes and fsyncs the new key and certificate in a worker thread,
not on the loop that runs its tunnel, spool and local exporter: an fsync on a slow SD card
or a busy disk takes seconds. Here the first os.fsync takes 2 s (in whatever thread calls it)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import asyncssh
import pytest

from edge_agent.config import TunnelConfig
from edge_agent.renew import Renewer
from tests.unit.agent.test_certificate_answer import answer
from tests.unit.loop_lag import loop_lag

NODE = "edge-7"
BLOCKED = 2.0  # seconds an fsync takes; the loop's lag must stay far below
BOUND = 1.0  # a blocked loop shows BLOCKED; a busy machine, milliseconds


def user_cert(
    ca: asyncssh.SSHKey, key: asyncssh.SSHKey, *, serial: int, valid_before: int
) -> asyncssh.SSHCertificate:
    return ca.generate_user_certificate(
        key,
        f"node:{NODE}",
        serial=serial,
        principals=[NODE],
        valid_after=0,
        valid_before=valid_before,
    )


class AnsweringConnection:
    """Stands in for the SSH connection (a network seam): the gateway answers the renewal
    subsystem with ``cert``, as the contract says it does."""

    def __init__(self, cert: asyncssh.SSHCertificate) -> None:
        self.cert = cert

    async def run(self, **kwargs: object) -> asyncssh.SSHCompletedProcess:
        assert kwargs["subsystem"] == "gpurelay-renew"
        return answer(0, stdout=self.cert.export_certificate().decode("ascii"))


@pytest.mark.parametrize("new_key", [False, True], ids=["same-key", "new-key"])
async def test_a_slow_fsync_does_not_stall_the_agents_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, new_key: bool
) -> None:
    ca = asyncssh.generate_private_key("ssh-ed25519")
    key = asyncssh.generate_private_key("ssh-ed25519")
    (tmp_path / "node.key").write_bytes(key.export_private_key())
    (tmp_path / "node.key").chmod(0o600)
    old = user_cert(ca, key, serial=5, valid_before=900)
    (tmp_path / "node.key-cert.pub").write_bytes(old.export_certificate())
    os.utime(tmp_path / "node.key-cert.pub", (0, 0))
    cfg = TunnelConfig(
        key=tmp_path / "node.key",
        known_hosts=tmp_path / "known_hosts",
        renew_new_key=new_key,
    )
    renewer = Renewer(cfg, node=NODE, clock=lambda: 700.0)
    renewer.loaded(old)

    class Gateway(AnsweringConnection):
        async def run(self, **kwargs: object) -> asyncssh.SSHCompletedProcess:
            public = asyncssh.import_public_key(str(kwargs["input"]))
            self.cert = user_cert(ca, public, serial=6, valid_before=2_000)
            return await super().run(**kwargs)

    real_fsync = os.fsync
    fsyncs: list[str] = []

    def slow_fsync(fd: int) -> None:  # the first one: the test's time is its own
        fsyncs.append(threading.current_thread().name)
        if len(fsyncs) == 1:
            time.sleep(BLOCKED)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    gateway = Gateway(old)
    async with loop_lag() as lag:
        assert await renewer.renew(gateway)  # type: ignore[arg-type]
    assert lag.worst < BOUND, f"the loop stood still for {lag.worst:.2f} s"
    assert fsyncs and threading.main_thread().name not in fsyncs
    assert (tmp_path / "node.key-cert.pub").read_bytes() == gateway.cert.export_certificate()
    assert renewer.stats.renewals == 1
