"""A node in a reconnect loop costs the directory at most CLAIMS_PER_NODE claims per
CLAIM_WINDOW_SECONDS on one gateway (cloud_gateway.cluster.membership.ClaimBudget); beyond that the
claim is refused with a message saying why (ERROR unavailable to the agent, which backs
off), and no transaction is made. A node held by ssh.duplicate_connection = refuse_both
(cloud_gateway.ssh.conflicts) costs no claim at all. Against a real PostgreSQL."""

from __future__ import annotations

import pytest

from cloud_gateway.cluster.admission import AdmissionRefused
from cloud_gateway.cluster.config import ClusterConfig
from cloud_gateway.cluster.link import DirectoryLink
from cloud_gateway.cluster.membership import CLAIM_WINDOW_SECONDS, CLAIMS_PER_NODE, ClaimRefused
from cloud_gateway.registry.store import Registry
from gpurelay.wire import Hello
from tests.integration.test_cluster_membership import FACTS, Member


@pytest.fixture
def dsn(pg_database: str) -> str:
    return pg_database


async def test_a_reconnect_loop_is_refused_beyond_the_budget(dsn: str) -> None:
    a = Member(dsn, "gw-a")
    await a.cluster.start()
    try:
        epochs = [await a.cluster.claim("edge-loop", FACTS) for _ in range(CLAIMS_PER_NODE)]
        assert epochs == list(range(1, CLAIMS_PER_NODE + 1))
        for _ in range(3 * CLAIMS_PER_NODE):  # the loop goes on: no claim reaches the directory
            with pytest.raises(ClaimRefused) as info:
                await a.cluster.claim("edge-loop", FACTS)
        assert str(info.value) == (
            f"node edge-loop connected {CLAIMS_PER_NODE} times in {CLAIM_WINDOW_SECONDS:g}s "
            f"to gateway gw-a: refused for {CLAIM_WINDOW_SECONDS:.0f}s more (a reconnect "
            "loop; check this agent's link and log)"
        )
        [entry] = [e for e in await a.cluster.directory.entries() if e.node == "edge-loop"]
        assert entry.epoch == CLAIMS_PER_NODE
        assert a.cluster.stats.claims == CLAIMS_PER_NODE
        assert a.cluster.stats.claims_throttled == 3 * CLAIMS_PER_NODE
        assert await a.cluster.claim("edge-other", FACTS) == 1  # other nodes go on
        # a window later (the heartbeat prunes the budget) the node is claimed again
        a.clock.t += CLAIM_WINDOW_SECONDS
        await a.cluster.tick()
        assert len(a.cluster.budget) == 0
        assert await a.cluster.claim("edge-loop", FACTS) == CLAIMS_PER_NODE + 1
    finally:
        await a.cluster.stop()


async def test_a_node_held_by_the_conflict_policy_costs_no_claim(dsn: str) -> None:
    held: set[str] = {"edge-stolen"}
    cfg = ClusterConfig(
        database=dsn, gateway_id="gw-a", peer_listen="127.0.0.1:0", ttl_seconds=10.0
    )
    link = DirectoryLink(
        cfg,
        Registry(),
        environ={},
        let_go=lambda reason, node: 0,
        held=lambda node, now: node in held,
    )
    await link.start()
    try:
        hello = Hello(agent_version="1.0", node="edge-stolen", hostname="h", backend="simulated")
        with pytest.raises(AdmissionRefused, match="refuse_both"):
            await link.admit("edge-stolen", hello, "192.0.2.1:5000", None)
        assert link.cluster is not None
        assert await link.cluster.directory.entries() == []
        held.clear()
        assert await link.admit("edge-stolen", hello, "192.0.2.1:5000", None) == 1
    finally:
        await link.stop()
