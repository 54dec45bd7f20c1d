"""Links that fail the way real uplinks fail (issue 13, rows 3 to 6), with real processes.

The agent runs in its own network namespace behind a router namespace that drops every
packet (a silent link: a NAT table flushed, a cable pulled two hops away) or a fifth of
them (:mod:`harness.netns`); the gateway runs here and remote-writes every sample to a real
Prometheus. Each test watches what an operator sees (``gpurelay_node_up``, the node API)
and how soon data flows again, and then proves through remote write that no sample was
lost (:func:`harness.prometheus.completeness`).

Before issue 13 a silent link kept ``gpurelay_node_up`` at 1 for as long as TCP and SSH
keepalives (30 s x 3) believed in the connection, the agent held the dead session for
45-60 s, and data resumed only when TCP's retransmission timer fired (24 s after a 30 s
silence). The agent collects every second here: "a few intervals" is a few seconds.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from harness.fleet import TOKEN, make_pki
from harness.netns import Uplink
from harness.prometheus import Receiver, assert_nothing_lost
from harness.services import AgentProc, GatewayProc
from harness.waiting import wait_until

pytestmark = pytest.mark.netns

NODE = "edge-a"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}


@dataclass
class Site:
    uplink: Uplink
    receiver: Receiver
    gateway: GatewayProc
    agent: AgentProc
    started: float

    def node(self) -> dict[str, object]:
        url = f"{self.gateway.url}/api/v1/nodes/{NODE}"
        doc: dict[str, object] = httpx.get(url, headers=HEADERS, timeout=10).json()
        return doc

    def up(self) -> float:
        prefix = f'gpurelay_node_up{{Hostname="{NODE}"}} '
        for line in self.gateway.metrics().splitlines():
            if line.startswith(prefix):
                return float(line[len(prefix) :])
        return float("nan")

    def batches(self) -> int:
        return int(self.node().get("batches_received", 0))  # type: ignore[call-overload]

    def agent_metric(self, name: str) -> float:
        """The agent's local /metrics lives in the edge namespace: ask from in there."""
        out = subprocess.run(
            [*self.uplink.prefix, "curl", "-sf", "--max-time", "5", f"{self.agent.url}/metrics"],
            capture_output=True,
            text=True,
            timeout=15,
            check=True,
        ).stdout
        for line in out.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise AssertionError(f"{name} not in the agent's /metrics")

    def logs(self) -> str:
        return "\n".join(p.tail() for p in (self.receiver, self.gateway, self.agent))

    def no_sample_lost(self, what: str) -> str:
        def drained() -> bool:
            return (
                self.agent_metric("gpurelay_agent_spool_batches") == 0
                and self.agent_metric("gpurelay_agent_gateway_connected") == 1
            )

        return assert_nothing_lost(
            self.receiver, NODE, started=self.started, what=what, drained=drained, logs=self.logs
        )


def make_site(
    uplink: Uplink,
    prometheus_bin: Path,
    tmp_path: Path,
    registry: dict[str, float] | None = None,
) -> Iterator[Site]:
    pki = make_pki(tmp_path, gateway_names=[uplink.gateway_host])
    receiver = Receiver(prometheus_bin, tmp_path)
    gateway = GatewayProc(
        pki, tmp_path, receiver.url, ssh_host=uplink.gateway_host, registry=registry
    )
    agent = AgentProc(
        pki, tmp_path, NODE, gateway, spool_dir=tmp_path / "spool", prefix=uplink.prefix
    )
    try:
        receiver.start()
        wait_until(receiver.ready, 60, "prometheus ready")
        gateway.start()
        wait_until(gateway.ready, 60, "gateway ready")
        agent.start()
        s = Site(uplink, receiver, gateway, agent, time.time())
        try:
            wait_until(lambda: s.batches() >= 3, 60, "the agent's first batches at the gateway")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{s.logs()}") from exc
        yield s
    finally:
        for proc in (agent, gateway, receiver):
            proc.stop()


@pytest.fixture
def site(uplink: Uplink, prometheus_bin: Path, tmp_path: Path) -> Iterator[Site]:
    yield from make_site(uplink, prometheus_bin, tmp_path)


@dataclass
class Watch:
    """What an operator saw, polled every quarter second: when ``gpurelay_node_up``
    first read 0, when the API first said stale and offline."""

    started: float
    down: float | None = None
    stale: float | None = None
    offline: float | None = None

    def poll(self, site: Site, until: float) -> None:
        while time.time() < until:
            now = time.time() - self.started
            state = site.node()["state"]
            if self.down is None and site.up() == 0:
                self.down = now
            if self.stale is None and state == "stale":
                self.stale = now
            if self.offline is None and state == "offline":
                self.offline = now
            time.sleep(0.25)


def resumed_within(site: Site, deadline: float) -> float:
    """Seconds from now until a new live batch reaches the gateway."""
    back = time.time()
    before = site.batches()
    wait_until(lambda: site.batches() > before, deadline, "data after the link came back")
    return time.time() - back


def test_a_silent_link_is_noticed_in_a_few_intervals_and_data_resumes_within_seconds(
    site: Site,
) -> None:
    """Rows 3 to 5: the link goes silent for 30 s, then comes back."""
    time.sleep(3)
    watch = Watch(time.time())
    site.uplink.silence()
    watch.poll(site, watch.started + 30)
    site.uplink.restore()
    resumed = resumed_within(site, 60)
    summary = (
        f"silent 30 s at a 1 s interval: node_up 0 at +{watch.down}s, stale at "
        f"+{watch.stale}s, offline at +{watch.offline}s; data resumed {resumed:.1f}s "
        "after the link returned"
    )
    print(summary)
    # stale after 3 intervals + the 2 s margin (+ the gateway's 1 s tick and polling)
    assert watch.down is not None and watch.down <= 8.0, summary
    assert watch.stale is not None and watch.stale <= 8.0, summary
    # offline (the gateway closed the silent connection) after 6 intervals + 2 s
    assert watch.offline is not None and watch.offline <= 12.0, summary
    # the agent dropped the dead session itself (3 x the heartbeat period + 5 s; the period
    # is max(1 s, [gateway] ack_delay_seconds 3 s): ACKs come in ranges), not after keepalives
    assert "nothing from the gateway for 14s" in site.agent.tail(1000), site.agent.tail()
    # a dial every few seconds (3 s dial timeout, short pause), not TCP's timer (~24 s)
    assert resumed <= 8.0, summary
    assert site.node()["state"] == "online"
    site.no_sample_lost(summary)


def test_a_lossy_link_is_not_reported_late_and_loses_nothing(site: Site) -> None:
    """Row 6: a fifth of the packets lost, both ways, for 45 s: TCP retransmits and some
    batches arrive seconds late, but the node sends, so it stays online; the gateway's
    margin for it grows from what it measures.

    Every 5th packet, not each with probability 0.2: random loss now and then drops one
    retransmission after another, and TCP's doubling timeout then stalls the connection
    past the node's offline threshold (once in .ci/run: offline 27.6 s into the loss,
    83 packets dropped). That stall is then reported correctly, but it is luck, not what
    this test is about; tests/netns/test_uplink.py checks the random mode's share."""
    site.uplink.drop_every(5)
    watch = Watch(time.time())
    watch.poll(site, watch.started + 45)
    dropped = site.uplink.dropped()  # before restore() flushes the rule and its counter
    site.uplink.restore()
    late_after = next(
        (
            float(line.rsplit(" ", 1)[1])
            for line in site.gateway.metrics().splitlines()
            if line.startswith(f'gpurelay_node_late_after_seconds{{Hostname="{NODE}"}}')
        ),
        None,
    )
    summary = (
        f"every 5th packet lost for 45 s ({dropped} packets dropped): node_up 0 at {watch.down}, "
        f"stale at {watch.stale}, offline at {watch.offline}; late after {late_after}s now"
    )
    print(summary)
    assert dropped > 10, summary  # the link really was lossy
    assert watch.stale is None and watch.offline is None and watch.down is None, summary
    site.no_sample_lost(summary)


@pytest.fixture
def patient_site(uplink: Uplink, prometheus_bin: Path, tmp_path: Path) -> Iterator[Site]:
    """A site whose gateway waits 10 intervals and 4 s of margin before closing a silent
    connection, 5 intervals before calling the node late."""
    registry = {"stale_after_intervals": 5, "offline_after_intervals": 10, "margin_seconds": 4}
    yield from make_site(uplink, prometheus_bin, tmp_path, registry)


def test_silence_detection_follows_the_configured_thresholds(patient_site: Site) -> None:
    """Row 4: detection time is a setting (``[registry]``), in intervals of the node, not
    a hard-coded 30 s x 3 of SSH keepalives."""
    site = patient_site
    time.sleep(2)
    watch = Watch(time.time())
    site.uplink.silence()
    watch.poll(site, watch.started + 16)
    site.uplink.restore()
    summary = (
        f"silent 16 s, [registry] 5 / 10 intervals + 4 s: node_up 0 at +{watch.down}s, "
        f"stale at +{watch.stale}s, offline at +{watch.offline}s"
    )
    print(summary)
    # 5 x 1 s + 4 s, and 10 x 1 s + 4 s, counted from the last batch before the silence
    # (up to an interval earlier), seen on the gateway's 1 s tick through 0.25 s polling
    assert watch.stale is not None and 9.0 - 1.5 <= watch.stale <= 9.0 + 3.0, summary
    assert watch.offline is not None and 14.0 - 1.5 <= watch.offline <= 14.0 + 3.0, summary
    assert "the limit is 14.0s" in site.gateway.tail(1000)
    resumed_within(site, 60)
    site.no_sample_lost(summary)
