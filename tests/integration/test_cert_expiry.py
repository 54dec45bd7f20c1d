"""Node certificate expiry on a real gateway, with certificates signed by ``ssh-keygen``:
the gauge, the API field, the ``cloud-gateway nodes`` column, the WARNING, and the
inventory keeping it across a restart."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import re
import shutil
import subprocess
from pathlib import Path

import asyncssh
import httpx
import pytest
from asyncssh.public_key import SSHOpenSSHCertificate

from cloud_gateway.cluster.config import ClusterConfig
from cloud_gateway.commands.nodes import run_nodes
from cloud_gateway.trust.certs import Credentials
from gpurelay.ssh_cert import certificate_info
from harness.fleet import (
    TOKEN,
    Pki,
    agent_config,
    gateway_config,
    make_pki,
    metrics_text,
    running_agent,
    running_gateway,
)
from harness.waiting import wait_for

SSH_KEYGEN = shutil.which("ssh-keygen")
# CI sets EDGE_GPU_RELAY_REQUIRE_SSH_KEYGEN=1: missing ssh-keygen then fails, not skips
pytestmark = pytest.mark.skipif(
    SSH_KEYGEN is None and os.environ.get("EDGE_GPU_RELAY_REQUIRE_SSH_KEYGEN") != "1",
    reason="ssh-keygen not found (Debian package openssh-client)",
)
AUTH = {"Authorization": f"Bearer {TOKEN}"}
GAUGE = "gpurelay_node_certificate_expiry_timestamp_seconds"


def keygen_sign(
    pki: Pki, node: str, validity: str, serial: int
) -> tuple[Credentials, SSHOpenSSHCertificate]:
    """Re-sign ``node``'s key with the fleet user CA by ``ssh-keygen -s``, ``-V validity``."""
    creds = pki.node(node)
    assert SSH_KEYGEN is not None
    subprocess.run(
        [
            SSH_KEYGEN, "-q", "-s", str(pki.ca.user_ca), "-I", f"node:{node}", "-n", node,
            "-z", str(serial), "-V", validity, str(creds.public_key),
        ],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip
    cert = asyncssh.read_certificate(creds.certificate)
    assert isinstance(cert, SSHOpenSSHCertificate)
    return creds, cert


async def test_expiry_gauge_api_cli_warning_and_restart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    pki = make_pki(tmp_path)
    soon_creds, soon = keygen_sign(pki, "edge-soon", "-1h:+10d", 4101)  # within 14 days
    forever_creds, _ = keygen_sign(pki, "edge-forever", "always:forever", 4102)
    expires = certificate_info(soon).valid_before
    cfg = dataclasses.replace(
        gateway_config(pki), cluster=ClusterConfig(directory=str(tmp_path / "nodes.db"))
    )
    caplog.set_level(logging.WARNING, logger="cloud_gateway.certificates")
    async with (
        running_gateway(cfg) as gw,
        running_agent(agent_config(pki, "edge-soon", gw, creds=soon_creds)),
        running_agent(agent_config(pki, "edge-forever", gw, creds=forever_creds)),
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.http_port}", timeout=20) as client,
    ):
        await wait_for(lambda: gw.ssh is not None and gw.ssh.channels == 2, what="two agents")
        for _ in range(3):  # several ticks: one warning, not one per tick
            gw._refresh()
        text = await metrics_text(gw)
        lines = [line for line in text.splitlines() if line.startswith(GAUGE + "{")]
        assert lines == [f'{GAUGE}{{Hostname="edge-soon"}} {expires}'], lines
        assert f"# TYPE {GAUGE} gauge" in text
        docs = {
            n["name"]: n for n in (await client.get("/api/v1/nodes", headers=AUTH)).json()["nodes"]
        }
        assert docs["edge-soon"]["certificate_expires"] == expires
        assert docs["edge-soon"]["certificate_serial"] == 4101
        assert docs["edge-forever"]["certificate_expires"] is None
        detail = (await client.get("/api/v1/nodes/edge-soon", headers=AUTH)).json()
        assert detail["certificate_expires"] == expires

        args = argparse.Namespace(
            gateway=str(client.base_url), token=TOKEN, token_file=None, state=None,
            domain=None, json=False, timeout=5.0,
        )  # fmt: skip
        assert await asyncio.to_thread(run_nodes, args) == 0
        out = capsys.readouterr().out
        assert re.search(r"^NODE\s+STATE.*\bEXPIRES\b", out, re.M)
        assert re.search(r"^edge-soon\s.*\s\d{4}-\d\d-\d\d \((9|10)d\)\s", out, re.M), out
        assert re.search(r"^edge-forever\s.*\s-\s", out, re.M), out

    warnings = [r.getMessage() for r in caplog.records if "edge-soon" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "within 14 days" in warnings[0] and "serial 4101" in warnings[0]
    assert not [r for r in caplog.records if "edge-forever" in r.getMessage()]

    async with (
        running_gateway(cfg) as gw,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.http_port}", timeout=20) as client,
    ):  # no agent: what the inventory recorded
        gw._refresh()
        docs = {
            n["name"]: n for n in (await client.get("/api/v1/nodes", headers=AUTH)).json()["nodes"]
        }
        assert docs["edge-soon"]["state"] == "offline"
        assert docs["edge-soon"]["certificate_expires"] == expires
        assert docs["edge-forever"]["certificate_expires"] is None
        text = await metrics_text(gw)
        assert f'{GAUGE}{{Hostname="edge-soon"}} {expires}' in text
        assert f'{GAUGE}{{Hostname="edge-forever"}}' not in text
