"""The failover of test_cluster_failover.py written into VictoriaMetrics (single node,
``/api/v1/write``) instead of Prometheus, checked through VictoriaMetrics' own export API:
every collection of every real agent must be there, once.

Delivery is at least once: batches the killed gateway had written before its ACK reached
the agent (ACKs go out in ranges, up to the agent's ack_delay_seconds late) are replayed to
the survivor and written again, identical. VictoriaMetrics runs as the operator guide says
(``-dedup.minScrapeInterval=1ms``: one sample per series and millisecond), which removes
exactly those copies; without the flag it stores both (measured: 2 batches per real agent
of the killed gateway, none elsewhere; tests/integration/test_cluster_services.py shows
the difference on one sample). A replay that wrote *other* values would be hidden by the
deduplication here; test_cluster_failover.py catches that (Prometheus refuses such a
sample, and the survivors must have dropped no batch).

3 gateways, 12 simulated agents and 4 real agents (2 GPUs, a spool); the gateway holding
the most real agents is killed."""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.cluster import Cluster, ClusterSpec, running_cluster
from harness.victoria import VictoriaMetrics
from harness.waiting import wait_until


@pytest.fixture
def cluster(
    tmp_path: Path, postgres_bin: None, haproxy_bin: Path, victoria_bin: Path
) -> Iterator[Cluster]:
    spec = ClusterSpec(simulated=12, real=4, victoria=True)
    with running_cluster(tmp_path, spec, haproxy_bin=haproxy_bin) as c:
        try:
            c.wait_settled(90)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{c.logs()}") from exc
        yield c


def audit(vm: VictoriaMetrics, node: str) -> tuple[int, list[str], set[int], list[str]]:
    """Collections of ``node`` (its collections counter), gaps in that counter, the
    timestamps written more than once (any series), and the series where such a repeat
    differs in value (not a re-write of the same batch)."""
    data = vm.export(f'{{Hostname="{node}"}}')
    data.update(vm.export(f'{{NodeName="{node}"}}'))
    [ticks] = [s for k, s in data.items() if '__name__="gpurelay_agent_collections_total"' in k]
    values = [v for _, v in sorted(set(ticks))]
    gaps = [f"{a:g} -> {b:g}" for a, b in itertools.pairwise(values) if b not in (a + 1, 1)]
    repeated: set[int] = set()
    different = []
    for key, samples in data.items():
        counts = Counter(t for t, _ in samples)
        twice = {t for t, n in counts.items() if n > 1}
        repeated |= twice
        if any(len({v for t, v in samples if t == r}) > 1 for r in twice):
            different.append(key)
    return len(values), gaps, repeated, different


def test_kill_9_writes_every_collection_into_victoria_metrics(cluster: Cluster) -> None:
    """No collection missing, none twice, and the killed gateway's agents replayed what
    it had not acknowledged (so deduplication had copies to remove)."""
    c = cluster
    gateways = c.live()
    owners = c.owners(gateways[0])
    real_on = {g: sum(owners[n] == g for n in c.agents) for g in gateways}
    victim = max(gateways, key=lambda g: real_on[g])
    time.sleep(5)
    c.kill9(victim)
    c.wait_settled(60)
    for node in c.agents:
        wait_until(lambda node=node: c.agent_drained(node), 120, f"{node} drained", poll=0.5)  # type: ignore[misc]
    time.sleep(3)  # the last acknowledged batches are written (the ACK follows the 2xx)
    assert c.victoria is not None
    c.victoria.flush()
    lines, failures = [], []
    for node in c.agents:
        collections, gaps, repeated, different = audit(c.victoria, node)
        replayed = c.agents[node].metric("gpurelay_agent_replayed_batches_total")
        line = (
            f"{node} (on {owners[node]}, {victim} killed): {collections} collections, "
            f"{len(gaps)} gaps, {len(repeated)} batch(es) written twice (same values: "
            f"{not different}), {replayed:.0f} replayed"
        )
        lines.append(line)
        if gaps or different or repeated:
            failures.append(line + "\n  " + "\n  ".join([*gaps[:3], *different[:3]]))
    print("\n".join(lines))
    assert not failures, "\n".join(failures)
    moved = [n for n in c.agents if owners[n] == victim]
    assert sum(c.agents[n].metric("gpurelay_agent_replayed_batches_total") for n in moved) > 0, (
        lines
    )
