"""Dialling the gateway: the TCP connection, apart from the SSH handshake on top of it.

Telling the two apart is what lets the tunnel retry a *silent* path quickly. A SYN that
nobody answers (an uplink that is down, a NAT that lost its state, a cable pulled two hops
away) costs the gateway nothing, so the agent tries again after a short pause and its data
resumes within seconds of the path returning; Linux would otherwise keep retransmitting
one SYN at 1, 3, 7, 15 ... s. A gateway that answers and then refuses or is slow to
finish the handshake gets the growing backoff, which is what protects it from a herd.
"""

from __future__ import annotations

import asyncio
import socket

from edge_agent.errors import AgentError


class PathSilent(AgentError):
    """No answer to the TCP handshake within the dial timeout: nothing reached the gateway."""


async def dial(host: str, port: int, timeout: float) -> socket.socket:
    """A connected, non-blocking TCP socket to ``host:port`` (each address ``host`` has, in
    order, within ``timeout`` seconds in all). Raises :class:`PathSilent` when no address
    answered in time, ``OSError`` when one refused or was unreachable."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    infos = await asyncio.wait_for(
        loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), max(timeout, 0.001)
    )
    error: OSError | None = None
    for family, kind, proto, _name, address in infos:
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, address), deadline - loop.time())
        except TimeoutError:
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
