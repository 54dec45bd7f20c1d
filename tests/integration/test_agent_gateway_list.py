"""A list of gateway addresses instead of a balancer (issue 16, bare metal): real processes.

Two gateway processes (single-gateway mode, no database) remote-write to one real
Prometheus; one real agent binary has ``[gateway] addresses`` = a port nobody listens on,
then the two gateways, and a node name that starts it at the dead port. It moves on to
the first gateway at once, its data arrives; the gateway it is on is killed with
``kill -9``; it moves to the other one and the TSDB holds a sample of every series at
every collection (harness/prometheus.completeness), before, during and after the move.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from edge_agent.dial import first_index
from harness.fleet import Pki, make_pki
from harness.ports import free_ports
from harness.process import Process
from harness.prometheus import Receiver, assert_nothing_lost, completeness, running_receiver
from harness.services import AgentProc, GatewayProc
from harness.waiting import wait_until

# A node name whose place in a list of three is the first: it dials the dead port first.
NODE = next(n for n in (f"edge-list-{i}" for i in range(100)) if first_index(n, 3) == 0)


class ListAgent(AgentProc):
    """The agent binary with a list of gateway addresses (2 simulated GPUs, 1 s interval)."""

    def __init__(self, pki: Pki, tmp: Path, addresses: list[str]) -> None:
        super().__init__(pki, tmp, NODE, None, spool_dir=tmp / "spool", addresses=addresses)

    def series(self) -> dict[str, float]:
        """The agent's own /metrics: ``name{labels}`` -> value."""
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                out[key] = float(value)
        return out

    def on(self) -> str | None:
        """The gateway address its telemetry channel is open to, if any."""
        for key, value in self.series().items():
            match = re.fullmatch(r'gpurelay_agent_gateway_address\{address="([^"]+)"\}', key)
            if match and value == 1:
                return match.group(1)
        return None


@pytest.fixture
def receiver(prometheus_bin: Path, tmp_path: Path) -> Iterator[Receiver]:
    with running_receiver(prometheus_bin, tmp_path) as r:
        yield r


def test_the_agent_goes_round_its_list_and_loses_nothing_when_its_gateway_dies(
    receiver: Receiver, tmp_path: Path
) -> None:
    pki = make_pki(tmp_path)
    gateways: list[GatewayProc] = []
    for name in ("gw1", "gw2"):
        (tmp_path / name).mkdir()
        gateways.append(GatewayProc(pki, tmp_path / name, receiver.url))
    (dead,) = free_ports(1)  # nobody listens: connection refused
    addresses = [f"127.0.0.1:{dead}"] + [f"127.0.0.1:{g.ssh_port}" for g in gateways]
    agent = ListAgent(pki, tmp_path, addresses)
    procs: list[Process] = [*gateways, agent]

    def logs() -> str:
        return "\n".join(p.tail() for p in procs)

    try:
        for g in gateways:
            g.start()
        for g in gateways:
            wait_until(g.ready, 60, f"{g.name} ready")
        started = time.time()
        agent.start()
        wait_until(lambda: agent.on() == addresses[1], 60, "the agent on the first gateway")
        first_ack = agent.series()["gpurelay_agent_gateway_acked_seq"]
        wait_until(
            lambda: agent.series()["gpurelay_agent_gateway_acked_seq"] > first_ack + 3,
            60,
            "ACKs from the first gateway",
        )
        log = agent.log.read_text()
        assert f"dialling gateway 127.0.0.1:{dead} (1 of 3 this round)" in log, log
        assert f"node {NODE}: gateway 127.0.0.1:{dead} failed" in log, log
        assert f"trying {addresses[1]} now" in log, log
        series = agent.series()
        for address in addresses:  # one series per configured address
            key = f'gpurelay_agent_gateway_address{{address="{address}"}}'
            assert series[key] == (1.0 if address == addresses[1] else 0.0), series

        time.sleep(3)
        killed = time.time()
        gateways[0].kill9()
        wait_until(lambda: agent.on() == addresses[2], 60, "the agent on the second gateway")
        moved = time.time() - killed
        seq_at_move = agent.series()["gpurelay_agent_gateway_acked_seq"]
        wait_until(
            lambda: agent.series()["gpurelay_agent_gateway_acked_seq"] > seq_at_move + 3,
            60,
            "ACKs from the second gateway",
        )
        log = agent.log.read_text()
        assert f"(gateway {addresses[1]}); reconnecting to {addresses[2]}" in log, log
        assert agent.series()["gpurelay_agent_gateway_connects_total"] == 2, logs()

        def shown_by_the_gateway() -> bool:  # the series reach the gateway like any other
            return any(
                line.startswith("gpurelay_agent_gateway_address{")
                and f'"{NODE}"' in line
                and f'address="{addresses[2]}"' in line
                and line.endswith(" 1")
                for line in gateways[1].metrics().splitlines()
            )

        wait_until(shown_by_the_gateway, 30, "the address series on the second gateway")
        print(f"on the second gateway {moved:.1f}s after the kill -9 of the first")

        def drained() -> bool:
            s = agent.series()
            return (
                s["gpurelay_agent_spool_batches"] == 0
                and s["gpurelay_agent_gateway_connected"] == 1
            )

        assert_nothing_lost(
            receiver,
            NODE,
            started=started,
            what=f"kill -9 of the gateway in use, moved in {moved:.1f}s",
            drained=drained,
            logs=logs,
        )
        result = completeness(receiver, NODE, window_s=600, at=time.time())
        before, after = result.between(started, killed), result.between(killed, time.time())
        assert before >= 3 and after >= 3, (before, after, result.summary())
    finally:
        for p in reversed(procs):
            if p.running():
                p.stop()
