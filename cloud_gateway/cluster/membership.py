"""One gateway's membership of a cluster: claims, heartbeats, fencing, the fleet view.

Several gateways share a PostgreSQL directory (:mod:`cloud_gateway.cluster.store_pg`). This
module is what a gateway does with it; the connections themselves stay with ingest, which
asks :meth:`Cluster.claim` before it accepts a node and is told through ``on_lost`` when
another gateway claimed one of its nodes (close that connection, drop its series at once).

Rules, each with the reason for it:

- **Newer connection wins, across gateways.** A claim bumps the node's epoch whoever
  owned it; the previous owner hears it by NOTIFY and lets the node go. Late writes from
  the loser are compare-and-set on its epoch, so they change nothing.
- **No claim without the directory.** When PostgreSQL cannot be reached a claim fails with
  :class:`ClaimRefused` (a clear error to the agent, which retries, maybe through the
  balancer onto a gateway that can reach it). Nodes already owned keep flowing.
- **Self-fencing before the others give up on us.** The other members treat a gateway
  whose heartbeat is ``ttl`` old (by the database's clock) as gone, and may then take its
  nodes. So a gateway that has not completed a heartbeat for ``ttl - heartbeat`` (by its
  own clock, counted from when it *sent* the last successful one) lets all its nodes go
  (``on_fenced``: GOODBYE to its agents) before that can happen: no node is owned twice.
  A later successful heartbeat ends the fence and claims are accepted again (healing).
- **Last-seen in batches**: :meth:`seen` only records; each heartbeat writes them all.
- **The fleet view** (every gateway answers for every node): the directory's entries
  and members, re-read every ``refresh_seconds`` and on every claim NOTIFY.
- **One leader** (a PostgreSQL advisory lock, tried on every heartbeat) answers for the
  nodes of dead gateways in /metrics (``gpurelay_node_up 0``, offline): every node is in
  the union of the gateways' bodies once. A gateway that cannot heartbeat steps down.
- **A restart lets go**: a gateway that (re)starts releases the directory's entries that
  still name it (an earlier run's, same id) to nobody once it holds the id (joined),
  before it accepts agents, so the leader answers for them; the leader deletes gateways
  silent for ``forget_after_seconds``.
- **One process per id** (:mod:`cloud_gateway.cluster.join`): a start under the id of a
  live gateway is refused before it releases anything; a running gateway whose row
  another process took (both started at once, an operator forcing) fences itself and
  counts it (``duplicate_ids``) rather than both claiming the same nodes under one name.
- **Fair share** (:func:`to_shed`): a gateway holding more than its share of the nodes
  lets a few agents go per second, so a gateway that joins fills up without a storm;
  none while another's heartbeat is late (killed, it is alive for a ttl: its agents come)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Container
from dataclasses import dataclass, field

from cloud_gateway.cluster.directory import DirectoryError, NodeEntry, NodeFacts
from cloud_gateway.cluster.join import conflict, join
from cloud_gateway.cluster.limits import (
    CLAIM_WINDOW_SECONDS,
    CLAIMS_PER_NODE,
    SHED_PER_SECOND,
    SHED_SLACK,
    ClaimBudget,
    to_shed,
)
from cloud_gateway.cluster.members import DuplicateGateway
from cloud_gateway.cluster.store_pg import Member, PostgresDirectory
from cloud_gateway.listener import CLOSE_REASONS, ConnectionStats
from cloud_gateway.metrics import FamilySamples, fixed, one

# importable from here, where they were defined before cluster_limits
__all__ = [
    "CLAIMS_PER_NODE",
    "CLAIM_WINDOW_SECONDS",
    "SHED_PER_SECOND",
    "SHED_SLACK",
    "ClaimBudget",
    "ClaimRefused",
    "Cluster",
    "ClusterStats",
    "to_shed",
]

log = logging.getLogger("cloud_gateway.cluster")


class ClaimRefused(Exception):
    """This gateway cannot take the node now (the message says why, for the agent)."""


@dataclass
class ClusterStats:
    claims: int = 0
    claims_throttled: int = 0  # refused: the node's claims beyond CLAIMS_PER_NODE a window
    lost_claims: int = 0  # nodes another gateway claimed from this one
    fencing_events: int = 0  # cut off from the directory
    duplicate_ids: int = 0  # another process took this gateway id's row (fenced then)
    directory_errors: Counter[str] = field(default_factory=Counter)  # by operation


class Cluster:
    def __init__(
        self,
        directory: PostgresDirectory,
        *,
        advertise: str,
        heartbeat_seconds: float,
        ttl_seconds: float,
        on_lost: Callable[[str, str], None],
        on_fenced: Callable[[str], None],
        on_shed: Callable[[list[str]], None] | None = None,
        refresh_seconds: float = 30.0,
        forget_after_seconds: float = 86400.0,
        monotonic: Callable[[], float] = time.monotonic,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.directory = directory
        self.gateway = directory.gateway
        self.advertise = advertise
        self.heartbeat_seconds = heartbeat_seconds
        self.ttl_seconds = ttl_seconds
        self.refresh_seconds = refresh_seconds
        self.forget_after_seconds = forget_after_seconds
        self._on_lost = on_lost
        self._on_fenced = on_fenced
        self._on_shed = on_shed
        self._monotonic = monotonic
        self._clock = clock
        self.stats = ClusterStats()
        self.owned: dict[str, int] = {}  # node -> the epoch of this gateway's claim
        self.entries: dict[str, NodeEntry] = {}  # the fleet, as last read
        self.members: list[Member] = []
        self.fenced = False
        self.duplicate: DuplicateGateway | None = None  # another process holds the id
        self.leader = False
        self.http = ""  # host:port of this gateway's /metrics, for the others' http_sd
        self._over = 0  # heartbeats in a row above the fair share
        # the fleet's size at the last heartbeats (a ttl's worth): the largest is its size
        # while agents are between a GOODBYE and their claim elsewhere, counted nowhere
        self._totals: deque[int] = deque(maxlen=max(2, round(ttl_seconds / heartbeat_seconds)))
        self._last_ok_sent: float | None = None  # when the last successful heartbeat left
        self._seen: dict[str, float] = {}
        self._heard: dict[str, tuple[int, str]] = {}  # node -> newest (epoch, owner) notified
        self._published: dict[str, tuple[str, ...]] = {}  # as last written, owned nodes
        self.via: dict[str, str] = {}  # a published endpoint's name -> its tunnel node
        self._last_refresh = -float("inf")
        # NOTIFYs heard, and how many when the last fleet read began (test_cluster_refresh)
        self._notices = self._notices_read = 0
        self._pending: set[asyncio.Task[None]] = set()
        self.budget = ClaimBudget()
        self._throttled: set[str] = set()  # nodes refused in this window (logged once)
        directory.on_claim = self._notified

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the directory and announce this gateway; DirectoryError when it cannot
        (the gateway does not start without its cluster)."""
        await self.directory.open(release=False)
        await join(  # this id's row, or DuplicateGateway (before anything is released)
            self.directory,
            advertise=self.advertise,
            ttl=self.ttl_seconds,
            poll=self.heartbeat_seconds / 2,
        )
        entries = await self.directory.release_earlier()  # now that the id is this one's
        self.entries = {e.node: e for e in entries}
        sent = self._monotonic()
        self.members = await self.directory.heartbeat(
            advertise=self.advertise, nodes=0, started=True
        )
        self._last_ok_sent = sent
        self._last_refresh = sent
        log.info(
            "cluster: gateway %s joined, %d member(s), %d node(s) in the directory",
            self.gateway,
            len(self.members),
            len(self.entries),
        )
        if self.directory.released:
            log.info(
                "cluster: gateway %s restarted: released %d node(s) its earlier run held",
                self.gateway,
                len(self.directory.released),
            )

    async def stop(self) -> None:
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
        if self._last_ok_sent is not None:  # joined: the next run of the id need not wait
            try:
                await self.directory.leave()
            except DirectoryError as exc:
                log.warning("cluster: could not clear this gateway's row: %s", exc)
        await self.directory.close()

    # -- claims -----------------------------------------------------------------------------

    async def claim(self, node: str, facts: NodeFacts) -> int:
        """Own ``node`` (its new epoch), or ClaimRefused."""
        if self.fenced:
            why = (
                f"another gateway runs with id {self.gateway}"
                if self.duplicate is not None
                else f"gateway {self.gateway} cannot reach the node directory"
            )
            raise ClaimRefused(f"{why} (fenced); try again, or another gateway")
        wait = self.budget.take(node, self._monotonic())
        if wait:
            self.stats.claims_throttled += 1
            if node not in self._throttled:  # once per episode: a loop would flood the log
                self._throttled.add(node)
                log.warning(
                    "cluster: node %s connected %d times in %gs: its claims are refused for "
                    "%.0fs (a reconnect loop; each claim is a directory transaction)",
                    node,
                    self.budget.limit,
                    self.budget.window,
                    wait,
                )
            raise ClaimRefused(
                f"node {node} connected {self.budget.limit} times in {self.budget.window:g}s "
                f"to gateway {self.gateway}: refused for {wait:.0f}s more (a reconnect loop; "
                "check this agent's link and log)"
            )
        self._throttled.discard(node)
        try:
            claim = await self.directory.claim(node, facts, now=self._clock())
        except DirectoryError as exc:
            self.stats.directory_errors["claim"] += 1
            log.warning("cluster: node %s refused, the directory is unavailable: %s", node, exc)
            raise ClaimRefused(
                f"gateway {self.gateway} cannot record the claim in the node directory; "
                "try again, or another gateway"
            ) from exc
        self.stats.claims += 1
        newer = self._heard.get(node)
        if newer is not None and newer[0] > claim.epoch:  # claimed again while we waited
            raise ClaimRefused(f"node {node} was claimed by gateway {newer[1]} meanwhile")
        self.owned[node] = claim.epoch
        if claim.previous_gateway is not None:
            log.info(
                "cluster: node %s claimed from gateway %s (epoch %d)",
                node,
                claim.previous_gateway,
                claim.epoch,
            )
        return claim.epoch

    def release(self, node: str, epoch: int, reason: str) -> None:
        """The node's connection on this gateway ended (written in the background)."""
        if self.owned.get(node) == epoch:
            del self.owned[node]
        self._seen.pop(node, None)
        self._background(self._release(node, epoch, reason))

    async def _release(self, node: str, epoch: int, reason: str) -> None:
        try:
            await self.directory.release(node, epoch, reason=reason, now=self._clock())
        except DirectoryError as exc:
            self.stats.directory_errors["release"] += 1
            log.warning("cluster: could not record that node %s left: %s", node, exc)

    def seen(self, node: str, when: float) -> None:
        if node in self.owned:
            self._seen[node] = when

    def _notified(self, node: str, gateway: str, epoch: int) -> None:
        """A claim anywhere in the cluster (our own too)."""
        if epoch > self._heard.get(node, (0, ""))[0]:
            self._heard[node] = (epoch, gateway)
        self._lose_if_newer(node, gateway, epoch)
        self._notices += 1  # re-read the fleet at the next tick

    def _lose_if_newer(self, node: str, gateway: str, epoch: int) -> None:
        """Another gateway claimed ``node``: ``on_lost`` whether this one owns it now or
        only remembers it (offline here: its series and state must leave this gateway's
        /metrics too)."""
        if gateway in (self.gateway, ""):  # "": a release to nobody, not a claim
            return
        mine = self.owned.get(node)
        if mine is not None:
            if epoch <= mine:
                return
            del self.owned[node]
            self._seen.pop(node, None)
            self.stats.lost_claims += 1
            log.info("cluster: node %s moved to gateway %s (epoch %d)", node, gateway, epoch)
        self._on_lost(node, gateway)

    # -- heartbeat, fencing, fleet view -----------------------------------------------------

    async def tick(self) -> None:
        """Every ``heartbeat_seconds``: heartbeat with last-seen times, fence or heal,
        refresh the fleet view when due."""
        sent = self._monotonic()
        self.budget.prune(sent)
        seen, self._seen = self._seen, {}
        try:
            self.members = await self.directory.heartbeat(
                advertise=self.advertise, nodes=len(self.owned), http=self.http, seen=seen
            )
        except DuplicateGateway as exc:
            self._step_down()
            self._duplicated(exc)
            return
        except DirectoryError as exc:
            for node, when in seen.items():  # keep them for the next try
                self._seen.setdefault(node, when)
            self.stats.directory_errors["heartbeat"] += 1
            self._step_down()
            self._check_fence(exc)
            return
        self._last_ok_sent = sent
        if self.fenced:
            back = "holds its id again" if self.duplicate else "reaches the directory again"
            self.fenced, self.duplicate = False, None
            log.warning("cluster: gateway %s %s; claims resume", self.gateway, back)
        try:
            if await self.directory.ensure_listening():
                self._last_refresh = -float("inf")  # claims may have gone unheard
        except DirectoryError as exc:
            self.stats.directory_errors["listen"] += 1
            log.warning("cluster: cannot listen for claims: %s", exc)
        await self._lead()
        self._shed()
        if self._notices != self._notices_read or sent - self._last_refresh >= self.refresh_seconds:
            await self._forget()
            await self._refresh(sent)

    async def _forget(self) -> None:
        """The leader deletes the members silent for ``forget_after_seconds`` (each
        replaced Kubernetes pod adds one); their nodes name no gateway any more, and stay
        in the fleet, offline, answered for by the leader, until their agents return."""
        if not self.leader or not any(
            m.heartbeat_age >= self.forget_after_seconds for m in self.members
        ):
            return
        try:
            forgotten = await self.directory.forget_gateways(self.forget_after_seconds)
        except DirectoryError as exc:
            self.stats.directory_errors["forget"] += 1
            log.warning("cluster: could not forget dead gateways: %s", exc)
            return
        if forgotten:
            log.info(
                "cluster: forgot %d gateway(s) silent for %gs or more: %s",
                len(forgotten),
                self.forget_after_seconds,
                ", ".join(forgotten),
            )

    def _shed(self) -> None:
        """Above the fair share (by the members' last heartbeats): let a few nodes go
        (GOODBYE: their agents reconnect through the balancer, onto a lighter gateway)."""
        if self._on_shed is None:
            return
        live = [m for m in self.members if m.alive(self.ttl_seconds)]
        others = [m.nodes for m in live if m.id != self.gateway]
        self._totals.append(sum(others) + len(self.owned))
        if any(m.heartbeat_age > 2 * self.heartbeat_seconds for m in live if m.id != self.gateway):
            self._over = 0  # one is late (killed?): its agents come here, none go to it
            return
        total = max(self._totals)  # not below the share for the agents in flight
        per_tick = max(1, round(SHED_PER_SECOND * self.heartbeat_seconds))
        count = to_shed(
            len(self.owned), total, len(live), per_tick=per_tick, lightest=min(others, default=None)
        )
        self._over = self._over + 1 if count else 0
        if self._over >= 2:  # two heartbeats in a row: not the others' counts lagging
            nodes = list(self.owned)[:count]  # the longest held (claim order): not newcomers
            log.info(
                "cluster: gateway %s holds %d of %d node(s) on %d gateway(s): letting %d go",
                self.gateway,
                len(self.owned),
                total,
                len(live),
                count,
            )
            self._on_shed(nodes)

    async def _lead(self) -> None:
        try:
            leader = await self.directory.lead()
        except DirectoryError as exc:
            self.stats.directory_errors["leader"] += 1
            log.warning("cluster: leader lock: %s", exc)
            leader = False
        if leader != self.leader:
            self.leader = leader
            log.info("cluster: gateway %s %s", self.gateway, "leads" if leader else "stepped down")
            if leader:  # answer for the dead gateways' nodes from a fresh fleet view
                self._last_refresh = -float("inf")

    def _step_down(self) -> None:
        if self.leader:
            log.warning("cluster: gateway %s steps down as leader", self.gateway)
        self.leader = False
        self.directory.step_down()

    def orphans(self, here: Container[str]) -> list[NodeEntry]:
        """The leader's share of /metrics: nodes of the directory not ``here`` whose
        owner is not a live member (none when this gateway does not lead)."""
        if not self.leader:
            return []
        alive = {m.id for m in self.members if m.alive(self.ttl_seconds)}
        heard = self._heard
        return [
            e
            for name, e in sorted(self.entries.items())
            if name not in here
            and name not in self.owned
            and e.gateway not in alive
            and heard.get(name, (0, ""))[0] <= e.epoch  # not claimed since (NOTIFY)
        ]

    def _check_fence(self, exc: DirectoryError) -> None:
        last = self._last_ok_sent
        silent = float("inf") if last is None else self._monotonic() - last
        limit = self.ttl_seconds - self.heartbeat_seconds
        if self.fenced or silent < limit:
            log.warning(
                "cluster: heartbeat failed (%.1fs since the last one, fencing at %.1fs): %s",
                silent,
                limit,
                exc,
            )
            return
        self.stats.fencing_events += 1
        self._fence(
            f"gateway {self.gateway} lost the node directory for {silent:.0f}s "
            f"(ttl {self.ttl_seconds:g}s): letting its {len(self.owned)} node(s) go"
        )

    def _duplicated(self, exc: DuplicateGateway) -> None:
        """Another process holds this id's row: fence at once (both would claim the same
        nodes under one name), said and counted once per episode."""
        if self.duplicate is not None:
            return
        self.duplicate = exc
        self.stats.duplicate_ids += 1
        self._fence(
            conflict(
                self.gateway,
                instance=self.directory.instance,
                advertise=self.advertise,
                holder=exc.holder,
                nodes=len(self.owned),
            )
        )

    def _fence(self, reason: str) -> None:
        self.fenced = True
        self.owned.clear()
        self._seen.clear()
        log.error("cluster: %s", reason)
        self._on_fenced(reason)

    async def _refresh(self, now: float) -> None:
        asked = self._notices  # a NOTIFY heard from here on may be newer than the read
        try:
            entries = await self.directory.entries()
        except DirectoryError as exc:
            self.stats.directory_errors["entries"] += 1
            log.warning("cluster: could not read the fleet from the directory: %s", exc)
            return
        self.entries = {e.node: e for e in entries}
        self._last_refresh, self._notices_read = now, asked
        self.via = {
            target.rpartition(":")[0]: e.node
            for e in entries
            if e.connected
            for target in e.published
        }
        for node in list(self.owned):  # a claim we did not hear of (listener down)
            entry = self.entries.get(node)
            if entry is not None:
                self._lose_if_newer(node, entry.gateway, entry.epoch)

    async def publish(self, published: dict[str, tuple[str, ...]]) -> None:
        """Owned nodes' published endpoints, written when they changed (on the tick)."""
        for node, targets in published.items():
            epoch = self.owned.get(node)
            if epoch is None or self._published.get(node) == targets:
                continue
            try:
                await self.directory.publish(node, epoch, targets)
            except DirectoryError as exc:
                self.stats.directory_errors["publish"] += 1
                log.warning("cluster: could not write node %s's endpoints: %s", node, exc)
                return
            self._published[node] = targets
        for node in [n for n in self._published if n not in self.owned]:
            del self._published[node]

    def owner_of(self, node: str) -> Member | None:
        """The live member that owns ``node`` by the fleet view (None: nobody alive)."""
        if node in self.owned:
            return next((m for m in self.members if m.id == self.gateway), None)
        entry = self.entries.get(node) or self.entries.get(self.via.get(node, ""))
        if entry is None or not entry.connected:
            return None
        member = next((m for m in self.members if m.id == entry.gateway), None)
        return member if member is not None and member.alive(self.ttl_seconds) else None

    def _background(self, coro: object) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)


DIRECTORY_OPERATIONS = ("claim", "release", "heartbeat", "listen", "entries", "leader")


def cluster_families(cluster: Cluster, peers: ConnectionStats | None = None) -> list[FamilySamples]:
    """The cluster's own metrics (only with ``[cluster] database``); ``peers``: the peer
    listener's connections (none before it listens)."""
    stats = cluster.stats
    members = sum(1 for m in cluster.members if m.alive(cluster.ttl_seconds))
    peers = peers or ConnectionStats()
    return [
        one("gpurelay_gateway_cluster_members", members),
        one("gpurelay_gateway_cluster_owned_nodes", len(cluster.owned)),
        one("gpurelay_gateway_cluster_claims_total", stats.claims),
        one("gpurelay_gateway_cluster_claims_throttled_total", stats.claims_throttled),
        one("gpurelay_gateway_cluster_peer_connections", peers.open),
        fixed(
            "gpurelay_gateway_cluster_peer_connections_closed_total",
            "reason",
            peers.closed,
            CLOSE_REASONS,
            zeros=True,
        ),
        one("gpurelay_gateway_cluster_lost_claims_total", stats.lost_claims),
        one("gpurelay_gateway_cluster_fencing_events_total", stats.fencing_events),
        one("gpurelay_gateway_cluster_duplicate_id_total", stats.duplicate_ids),
        fixed(
            "gpurelay_gateway_cluster_directory_errors_total",
            "operation",
            stats.directory_errors,
            DIRECTORY_OPERATIONS,
            zeros=True,
        ),
        one("gpurelay_gateway_cluster_leader", int(cluster.leader)),
        one("gpurelay_gateway_cluster_fenced", int(cluster.fenced)),
    ]
