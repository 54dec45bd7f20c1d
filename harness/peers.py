"""A gateway's peer listener (:mod:`cloud_gateway.relay.peers`) in the test's own loop, as the
gateway starts it (guarded: its connection cap and timeouts), on a free loopback port: the
in-process tests of the hop between gateways. The process-level cluster has its own
(:mod:`harness.cluster`)."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from cloud_gateway.app import Gateway
from cloud_gateway.listener import ConnectionGuard
from cloud_gateway.relay.peers import start_peer_listener

PEER_TOKEN = "peer-secret-0123456789"


@dataclass(frozen=True)
class PeerListener:
    port: int
    guard: ConnectionGuard  # its connections: open, closed by reason

    @property
    def address(self) -> str:
        """``127.0.0.1:PORT``, as a fleet view names a peer."""
        return f"127.0.0.1:{self.port}"


@asynccontextmanager
async def peer_listener(
    gw: Gateway, token: str = PEER_TOKEN, *, tls: ssl.SSLContext | None = None
) -> AsyncIterator[PeerListener]:
    """``gw``'s peer listener, taking ``token`` (over https with ``tls``); stopped on the
    way out."""
    runner, guard, port = await start_peer_listener(gw.relay, token, "127.0.0.1", 0, tls=tls)
    try:
        yield PeerListener(port, guard)
    finally:
        await runner.cleanup()
