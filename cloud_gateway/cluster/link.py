"""The gateway's link to its node directory (``[cluster]``): what it records as nodes
come and go, and what it learns from the other gateways.

Three setups, one interface (:class:`cloud_gateway.cluster.admission.Admission` for the SSH
server, plus the fleet view for the API and the proxy):

- **in memory** (no file, no database): nothing recorded; every method is a no-op and
  the gateway behaves as it always did;
- **one gateway with an SQLite inventory**: each admitted node's facts are recorded
  (failures are logged and counted, never refused: the inventory must not cost data),
  last-seen times are written every ``SEEN_SECONDS``, and after a restart the API lists
  the nodes it knew as offline until they reconnect;
- **several gateways on PostgreSQL**: a node is admitted only once this gateway has
  claimed it (:mod:`cloud_gateway.cluster.membership`); a node claimed by another gateway is let go
  here at once (GOODBYE, its series dropped, so no two gateways' /metrics hold it); a
  gateway that loses the database fences itself; scrapes of nodes owned elsewhere take one
  hop to the owner (:mod:`cloud_gateway.relay.peers`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from asyncssh.public_key import SSHOpenSSHCertificate

from cloud_gateway.cluster.admission import AdmissionRefused
from cloud_gateway.cluster.config import ClusterConfig
from cloud_gateway.cluster.directory import Directory, DirectoryError, NodeEntry, NodeFacts
from cloud_gateway.cluster.membership import ClaimRefused, Cluster
from cloud_gateway.registry.store import Registry
from cloud_gateway.registry.types import Liveness
from cloud_gateway.relay.endpoints import EndpointTable
from cloud_gateway.trust.cert_expiry import Stored, expiry_of
from gpurelay.wire import Hello

if TYPE_CHECKING:
    from cloud_gateway.cluster.store_pg import Member

log = logging.getLogger("cloud_gateway.directory")

SEEN_SECONDS = 10.0  # the single gateway's last-seen writes


class DirectoryLink:
    def __init__(
        self,
        cfg: ClusterConfig,
        registry: Registry,
        *,
        environ: Mapping[str, str],
        let_go: Callable[[str, str | None], int],
        clock: Callable[[], float] = time.time,
        endpoints: EndpointTable | None = None,
        held: Callable[[str, float], bool] | None = None,
        forgotten: Callable[[list[str]], None] | None = None,
    ) -> None:
        """``let_go(reason, node)``: GOODBYE to ``node``'s agent (every agent: None).
        ``held(node, now)``: the node is refused for now (``ssh.duplicate_connection =
        refuse_both`` after a fight, cloud_gateway.ssh.conflicts): no claim is made for it.
        ``forgotten(nodes)``: these nodes left the registry because another gateway has
        them (or this one fenced): whatever else this gateway shows of them goes too."""
        self.cfg = cfg
        self.registry = registry
        self.endpoints = endpoints  # what nodes publish, written for the whole cluster
        self.gateway = cfg.resolved_gateway_id()
        self._let_go = let_go
        self._held = held
        self._forgotten = forgotten
        self._clock = clock
        self.errors: Counter[str] = Counter()  # the single gateway's inventory errors
        self.inventory: dict[str, NodeEntry] = {}  # what the directory held at start
        self.directory: Directory | None = None
        self.cluster: Cluster | None = None
        self._next_beat = 0.0
        self._pending: set[asyncio.Task[None]] = set()
        if cfg.clustered:
            from cloud_gateway.cluster.store_pg import PostgresDirectory

            self.cluster = Cluster(
                PostgresDirectory(cfg.database, gateway=self.gateway),
                advertise=cfg.advertise or cfg.peer_listen,
                heartbeat_seconds=cfg.heartbeat_seconds,
                ttl_seconds=cfg.ttl_seconds,
                forget_after_seconds=cfg.forget_gateways_after_seconds,
                on_lost=self._lost,
                on_fenced=self._fenced,
                on_shed=self._shed,
            )
        else:
            path = cfg.sqlite_path(environ)
            if path is not None:
                from cloud_gateway.cluster.store_sqlite import SqliteDirectory

                self.directory = SqliteDirectory(path, gateway=self.gateway)

    @property
    def advertise(self) -> str:
        return self.cluster.advertise if self.cluster is not None else ""

    @advertise.setter
    def advertise(self, value: str) -> None:
        if self.cluster is not None:
            self.cluster.advertise = value

    def set_http(self, host: str, port: int) -> None:
        """This gateway's HTTP listener as bound, for the other gateways' http_sd: its
        host, or the peer advertise host when it listens on every address."""
        if self.cluster is None:
            return
        if host in ("", "0.0.0.0", "::", "[::]"):
            host = self.cluster.advertise.rpartition(":")[0] or "localhost"
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        self.cluster.http = f"{host}:{port}"

    def http_targets(self) -> list[tuple[str, str]]:
        """(gateway id, HTTP host:port) of every live member that said where it listens."""
        if self.cluster is None:
            return []
        ttl = self.cfg.ttl_seconds
        out = {m.id: m.http for m in self.cluster.members if m.alive(ttl) and m.http}
        if self.cluster.http:
            out[self.gateway] = self.cluster.http
        return sorted(out.items())

    def orphans(self) -> list[Liveness]:
        """Offline nodes of dead gateways, when this gateway leads (else none)."""
        if self.cluster is None or not self.cluster.leader:
            return []
        here = {live.name for live in self.registry.liveness()}
        return [Liveness(e.node, "offline", e.last_seen, None) for e in self.cluster.orphans(here)]

    @property
    def where(self) -> str:
        if self.cluster is not None:
            return f"PostgreSQL, gateway {self.gateway}"
        path = getattr(self.directory, "path", None)
        return f"SQLite file {path}" if path is not None else "memory only"

    async def start(self) -> None:
        """Open the directory; DirectoryError stops the gateway at start (a cluster
        member without its cluster, or an inventory file it cannot use)."""
        if self.cluster is not None:
            await self.cluster.start()
            self.inventory = dict(self.cluster.entries)
        elif self.directory is not None:
            entries = await self.directory.open()
            self.inventory = {e.node: e for e in entries}
        log.info("node directory: %s, %d node(s) known", self.where, len(self.inventory))

    async def stop(self) -> None:
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
        if self.cluster is not None:
            await self.cluster.stop()
        elif self.directory is not None:
            await self.directory.close()

    # -- Admission (the SSH server) ---------------------------------------------------------

    async def admit(
        self, node: str, hello: Hello, remote: str, cert: SSHOpenSSHCertificate | None
    ) -> int:
        expires, serial = expiry_of(cert) if cert is not None else (None, None)
        facts = NodeFacts.from_hello(
            hello, cert_serial=serial, remote=remote, cert_valid_before=expires
        )
        if self.cluster is not None:
            if self._held is not None and self._held(node, self._clock()):
                raise AdmissionRefused(  # what the claim would cost the whole cluster
                    f"node {node} is refused for now after two connections used its "
                    "certificate (ssh.duplicate_connection = refuse_both)"
                )
            try:
                return await self.cluster.claim(node, facts)
            except ClaimRefused as exc:
                raise AdmissionRefused(str(exc)) from exc
        if self.directory is None:
            return 0
        try:
            claim = await self.directory.claim(node, facts, now=self._clock())
        except DirectoryError as exc:
            self.errors["claim"] += 1
            log.warning("node %s admitted, but not recorded in the inventory: %s", node, exc)
            return 0
        return claim.epoch

    def departed(self, node: str, epoch: int, reason: str) -> None:
        if self.cluster is not None:
            self.cluster.release(node, epoch, reason)
        elif self.directory is not None and epoch:
            self._background(self._release(self.directory, node, epoch, reason))

    async def _release(self, directory: Directory, node: str, epoch: int, reason: str) -> None:
        try:
            await directory.release(node, epoch, reason=reason, now=self._clock())
        except DirectoryError as exc:
            self.errors["release"] += 1
            log.warning("could not record in the inventory that node %s left: %s", node, exc)

    # -- the tick ---------------------------------------------------------------------------

    async def tick(self, monotonic: float) -> None:
        """On the gateway's tick: last-seen times, and the cluster's heartbeat, when due."""
        if monotonic < self._next_beat:
            return
        period = self.cfg.heartbeat_seconds if self.cluster is not None else SEEN_SECONDS
        self._next_beat = monotonic + period
        seen = {
            v.name: v.last_seen
            for v in self.registry.nodes(self._clock())
            if v.state != "offline" and v.last_seen is not None
        }
        if self.cluster is not None:
            for node, when in seen.items():
                self.cluster.seen(node, when)
            if self.endpoints is not None:
                endpoints = self.endpoints
                await self.cluster.publish(
                    {n: tuple(e.target for e in endpoints.published_via(n)) for n in seen}
                )
            await self.cluster.tick()
        elif self.directory is not None:
            try:
                await self.directory.seen(seen)
            except DirectoryError as exc:
                self.errors["seen"] += 1
                log.warning("could not write last-seen times to the inventory: %s", exc)

    # -- what the other gateways did --------------------------------------------------------

    def _lost(self, node: str, owner: str) -> None:
        """Another gateway claimed ``node``: let its connection here go (if any), and its
        series and state leave this gateway's /metrics at once."""
        if self.registry.node(node, now=self._clock()) is None:
            return  # never here: nothing to do (claims of the whole fleet pass by)
        self._let_go(f"node {node} is now on gateway {owner}", node)
        self.registry.forget(node)
        if self._forgotten is not None:
            self._forgotten([node])

    def _shed(self, nodes: list[str]) -> None:
        """Above the fair share: GOODBYE to these nodes' agents (they come back through
        the balancer, most onto a lighter gateway; the claim there drops them here)."""
        for node in nodes:
            self._let_go(f"gateway {self.gateway} is above its fair share of nodes", node)

    def _fenced(self, reason: str) -> None:
        count = self._let_go(reason, None)
        names = [view.name for view in self.registry.nodes(self._clock())]
        for name in names:
            self.registry.forget(name)
        if self._forgotten is not None and names:
            self._forgotten(names)
        log.error("fenced: let %d agent(s) go", count)

    # -- the fleet view ---------------------------------------------------------------------

    def owner(self, node: str) -> tuple[str, str] | None:
        """(gateway id, peer address) of the live gateway that owns ``node``, when it is
        not this one (the proxy's peer route)."""
        if self.cluster is None or node in self.cluster.owned:
            return None
        member = self.cluster.owner_of(node)
        if member is None or member.id == self.gateway:
            return None
        return member.id, member.advertise

    def elsewhere(self) -> list[tuple[NodeEntry, Member | None]]:
        """Nodes of the fleet not in this gateway's registry, with their owner when it is
        alive (the cluster), or the inventory's offline nodes (one gateway)."""
        local = self.registry.published_states()  # names held here (nothing worked out)
        if self.cluster is None:
            return [(e, None) for n, e in sorted(self.inventory.items()) if n not in local]
        members = {m.id: m for m in self.cluster.members}
        out: list[tuple[NodeEntry, Member | None]] = []
        for name, entry in sorted(self.cluster.entries.items()):
            if name in local:
                continue
            member = members.get(entry.gateway)
            alive = member is not None and member.alive(self.cfg.ttl_seconds)
            out.append((entry, member if alive else None))
        return out

    def stored_certificates(self) -> dict[str, Stored]:
        """(valid_before, serial) of the inventory's nodes not held here, for one gateway
        (with several, each publishes the certificates of the nodes it holds)."""
        if self.cluster is not None:
            return {}
        return {
            e.node: (e.facts.cert_valid_before, e.facts.cert_serial) for e, _ in self.elsewhere()
        }

    def members(self) -> list[Member]:
        return list(self.cluster.members) if self.cluster is not None else []

    def _background(self, coro: object) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
