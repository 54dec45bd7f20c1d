"""Dialling the gateway: the TCP connection, apart from the SSH handshake on top of it.

Telling the two apart is what lets the tunnel retry a *silent* path quickly. A SYN that
nobody answers (an uplink that is down, a NAT that lost its state, a cable pulled two hops
away) costs the gateway nothing, so the agent tries again after a short pause and its data
resumes within seconds of the path returning; Linux would otherwise keep retransmitting
one SYN at 1, 3, 7, 15 ... s. A gateway that answers and then refuses or is slow to
finish the handshake gets the growing backoff, which is what protects it from a herd.

Where it dials: one address (a balancer's, or the only gateway's), or a list of gateways
without a balancer (``[gateway] addresses``, bare metal). :class:`Rotation` is the order
over that list: each agent starts at a place given by a stable hash of its node name, so a
fleet spreads over the gateways instead of all dialling the first, and goes round from
there.
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
from collections.abc import Sequence

from edge_agent.errors import AgentError
from gpurelay import compat
from gpurelay.compat import TIMEOUTS


class PathSilent(AgentError):
    """No answer to the TCP handshake within the dial timeout: nothing reached the gateway."""


async def dial(host: str, port: int, timeout: float) -> socket.socket:
    """A connected, non-blocking TCP socket to ``host:port`` (each address ``host`` has, in
    order, within ``timeout`` seconds in all). Raises :class:`PathSilent` when no address
    answered in time (or the name was not resolved in time), ``OSError`` when one refused
    or was unreachable."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        async with compat.timeout(max(timeout, 0.001)):
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except TIMEOUTS:  # a resolver that does not answer: nothing reached the gateway either
        raise PathSilent(f"{host} not resolved within {timeout:g}s (a silent path)") from None
    error: OSError | None = None
    for family, kind, proto, _name, address in infos:
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        try:
            async with compat.timeout_at(deadline):
                await loop.sock_connect(sock, address)
        except TIMEOUTS:
            sock.close()
            raise PathSilent(
                f"no answer from {host}:{port} within {timeout:g}s (a silent path)"
            ) from None
        except OSError as exc:
            sock.close()
            error = exc
            continue
        except BaseException:
            sock.close()
            raise
        return sock
    raise error or OSError(f"{host}:{port} resolves to no address")


def first_index(node: str, count: int) -> int:
    """Where ``node`` starts in a list of ``count`` gateways: the same on every start and
    every machine (SHA-256 of the name, not Python's salted ``hash``), even over a fleet."""
    if count < 1:
        raise ValueError("no gateway addresses")
    digest = hashlib.sha256(node.encode("utf-8", "surrogateescape")).digest()
    return int.from_bytes(digest[:8], "big") % count


class Rotation:
    """The gateway addresses in the order one agent dials them: from its first index on,
    round the list. Pure: the tunnel says when to move on (:meth:`advance`)."""

    def __init__(self, addresses: Sequence[tuple[str, int]], node: str) -> None:
        self.addresses = tuple(addresses)
        self.position = first_index(node, len(self.addresses))

    def __len__(self) -> int:
        return len(self.addresses)

    @property
    def current(self) -> tuple[str, int]:
        return self.addresses[self.position]

    def advance(self) -> tuple[str, int]:
        """Move on to the next address (after the last, the first); returns it."""
        self.position = (self.position + 1) % len(self.addresses)
        return self.current

    def round(self) -> list[tuple[str, int]]:
        """Every address once, from the current one on: the order of one round of dials."""
        n = len(self.addresses)
        return [self.addresses[(self.position + i) % n] for i in range(n)]


def show(address: tuple[str, int]) -> str:
    """``host:port`` (``[v6]:port``) for logs and the address label."""
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
