"""Free loopback ports, for servers that must be told their port before they start."""

from __future__ import annotations

import contextlib
import socket


def free_ports(count: int) -> list[int]:
    """Distinct free loopback ports (bound to port 0 together, then released).

    Another process may take one before it is used; where a server reports the port it
    bound, listen on port 0 instead."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
