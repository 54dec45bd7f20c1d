"""cloud_gateway.cluster.membership.ClaimBudget: at most ``limit`` claims of one node per window."""

from __future__ import annotations

from cloud_gateway.cluster.membership import CLAIM_WINDOW_SECONDS, CLAIMS_PER_NODE, ClaimBudget


def test_claims_beyond_the_limit_wait_for_the_oldest_to_leave_the_window() -> None:
    budget = ClaimBudget(limit=3, window=60.0)
    assert [budget.take("edge-1", t) for t in (0.0, 1.0, 2.0)] == [0.0, 0.0, 0.0]
    assert budget.take("edge-1", 3.0) == 57.0  # until the claim at 0 is 60 s old
    assert budget.take("edge-2", 3.0) == 0.0  # per node
    assert budget.take("edge-1", 59.9) > 0
    assert budget.take("edge-1", 60.0) == 0.0  # the claim at 0 left the window
    assert budget.take("edge-1", 60.5) > 0  # 1, 2 and 60 are in it


def test_refusals_do_not_count_and_idle_nodes_are_forgotten() -> None:
    budget = ClaimBudget(limit=2, window=10.0)
    budget.take("edge-1", 0.0)
    budget.take("edge-1", 0.0)
    for t in range(1, 10):  # a loop hammering on: refused, and never longer than the window
        assert 0 < budget.take("edge-1", float(t)) <= 10.0
    assert budget.take("edge-1", 10.0) == 0.0
    budget.take("edge-2", 5.0)
    budget.prune(14.9)
    assert len(budget) == 2
    budget.prune(15.0)  # edge-2's only claim is 10 s old
    assert len(budget) == 1
    budget.prune(20.0)
    assert len(budget) == 0


def test_the_defaults_leave_room_for_an_ordinary_flapping_link() -> None:
    """An agent's backoff after failed sessions (1, 2, 4, ... s at most, the default
    backoff_initial_seconds of 1 s) reconnects far fewer times a window than the limit."""
    budget = ClaimBudget()
    t, delay = 0.0, 1.0
    while t < 10 * CLAIM_WINDOW_SECONDS:
        assert budget.take("edge-1", t) == 0.0
        t, delay = t + delay, min(delay * 2, 60.0)
    assert CLAIMS_PER_NODE >= 10
