"""``cloud-gateway run`` on a port another process listens on says so in one line and exits
non-zero (issue 23): before, a 30-line traceback after "telling 0 agent(s) goodbye"."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import cast

import pytest

from cloud_gateway.errors import ListenError
from cloud_gateway.relay.peers import start_peer_listener
from cloud_gateway.relay.relay import Relay
from harness.fleet import make_pki
from harness.services import GatewayProc


@pytest.mark.parametrize(("listener", "key"), [("SSH", "ssh.listen"), ("HTTP", "http.listen")])
def test_a_taken_port_is_one_line_naming_the_listener_and_address(
    tmp_path: Path, listener: str, key: str
) -> None:
    gateway = GatewayProc(make_pki(tmp_path), tmp_path)
    port = gateway.ssh_port if listener == "SSH" else gateway.http_port
    with socket.socket() as holder:  # another process's listener, as a server binds it
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", port))
        holder.listen()
        gateway.start()
        assert gateway.proc is not None
        status = gateway.proc.wait(timeout=60)
    log = gateway.log.read_text()
    assert status == 1, log
    assert "Traceback" not in log, log
    assert "goodbye" not in log, log  # it never listened: nobody to say goodbye to
    errors = [line for line in log.splitlines() if line.startswith("cloud-gateway: error:")]
    assert len(errors) == 1, log
    assert errors[0] == (
        f"cloud-gateway: error: cannot listen for {listener} on 127.0.0.1:{port} ({key}): "
        "address already in use (another process listens there)"
    ), log


async def test_the_peer_listener_on_a_taken_port_names_itself() -> None:
    """The cluster's peer listener (``[cluster] peer_listen``) says which it is too."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = int(holder.getsockname()[1])
        no_proxy = cast(Relay, object())  # never reached: nothing is relayed
        with pytest.raises(ListenError) as refused:
            await start_peer_listener(no_proxy, "token", "127.0.0.1", port)
    assert str(refused.value) == (
        f"cannot listen for peers on 127.0.0.1:{port} (cluster.peer_listen): "
        "address already in use (another process listens there)"
    )
