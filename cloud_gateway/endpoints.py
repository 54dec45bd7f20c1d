"""Published endpoints: which NODE:PORT is reachable through which agent's tunnel.

An agent offers each allowlisted endpoint as an SSH remote forward (``tcpip-forward`` for
``NODE``, ``PORT``). The gateway opens no socket for it: it records the offer here and,
when Prometheus scrapes ``NODE:PORT`` through the proxy, opens a ``forwarded-tcpip``
channel on that agent's connection. An agent always publishes under its own node name;
it may publish *sibling* machines of its edge LAN under their own names (Raven-style
gateway node), but never the name of a node that has its own tunnel, and a sibling name
belongs to the first agent that claims it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import asyncssh

from cloud_gateway.auth_policy import node_name_problem

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Endpoint:
    name: str  # the node name Prometheus uses (NODE in NODE:PORT)
    port: int
    via: str  # the authenticated node whose tunnel carries it
    conn: Any  # that node's asyncssh SSHServerConnection

    @property
    def target(self) -> str:
        return f"{self.name}:{self.port}"


class EndpointTable:
    def __init__(self, *, is_tunnel_node: Callable[[str], bool] = lambda name: False) -> None:
        self._by_key: dict[tuple[str, int], Endpoint] = {}
        self._is_tunnel_node = is_tunnel_node  # "has this name its own tunnel?"
        self.refused = 0
        self.siblings: dict[str, str] = {}  # sibling name -> the node that last published it

    def offer(self, *, via: str, name: str, port: int, conn: Any) -> str | None:
        """Record an offer; returns why it is refused, or None when accepted."""
        problem = node_name_problem(name)
        if problem is not None:
            return f"{name!r} is not a DNS-1123 label: {problem}"
        if not 1 <= port <= 65535:
            return f"port {port} is not in 1..65535"
        current = self._by_key.get((name, port))
        if name != via and self._is_tunnel_node(name):
            return f"{name} is a node with its own tunnel; only it may publish {name}:{port}"
        if current is not None and current.via != via:
            return f"{name}:{port} is already published by {current.via}"
        self._by_key[(name, port)] = Endpoint(name, port, via, conn)
        if name != via:
            self.siblings[name] = via
        return None

    def withdraw(self, name: str, port: int, conn: Any) -> None:
        current = self._by_key.get((name, port))
        if current is not None and current.conn is conn:
            del self._by_key[(name, port)]

    def lookup(self, name: str, port: int) -> Endpoint | None:
        return self._by_key.get((name, port))

    def ports(self, name: str) -> list[int]:
        return sorted(p for (n, p) in self._by_key if n == name)

    def count(self) -> int:
        return len(self._by_key)

    def names(self) -> set[str]:
        return {n for n, _ in self._by_key}

    def published_via(self, via: str) -> list[Endpoint]:
        return sorted(
            (e for e in self._by_key.values() if e.via == via), key=lambda e: (e.name, e.port)
        )


class PublishedListener(asyncssh.SSHListener):
    """What ``server_requested`` returns: no socket, just the table entry's lifetime."""

    def __init__(self, table: EndpointTable, name: str, port: int, conn: Any) -> None:
        super().__init__()
        self._table, self._name, self._port, self._conn = table, name, port, conn

    def get_port(self) -> int:
        return self._port

    def close(self) -> None:
        self._table.withdraw(self._name, self._port, self._conn)

    async def wait_closed(self) -> None:
        return None
