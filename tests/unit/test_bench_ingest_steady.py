"""bench/ingest_steady.py: how bench/gateway_ingest.py spreads its agents over worker
processes and when it calls a run a valid steady state."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import pytest

from bench import gateway_ingest
from bench.ingest_steady import (
    RunFacts,
    default_procs,
    first_send,
    machine_jiffies,
    shares,
    steady_state_problems,
    verdict,
)


@pytest.mark.parametrize(
    ("nodes", "procs"), [(1, 1), (200, 1), (201, 1), (251, 2), (1000, 4), (1001, 5)]
)
def test_one_process_up_to_200_nodes_then_one_per_250(nodes: int, procs: int) -> None:
    assert default_procs(nodes) == procs


def test_shares_cover_every_node_once_in_order_and_differ_by_at_most_one() -> None:
    parts = shares(1001, 4)
    assert [len(p) for p in parts] == [251, 250, 250, 250]
    assert [k for p in parts for k in p] == list(range(1001))


def test_never_more_workers_than_nodes() -> None:
    assert shares(3, 8) == [range(0, 1), range(1, 2), range(2, 3)]
    assert shares(5, 0) == [range(0, 5)]


STEADY = RunFacts(
    nodes=100,
    interval=1.0,
    wall=10.0,
    gateway_batches=1001,
    connects=100,
    silent_closed=0,
    replaced=0,
    worker_cores=(0.1,),
    late_p95=0.002,
    machine_busy=0.6,
    consistent=True,
)


def test_a_run_that_kept_its_rate_is_valid() -> None:
    assert steady_state_problems(STEADY) == []
    assert verdict([]) == "steady state: VALID"


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"gateway_batches": 950}, "95.0% of the 1000 offered"),
        ({"gateway_batches": 1040}, "104.0% of the 1000 offered"),
        ({"connects": 134}, "134 connects for 100 nodes"),
        ({"silent_closed": 3}, "closed 3 connections as silent"),
        ({"replaced": 1}, "replaced 1 connections"),
        ({"worker_cores": (0.2, 0.97)}, "1 agents' process(es) saturated (up to 97%"),
        ({"late_p95": 0.25}, "250 ms behind schedule"),
        ({"machine_busy": 0.99}, "99% busy"),
        ({"consistent": False}, "counts disagree"),
    ],
)
def test_each_way_a_run_is_not_a_steady_state_is_named(change: dict[str, Any], words: str) -> None:
    problems = steady_state_problems(dataclasses.replace(STEADY, **change))
    assert len(problems) == 1
    assert words in problems[0]
    assert verdict(problems).startswith("steady state: NOT A STEADY STATE: ")


def test_rate_within_three_percent_is_steady() -> None:
    assert steady_state_problems(dataclasses.replace(STEADY, gateway_batches=971)) == []
    assert steady_state_problems(dataclasses.replace(STEADY, gateway_batches=1029)) == []


def test_machine_jiffies_count_idle_and_iowait_as_not_busy() -> None:
    stat = "cpu  100 5 50 800 40 3 2 0 0 0\ncpu0 50 2 25 400 20 1 1 0 0 0\n"
    assert machine_jiffies(stat) == (160, 1000)


def test_first_batches_spread_over_the_ramp_keep_the_even_phases() -> None:
    starts = [first_send(i, 1000, 20) for i in range(1000)]
    assert starts == sorted(starts)
    assert [sum(1 for s in starts if k <= s < k + 1) for k in range(21)] == [50] * 20 + [0]
    phases = sorted(s % 1 for s in starts)
    assert phases == pytest.approx([i / 1000 for i in range(1000)])
    assert [first_send(i, 4, 1) for i in range(4)] == [0, 0.25, 0.5, 0.75]


@pytest.mark.parametrize(("nodes", "interval"), [(100, 1.0), (1000, 1.0), (1000, 10.0)])
def test_the_benchs_gateway_keeps_idle_nodes_until_their_first_batch(
    nodes: int, interval: float
) -> None:
    """Connected and not sending is silence to the gateway: with the default 6 intervals
    + 2 s (8 s at 1 s), the nodes whose first batch came last were closed (112-135
    connects for 100 nodes). The last node's first batch comes at most the connect phase
    + the idle window + the ramp + one interval after its HELLO."""
    args = argparse.Namespace(nodes=nodes, interval=interval, idle_seconds=20.0, ramp=None)
    args.ramp = nodes / gateway_ingest.FIRST_BATCHES_PER_SECOND
    last_first_batch = gateway_ingest.CONNECT_TIMEOUT + 20.0 + args.ramp + interval
    assert gateway_ingest.offline_intervals(args) * interval > last_first_batch
    ramp = gateway_ingest.ramp_intervals(args)
    assert first_send(nodes - 1, nodes, ramp) * interval <= args.ramp + interval
