"""A still fleet for the truth test: one agent per machine profile (and per simulated
Jetson board), every value fixed.

:func:`running_truth_fleet` runs a real gateway and, in this process, one agent per
simulator profile (:data:`edge_agent.sim.profiles.PROFILES`), each as its own node, and
a real ``prometheus`` binary with the shipped ``deploy/prometheus/prometheus.yml`` (both
jobs: the gateway's unified ``/metrics`` and each agent's exporter through the gateway),
only its addresses, token file and intervals substituted.

Each simulator runs on a :class:`~harness.pipeline.FakeClock` (its driver loaded
:data:`LOADED_BEFORE` seconds before the agent starts, so counters have counted). The
agents collect every hour: once at start-up, then once more :data:`STEP` seconds of
simulated time later when told (:meth:`~edge_agent.app.Agent.collect_now`), as the
interval fields (GPM, NVLink rates) need two collections. From then on nothing moves:
:class:`~tests.integration.truth_source.NodeTruth` holds the simulator's answers at that
instant, and Prometheus is started only then, so it never saw other values.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from cloud_gateway.app import Gateway
from edge_agent.app import Agent
from edge_agent.catalog import load_counters
from edge_agent.config import SimulateConfig
from edge_agent.sim import host as simhost
from edge_agent.sim import nvml as simulator
from edge_agent.sim.jetson import BOARDS
from edge_agent.sim.profiles import PROFILES
from harness.fleet import (
    TOKEN,
    agent_config,
    gateway_config,
    make_pki,
    running_agent,
    running_gateway,
)
from harness.pipeline import FakeClock
from harness.prometheus import running_prometheus
from harness.waiting import wait_for
from tests.integration.test_prometheus_e2e import (
    FAST,
    GATEWAY,
    PROXIED_JOB,
    TOKEN_FILE,
    UNIFIED_JOB,
    PromQL,
    substituted,
)
from tests.integration.truth_jetson import read_board_truth
from tests.integration.truth_source import Baseline, NodeTruth, read_node

SHIPPED = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "prometheus.yml"
JOBS = (UNIFIED_JOB, PROXIED_JOB)
LOADED_BEFORE = 7200.0  # s of simulated time between driver load and the agent's start
STEP = 10.0  # s of simulated time between the two collections
INTERVAL = 3600.0  # the agents' interval: no collection but those the test asks for
SCRAPED_DEADLINE = 60.0  # Prometheus start -> both jobs scraped every node twice
Sample = tuple[str, dict[str, str], float]  # name, labels, value


# The fleet's members: one per machine profile on dcgm-exporter 4.8's names (the default),
# two more on 4.9's (docs/migration.md), and one per simulated Jetson board (issue 28):
# member -> (machine profile or board, naming scheme).
MEMBERS: dict[str, tuple[str, str]] = {
    **{profile: (profile, "4.8") for profile in PROFILES},
    "h100-sxm-dcgm49": ("h100-sxm", "4.9"),
    "h100-mig-dcgm49": ("h100-mig", "4.9"),
    **{board: (board, "4.8") for board in BOARDS},
    "jetson-orin-dcgm49": ("jetson-orin", "4.9"),
}


def node_of(member: str) -> str:
    return f"truth-{member}"


@dataclass
class Member:
    """One node: its machine profile, its agent, and what its simulator said."""

    profile: str
    node: str
    agent: Agent
    sim: simulator.SimulatedNvml | None  # None: a Jetson, whose source is its files
    clock: FakeClock
    pods: dict[int, tuple[str, str, str]]
    truth: NodeTruth | None = None
    naming: str = "4.8"  # dcgm-exporter's naming scheme the agent publishes

    @property
    def known(self) -> NodeTruth:
        assert self.truth is not None, "read after the second collection"
        return self.truth


@dataclass
class Fleet:
    gateway: Gateway
    members: dict[str, Member]  # by profile
    prometheus: PromQL
    when: float  # evaluation time: after every job scraped the still values twice
    http: httpx.AsyncClient  # for the gateway's and the agents' own endpoints

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.http_port}"


_LINE = re.compile(r"([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_ESCAPED = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


async def exposition(http: httpx.AsyncClient, url: str) -> list[Sample]:
    """The samples of a text exposition, names as written (prometheus_client's parser
    would add ``_total`` to a counter's)."""
    r = await http.get(url)
    r.raise_for_status()
    out = []
    for line in r.text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.fullmatch(line)
        assert m is not None, f"{url}: not a sample line: {line!r}"
        labels = {
            k: re.sub(r"\\.", lambda e: _ESCAPED.get(e.group(0), e.group(0)), v)
            for k, v in _LABEL.findall(m.group(2) or "")
        }
        out.append((m.group(1), labels, float(m.group(3))))
    return out


def one_job(expr: str, job: str) -> str:
    """``expr`` with every selector of a DCGM_ or gpurelay_ series limited to ``job``."""

    def limit(m: re.Match[str]) -> str:
        return f'{m.group(1)}{{job="{job}",' if m.group(2) else f'{m.group(1)}{{job="{job}"}}'

    return re.sub(r"\b((?:DCGM|gpurelay)_\w+)(\{)?", limit, expr)


@asynccontextmanager
async def running_truth_fleet(prometheus_bin: Path, tmp: Path) -> AsyncIterator[Fleet]:
    pki = make_pki(tmp)
    counters = {
        naming: frozenset(c.field for c in load_counters(None, naming) if c.kind != "label")  # type: ignore[arg-type]
        for naming in ("4.8", "4.9")
    }
    async with (
        running_gateway(gateway_config(pki)) as gw,
        AsyncExitStack() as agents,
        httpx.AsyncClient(timeout=10, trust_env=False) as http,
    ):
        members: dict[str, Member] = {}
        for seed, member in enumerate(sorted(MEMBERS), start=21):
            members[member] = await _start(agents, pki, gw, member, seed, tmp)
        await wait_for(
            lambda: (
                {m.node for m in members.values()} <= set(gw.registry.states(time.time()))
                and gw.endpoints.count() == len(members)
            ),
            what="every agent connected, its exporter published",
        )
        # The previous collection's instant, for the fields measured over an interval.
        baselines = {p: Baseline.take(m.sim) for p, m in members.items() if m.sim is not None}
        for m in members.values():
            m.clock.advance(STEP)
        await asyncio.gather(*(_collect_again(m) for m in members.values()))
        for p, m in members.items():
            if m.sim is None:  # a Jetson: what its board's files say
                uuid = m.agent.published.snapshot.gpus[0].uuid  # type: ignore[union-attr]
                m.truth = read_board_truth(
                    m.profile, node=m.node, uuid=uuid, pods=m.pods, naming=m.naming
                )
                continue
            m.truth = read_node(
                m.sim, baselines[p], node=m.node, counters=counters[m.naming], pods=m.pods
            )
        gateway_url = f"http://127.0.0.1:{gw.http_port}"

        async def pushed() -> bool:
            got = await exposition(http, f"{gateway_url}/metrics")
            done = {
                labels.get("Hostname")
                for name, labels, value in got
                if name == "gpurelay_agent_collections_total" and value == 2
            }
            return {m.node for m in members.values()} <= done

        await wait_for(pushed, what="the second collection of every node on the gateway")
        async with _prometheus(prometheus_bin, tmp, gw, members) as prom:
            yield Fleet(gw, members, prom, time.time(), http)


async def _start(
    agents: AsyncExitStack, pki: Any, gw: Gateway, member: str, seed: int, tmp: Path
) -> Member:
    """An agent of ``profile`` whose simulator runs on a clock of our own; the simulator
    and the fake host's pods are caught as the agent builds them."""
    made: list[tuple[simulator.SimulatedNvml, FakeClock]] = []
    hosts: list[simhost.FakeHost] = []
    real_simulator, real_build = simulator.SimulatedNvml, simhost.build

    def simulated(*args: Any, **kwargs: Any) -> simulator.SimulatedNvml:
        clock = FakeClock()
        sim = real_simulator(*args, clock=clock, **kwargs)
        clock.advance(LOADED_BEFORE)  # driver loaded earlier: counters have counted
        made.append((sim, clock))
        return sim

    def build(root: Path, pids: Any, host_seed: int = 0) -> simhost.FakeHost:
        hosts.append(real_build(root, pids, host_seed))
        return hosts[-1]

    profile, naming = MEMBERS[member]
    node = node_of(member)
    cfg = agent_config(pki, node, gw, spool_dir=tmp / f"spool-{member}")
    cfg = dataclasses.replace(
        cfg,
        dcgm_naming=naming,
        interval_seconds=INTERVAL,
        # Every collection lists processes (the collector's clock is the wall clock).
        process_interval_seconds=0.001,
        simulate=SimulateConfig(profile=profile, seed=seed),
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(simulator, "SimulatedNvml", simulated)
        mp.setattr(simhost, "build", build)
        agent = await agents.enter_async_context(running_agent(cfg))
    if profile in BOARDS:  # no NVML: the board's files, on the wall clock
        [host] = hosts
        return Member(profile, node, agent, None, FakeClock(), dict(host.pods), naming=naming)
    [(sim, clock)], [host] = made, hosts
    return Member(profile, node, agent, sim, clock, dict(host.pods), naming=naming)


async def _collect_again(m: Member) -> None:
    before = m.agent.published.snapshot
    m.agent.collect_now()  # the run loop sleeps until the next interval, an hour away
    await wait_for(
        lambda: m.agent.published.snapshot is not before,
        what=f"the second collection of {m.node}",
    )


@asynccontextmanager
async def _prometheus(
    binary: Path, tmp: Path, gw: Gateway, members: dict[str, Member]
) -> AsyncIterator[PromQL]:
    token = tmp / "edge-gpu-relay.token"
    token.write_text(TOKEN + "\n")
    config = tmp / "prometheus.yml"
    replacements = {GATEWAY: f"127.0.0.1:{gw.http_port}", TOKEN_FILE: str(token), **FAST}
    config.write_text(substituted(SHIPPED.read_text(), replacements))
    nodes = {m.node for m in members.values()}
    with running_prometheus(binary, config, tmp) as (url, log):
        async with httpx.AsyncClient(base_url=url, timeout=10, trust_env=False) as client:
            prom = PromQL(client, log)

            async def scraped() -> str:
                # Two scrapes at least (range functions need two samples) in each job.
                counts = await prom.query(
                    "min by (job, instance) (count_over_time(gpurelay_agent_collections_total[1m]))"
                )
                seen = {
                    (s["metric"]["job"], s["metric"]["instance"])
                    for s in counts
                    if float(s["value"][1]) >= 2
                }
                missing = {(j, n) for j in JOBS for n in nodes} - seen
                return f"not scraped twice yet: {sorted(missing)}" if missing else ""

            await prom.until("both jobs to scrape every node twice", scraped, _deadline())
            yield prom


def _deadline() -> float:
    return time.monotonic() + SCRAPED_DEADLINE
