"""Two connections with one node's certificate: the policy, and what ingest does with it."""

from __future__ import annotations

import logging

import pytest

from cloud_gateway.ingest.session import Ingest
from cloud_gateway.registry.store import Registry
from cloud_gateway.ssh.conflicts import ConflictPolicy
from gpurelay.wire import Hello, WireError

T0 = 1_790_000_000.0


def test_one_replacement_is_a_reconnect_not_a_fight() -> None:
    policy = ConflictPolicy("newest", fight_window=60)
    verdict = policy.arrive("n", current="10.0.0.1:1", new="10.0.0.1:2", now=T0)
    assert verdict.admit and verdict.close_old and not verdict.fight
    later = policy.arrive("n", current="10.0.0.1:2", new="10.0.0.1:3", now=T0 + 3600)
    assert not later.fight  # an hour apart: two ordinary reconnects


def test_replacements_in_quick_succession_are_a_fight_announced_once_per_episode() -> None:
    policy = ConflictPolicy("newest", fight_window=60)
    policy.arrive("n", current="a:1", new="b:1", now=T0)
    fights = [policy.arrive("n", current="x", new="y", now=T0 + 2 * i) for i in range(1, 6)]
    assert all(v.fight and v.admit for v in fights)
    assert [v.announce for v in fights] == [True, False, False, False, False]
    quiet = policy.arrive("n", current="x", new="y", now=T0 + 10 + 120)
    assert not quiet.fight  # the episode ended
    again = policy.arrive("n", current="x", new="y", now=T0 + 10 + 125)
    assert again.fight and again.announce  # a new episode is announced again


def test_oldest_wins_refuses_the_newcomer() -> None:
    policy = ConflictPolicy("oldest")
    verdict = policy.arrive("n", current="a:1", new="b:2", now=T0)
    assert not verdict.admit and not verdict.close_old and "oldest" in verdict.reason
    assert policy.arrive("n", current=None, new="b:2", now=T0 + 1).admit


def test_refuse_both_holds_the_node_after_a_fight() -> None:
    policy = ConflictPolicy("refuse_both", fight_window=60, hold=300)
    assert policy.arrive("n", current="a:1", new="b:2", now=T0).admit  # a reconnect
    fight = policy.arrive("n", current="b:2", new="a:3", now=T0 + 2)
    assert not fight.admit and fight.close_old and fight.fight
    assert policy.held("n", T0 + 100)
    refused = policy.arrive("n", current=None, new="a:4", now=T0 + 100)
    assert not refused.admit and "refused for 202s more" in refused.reason
    assert policy.arrive("n", current=None, new="a:5", now=T0 + 303).admit
    assert policy.arrive("m", current=None, new="c:1", now=T0 + 100).admit  # others unaffected


def test_a_bad_policy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="newest, oldest, refuse_both"):
        ConflictPolicy("random")  # type: ignore[arg-type]


class Side:
    """One client of the node: its own session on the gateway."""

    def __init__(self, ingest: Ingest, remote: str) -> None:
        self.closed: list[str] = []
        self.session = ingest.open_session("edge-a", remote, self.closed.append)

    def hello(self) -> None:
        self.session.handle(Hello(agent_version="0", node="edge-a"))


def test_a_stolen_certificate_fight_is_counted_logged_once_and_shown(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [T0]
    registry = Registry()
    ingest = Ingest(registry, clock=lambda: now[0], conflicts=ConflictPolicy("newest"))
    with caplog.at_level(logging.ERROR):
        for i in range(6):  # the real agent and the thief, taking turns every 2 s
            now[0] += 2
            Side(ingest, f"10.0.0.{1 + i % 2}:{5000 + i}").hello()
    assert ingest.stats.replaced_connections == 5 and ingest.stats.connection_conflicts == 4
    view = registry.node("edge-a", now=now[0])
    assert view is not None and view.connection_conflicts == 4
    assert any("two connections use" in e.message for e in view.recent_errors)
    announced = [r for r in caplog.records if "two connections use" in r.getMessage()]
    assert len(announced) == 1 and "10.0.0.1" in announced[0].getMessage()


def test_refuse_both_closes_the_live_one_and_refuses_the_newcomer() -> None:
    now = [T0]
    registry = Registry()
    ingest = Ingest(registry, clock=lambda: now[0], conflicts=ConflictPolicy("refuse_both"))
    first = Side(ingest, "10.0.0.1:1")
    first.hello()
    now[0] += 1
    second = Side(ingest, "10.0.0.2:1")
    second.hello()  # a reconnect: newest wins
    assert first.closed
    now[0] += 1
    third = Side(ingest, "10.0.0.1:2")
    with pytest.raises(WireError) as err:
        third.hello()  # a fight: both out
    assert err.value.code == "conflict" and second.closed
