"""Published endpoints: which NODE:PORT is reachable through which agent's tunnel.

An agent offers each allowlisted endpoint as an SSH remote forward (``tcpip-forward`` for
``NODE``, ``PORT``). The gateway opens no socket for it: it records the offer here and,
when Prometheus scrapes ``NODE:PORT`` through the proxy, opens a ``forwarded-tcpip``
channel on that agent's connection.

Names belong to nodes (issue 12: a node once claimed ``victim:PORT`` before the victim
ever connected, and kept it):

- an agent always publishes under its own node name, and that name is its own even if
  another agent claimed it first (the claim is dropped);
- it may publish *sibling* machines of its edge LAN under their own names (Raven-style
  gateway node) only where the operator allows it: ``[ssh] siblings`` rules
  ``"NODE=PATTERN[,PATTERN...]"`` (shell-style patterns, e.g. ``"edge-gw-1=cam-*"``);
  never first-come, and never the name of a node that has its own tunnel;
- at most ``max_endpoints_per_node`` endpoints per agent, its own and its siblings';
- which node a sibling is reached through is remembered after it goes (so a scrape of it
  can say "offline, reached through NODE"), for at most ``max_endpoints_per_node`` names
  per node, the oldest forgotten first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import asyncssh

from cloud_gateway.metrics import FamilySamples, one
from cloud_gateway.names import node_name_problem

log = logging.getLogger("cloud_gateway.endpoints")


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
    def __init__(
        self,
        *,
        is_tunnel_node: Callable[[str], bool] = lambda name: False,
        siblings: Mapping[str, tuple[str, ...]] | None = None,
        max_endpoints_per_node: int = 64,
    ) -> None:
        self._by_key: dict[tuple[str, int], Endpoint] = {}
        self._is_tunnel_node = is_tunnel_node  # "has this name its own tunnel?"
        self._rules = dict(siblings or {})  # node -> patterns of sibling names it may use
        self.max_endpoints_per_node = max_endpoints_per_node
        self.refused = 0
        self.siblings: dict[str, str] = {}  # sibling name -> the node that published it
        self._remembered: dict[str, dict[str, None]] = {}  # via -> its sibling names, in order
        self._per_node: dict[str, int] = {}  # via -> endpoints it publishes

    def may_speak_for(self, via: str, name: str) -> bool:
        return name == via or any(fnmatchcase(name, p) for p in self._rules.get(via, ()))

    def offer(self, *, via: str, name: str, port: int, conn: Any) -> str | None:
        """Record an offer; returns why it is refused, or None when accepted."""
        problem = node_name_problem(name)
        if problem is not None:
            return f"{name!r} is not a DNS-1123 label: {problem}"
        if not 1 <= port <= 65535:
            return f"port {port} is not in 1..65535"
        if name != via and self._is_tunnel_node(name):
            return f"{name} is a node with its own tunnel; only it may publish {name}:{port}"
        if not self.may_speak_for(via, name):
            return (
                f"{via} may not publish under the name {name} (allow it with an [ssh] "
                f'siblings rule, e.g. "{via}={name}")'
            )
        current = self._by_key.get((name, port))
        if current is not None and via not in (current.via, name):
            return f"{name}:{port} is already published by {current.via}"
        taken = current is not None and current.via != via
        mine = self._per_node.get(via, 0)
        if (current is None or taken) and mine >= self.max_endpoints_per_node:
            return f"{via} publishes {mine} endpoints, the limit (ssh.max_endpoints_per_node)"
        if current is not None:
            if taken:  # the node's own name is always its own
                log.warning("%s:%d taken back by %s from %s", name, port, via, current.via)
            self._forget(current)
        self._by_key[(name, port)] = Endpoint(name, port, via, conn)
        self._per_node[via] = self._per_node.get(via, 0) + 1
        if name != via:
            self._remember(via, name)
        elif name in self.siblings:
            self._remembered.get(self.siblings.pop(name), {}).pop(name, None)
        return None

    def _remember(self, via: str, name: str) -> None:
        self.siblings[name] = via
        names = self._remembered.setdefault(via, {})
        names.pop(name, None)
        names[name] = None
        while len(names) > self.max_endpoints_per_node:
            oldest = next(iter(names))
            del names[oldest]
            if self.siblings.get(oldest) == via and not self.ports(oldest):
                del self.siblings[oldest]

    def _forget(self, entry: Endpoint) -> None:
        del self._by_key[(entry.name, entry.port)]
        left = self._per_node[entry.via] - 1
        if left:
            self._per_node[entry.via] = left
        else:
            del self._per_node[entry.via]

    def withdraw(self, name: str, port: int, conn: Any) -> None:
        current = self._by_key.get((name, port))
        if current is not None and current.conn is conn:
            self._forget(current)

    def lookup(self, name: str, port: int) -> Endpoint | None:
        return self._by_key.get((name, port))

    def ports(self, name: str) -> list[int]:
        return sorted(p for (n, p) in self._by_key if n == name)

    def count(self) -> int:
        return len(self._by_key)

    def families(self) -> list[FamilySamples]:
        """Endpoints reachable now, and those refused."""
        return [
            one("gpurelay_gateway_published_endpoints", self.count()),
            one("gpurelay_gateway_publish_refused_total", self.refused),
        ]

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
