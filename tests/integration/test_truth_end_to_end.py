"""Truth end to end (issue 23): every figure a user reads is what NVML said.

One test per machine profile of the simulator (:data:`edge_agent.sim.profiles.PROFILES`),
two more whose agents publish dcgm-exporter 4.9's names and units (docs/migration.md),
and one per simulated Jetson board, whose source is its kernel's files
(:mod:`tests.integration.truth_jetson`; its ``gpurelay_jetson_*`` series too).
All profiles run at once as nodes of one real gateway, scraped by one real Prometheus with
the shipped ``prometheus.yml`` (:mod:`tests.integration.truth_fleet`); the source values
are the simulator's own answers (:mod:`tests.integration.truth_source`). Each test
compares, for its node, whole GPUs and MIG GPU instances alike:

1. the agent's ``/metrics`` and the gateway's ``/metrics``: every ``DCGM_*`` series;
2. Prometheus: the same series as stored by each of the two jobs;
3. every shipped adapter rule, rendered as prometheus-adapter renders it, for the node,
   its namespaces and its pods;
4. every query of the shipped dashboards, for the node;
5. ``/v1/collect`` of the agent and of the gateway;
6. the operator page (``/ui`` and ``/ui/nodes/NODE``), as the page formats figures.

A query is also run once per job (its selectors limited to that job): each job alone
must give the answer both give together, so a figure that doubles when Prometheus
scrapes both ways (item 10) fails here even where no source value is known (spool
backlog, time since the last push). Integer figures must be equal; computed ones (a
ratio, a mean, a rate) equal to 1e-9 relative: the order of floating-point operations
differs between the agent, PromQL and this test, the figure does not. Every mismatch of
every hop is reported together.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from cloud_gateway.http.ui.html import mib, pct
from harness.fleet import TOKEN
from tests.integration.test_adapter_and_dashboards import (
    BUILTINS,
    adapter_rules,
    dashboards,
    panels,
    substitute,
)
from tests.integration.test_prometheus_e2e import UNIFIED_JOB
from tests.integration.truth_fleet import (
    JOBS,
    MEMBERS,
    Fleet,
    Member,
    Sample,
    exposition,
    one_job,
    running_truth_fleet,
)
from tests.integration.truth_source import MIB, WHOLE, Device, NodeTruth, Process

pytestmark = pytest.mark.asyncio(loop_scope="module")

REL = 1e-9
Key = tuple[str, ...]
DEVICE_PREFIX = "DCGM_FI_"
PROCESS = "DCGM_CUSTOM_PROCESS_"
CONTAINER = "DCGM_CUSTOM_CONTAINER_"
UTIL_FAMILIES = {
    f"{PROCESS}SM_UTIL": "SM",
    f"{PROCESS}MEM_COPY_UTIL": "MEM_COPY",
    f"{PROCESS}ENCODE_UTIL": "ENCODE",
    f"{PROCESS}DECODE_UTIL": "DECODE",
}
GATEWAY_ONLY = "gpurelay_node_"  # series the gateway makes about nodes (unified job only)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(
    prometheus_bin: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Fleet]:
    async with running_truth_fleet(prometheus_bin, tmp_path_factory.mktemp("truth")) as f:
        yield f


@pytest.mark.parametrize("profile", sorted(MEMBERS))
async def test_every_figure_is_what_nvml_said(fleet: Fleet, profile: str) -> None:
    """``*-dcgm49``: H100 nodes (MIG and not) whose agents publish dcgm-exporter 4.9's names
    and units, read by the same dashboards, rules, BIE and page."""
    member = fleet.members[profile]
    found = Findings()
    agent_metrics = await exposition(fleet.http, f"http://127.0.0.1:{member.agent.port}/metrics")
    check_series(found, "agent /metrics", agent_metrics, member.known)
    containers = container_ids(agent_metrics, member.node)
    gateway_metrics = await exposition(fleet.http, f"{fleet.gateway_url}/metrics")
    check_series(found, "gateway /metrics", gateway_metrics, member.known)
    for job in JOBS:
        stored = await fleet.prometheus.at(
            f'{{__name__=~"DCGM_.+", job="{job}", NodeName="{member.node}"}}', fleet.when
        )
        samples = [(s["metric"]["__name__"], s["metric"], float(s["value"][1])) for s in stored]
        check_series(found, f"Prometheus job {job}", samples, member.known)
    if member.known.extra:  # a Jetson's gpurelay_jetson_* series
        await check_extra(found, fleet, member, agent_metrics, gateway_metrics)
    everyone = [m.known for m in fleet.members.values()]
    await check_adapter_rules(found, fleet, member.known, everyone)
    await check_dashboards(found, fleet, Context(member.known, containers))
    await check_bie(found, fleet, member)
    await check_operator_page(found, fleet, member.known)
    found.assert_none(f"{profile} ({member.node})")


# --- comparing ----------------------------------------------------------------------------


class Findings:
    """Every mismatch, reported together at the end; how many figures each hop showed."""

    def __init__(self) -> None:
        self.items: list[str] = []
        self.checked: Counter[str] = Counter()

    def add(self, where: str, what: str) -> None:
        self.items.append(f"{where}: {what}")

    def compare(self, where: str, got: Mapping[Any, Any], want: Mapping[Any, Any]) -> None:
        """``got`` (what a hop shows) is ``want`` (what NVML said): the same figures, each
        with the same value."""
        self.checked[hop(where)] += len(want)
        for key in sorted(want.keys() - got.keys(), key=repr):
            self.add(where, f"{key} missing, NVML said {want[key]!r}")
        for key in sorted(got.keys() - want.keys(), key=repr):
            self.add(where, f"{key} = {got[key]!r} shown, NVML gave no value")
        for key in sorted(got.keys() & want.keys(), key=repr):
            if not same(got[key], want[key]):
                self.add(where, f"{key} = {got[key]!r}, NVML said {want[key]!r}")

    def assert_none(self, what: str) -> None:
        print(f"{what}: " + ", ".join(f"{h} {n}" for h, n in self.checked.items()))
        assert not self.items, f"{what}: {len(self.items)} figure(s) not what NVML said\n" + (
            "\n".join(self.items)
        )


def hop(where: str) -> str:
    """``where`` without the object: "dashboard edge-gpu-node.json", "adapter rule"."""
    if where.startswith("/ui"):
        return "node page" if where.startswith("/ui/nodes/") else "fleet page"
    words = where.split()
    return " ".join(words[:3] if words[0] == "Prometheus" else words[:2])


def same(got: Any, want: Any) -> bool:
    """Equal; floats (ratios, means, rates) to :data:`REL`, NaN to NaN."""
    if isinstance(got, int | float) and isinstance(want, int | float):
        return got == want or math.isclose(got, want, rel_tol=REL) or (got != got and want != want)
    return bool(got == want)


# --- series: /metrics and what Prometheus stored ------------------------------------------


def container_ids(samples: Iterable[Sample], node: str) -> dict[int, str]:
    """pid -> container_id of the node's processes, as the agent attributed them (the
    values are checked against NVML; which container a pid is in is attribution's
    business, tested elsewhere)."""
    return {
        int(labels["ProcessId"]): labels.get("container_id", "")
        for name, labels, _ in samples
        if name == f"{PROCESS}MEM_USED" and labels.get("NodeName") == node
    }


def check_series(found: Findings, where: str, samples: Iterable[Sample], t: NodeTruth) -> None:
    """Every DCGM_ series of node ``t.node`` in ``samples`` against the simulator."""
    mine = [s for s in samples if s[0].startswith("DCGM_") and s[1].get("NodeName") == t.node]
    containers = container_ids(mine, t.node)
    got: dict[tuple[str, ...], float] = {}
    for name, labels, value in mine:
        key = series_key(found, where, name, labels, t)
        if key is None:
            continue
        if key in got:
            found.add(where, f"{name}{key}: two series for one figure")
        got[key] = value
    want: dict[tuple[str, ...], float] = {}
    for (gpu, gi), d in t.devices.items():
        want.update(((name, gpu, gi), v) for name, v in d.fields.items())
        want.update(((name, gpu, gi, *own), v) for (name, own), v in d.series.items())
    for p in t.processes.values():
        if p.mem_mib is not None:
            want[(f"{PROCESS}MEM_USED", str(p.pid))] = p.mem_mib
        for family, share in UTIL_FAMILIES.items():
            if p.util is not None:
                want[(family, str(p.pid))] = p.util[share]
    for (gpu, gi, cid), procs in by_container(t.processes.values(), containers).items():
        want[(f"{CONTAINER}PROCESSES", gpu, gi, cid)] = float(len(procs))
        mem = [p.mem_mib for p in procs]
        if None not in mem:
            want[(f"{CONTAINER}MEM_USED", gpu, gi, cid)] = sum(m for m in mem if m is not None)
        if all(p.util is not None for p in procs):
            sm = sum(p.util["SM"] for p in procs if p.util is not None)
            want[(f"{CONTAINER}SM_UTIL", gpu, gi, cid)] = sm
    found.compare(where, got, want)


async def check_extra(
    found: Findings,
    fleet: Fleet,
    member: Member,
    agent_metrics: list[Sample],
    gateway_metrics: list[Sample],
) -> None:
    """The node's other series (a Jetson's zones, rails, EMC), at every hop."""
    t = member.known
    prefixes = {name.rsplit("_", 1)[0] for name, _ in t.extra}
    stored: dict[str, list[Sample]] = {}
    for job in JOBS:
        answer = await fleet.prometheus.at(
            f'{{__name__=~"gpurelay_jetson_.+", job="{job}", Hostname="{t.node}"}}', fleet.when
        )
        stored[f"Prometheus job {job}"] = [
            (s["metric"]["__name__"], s["metric"], float(s["value"][1])) for s in answer
        ]
    for where, samples in (
        ("agent /metrics", agent_metrics),
        ("gateway /metrics", gateway_metrics),
        *stored.items(),
    ):
        got: dict[Any, float] = {}
        for name, labels, value in samples:
            if labels.get("Hostname") != t.node or not name.startswith(tuple(prefixes)):
                continue
            if labels.get("UUID") != t.whole()[0].uuid:
                found.add(where, f"{name}{labels}: not the board's GPU")
            own = tuple((k, labels[k]) for k in ("zone", "rail") if k in labels)
            got[(name, own)] = value
        found.compare(where, got, t.extra)


# dcgm-exporter's fields of several series per GPU, and the labels that tell them apart
OWN_LABELS = {
    "DCGM_EXP_XID_ERRORS_COUNT": ("window_size_in_ms",),
    "DCGM_EXP_GPU_HEALTH_STATUS": ("health_watch", "health_error_code"),
}


def series_key(
    found: Findings, where: str, name: str, labels: Mapping[str, str], t: NodeTruth
) -> tuple[str, ...] | None:
    """The figure a series shows, its identity labels checked against the simulator."""
    gi = labels.get("GPU_I_ID", "")
    if name.startswith(DEVICE_PREFIX) or name in OWN_LABELS:
        device = t.devices.get((labels.get("gpu", ""), gi))
        if device is None:
            found.add(where, f"{name}{labels}: no such GPU or GPU instance")
            return None
        check_labels(found, where, name, labels, device, t.node)
        own = OWN_LABELS.get(name, ())  # a field of several series: which one
        return (name, device.gpu, gi, *((k, labels.get(k, "")) for k in own))
    if name.startswith(PROCESS):
        p = t.processes.get(int(labels.get("ProcessId", "-1")))
        if p is None:
            found.add(where, f"{name}{labels}: no such process")
            return None
        want = {"gpu": p.gpu, "GPU_I_ID": p.gpu_instance, "UUID": p.uuid}
        pod = p.pod or ("", "", "")
        want |= {"NamespaceName": pod[0], "PodName": pod[1], "ContainerName": pod[2]}
        wrong = {k: labels.get(k, "") for k, v in want.items() if labels.get(k, "") != v}
        if wrong:
            found.add(where, f"{name} of pid {p.pid}: labels {wrong}, want {want}")
        return (name, str(p.pid))
    if name.startswith(CONTAINER):
        return (name, labels.get("gpu", ""), gi, labels.get("container_id", ""))
    found.add(where, f"{name}: a DCGM_ family without a source value in this test")
    return None


def check_labels(
    found: Findings, where: str, name: str, labels: Mapping[str, str], d: Device, node: str
) -> None:
    want = {"UUID": d.uuid, "Hostname": node}
    if d.gpu_instance != WHOLE:
        want["GPU_I_PROFILE"] = d.profile
    wrong = {k: labels.get(k) for k, v in want.items() if labels.get(k) != v}
    if wrong:
        found.add(where, f"{name} of GPU {d.gpu}/{d.gpu_instance!r}: {wrong}, want {want}")


def by_container(
    processes: Iterable[Process], containers: Mapping[int, str]
) -> dict[tuple[str, str, str], list[Process]]:
    out: dict[tuple[str, str, str], list[Process]] = {}
    for p in processes:
        cid = containers.get(p.pid, "")
        if cid:
            out.setdefault((p.gpu, p.gpu_instance, cid), []).append(p)
    return out


# --- PromQL: one answer whatever the job --------------------------------------------------


async def answers(
    found: Findings, fleet: Fleet, where: str, expr: str, keys: Key | None
) -> dict[Key, float]:
    """The answer of ``expr`` by ``keys`` labels (None: all of them); each job alone must
    give it too (where the job has every series the query reads)."""
    got = await keyed(found, fleet, where, expr, keys)
    jobs = (UNIFIED_JOB,) if GATEWAY_ONLY in expr else JOBS
    for job in jobs:
        alone = await keyed(found, fleet, f"{where} [job {job} only]", one_job(expr, job), keys)
        if alone.keys() != got.keys() or not all(same(alone[k], got[k]) for k in got):
            found.add(where, f"job {job} alone gives {alone}, both jobs give {got}")
    return got


async def keyed(
    found: Findings, fleet: Fleet, where: str, expr: str, keys: Key | None
) -> dict[Key, float]:
    out: dict[Key, float] = {}
    for s in await fleet.prometheus.at(expr, fleet.when):
        labels: dict[str, str] = s["metric"]
        if keys is None:
            key = tuple(f"{k}={v}" for k, v in sorted(labels.items()))
        else:
            key = tuple(labels.get(k, "") for k in keys)
        if key in out:
            found.add(where, f"two answers for {key}: {expr}")
        out[key] = float(s["value"][1])
    return out


# --- the adapter rules --------------------------------------------------------------------


def processes_of(
    resource: str, name: str, namespace: str | None, t: NodeTruth, everyone: list[NodeTruth]
) -> list[tuple[NodeTruth, Process]]:
    if resource == "node":
        return [(t, p) for p in t.processes.values()]
    if resource == "namespace":
        return [
            (n, p) for n in everyone for p in n.processes.values() if p.pod and p.pod[0] == name
        ]
    return [(t, p) for p in t.processes.values() if p.pod and p.pod[:2] == (namespace, name)]


def memory_ratio(procs: list[tuple[NodeTruth, Process]]) -> float | None:
    """Memory the processes use / total memory of the GPUs or GPU instances they run
    on, each counted once: the total as DCGM's FB fields give it, used + free + reserved
    (in whole MiB under 4.8's names, exact bytes under 4.9's; on a GPU NVML's total, on a
    Jetson MemTotal to the MiB)."""
    used = [p.mem_mib for _, p in procs if p.mem_mib is not None]
    devices = {(n.node, p.gpu, p.gpu_instance): n for n, p in procs}
    totals = [fb_total(n.devices[(gpu, gi)]) for (_, gpu, gi), n in devices.items()]
    return sum(used) / sum(totals) if used and totals else None


def fb_total(d: Device) -> float:
    fb = [d.as48.get(f"DCGM_FI_DEV_FB_{part}") for part in ("USED", "FREE", "RESERVED")]
    if None in fb[:2]:
        return d.memory_bytes[1] / MIB
    return sum(v for v in fb if v is not None)


def rule_value(rule: str, t: NodeTruth, procs: list[tuple[NodeTruth, Process]]) -> float | None:
    """What a rule's metric is for an object, from the simulator; None: no value."""
    if rule == "DCGM_FI_DEV_GPU_UTIL":
        return mean(whole(t, rule).values())
    if rule == "DCGM_FI_DEV_FB_USED":
        values = whole(t, rule).values()
        return sum(values) if values else None
    if rule == "DCGM_CUSTOM_PROCESS_SM_UTIL":
        sm = [p.util["SM"] for _, p in procs if p.util is not None]
        return sum(sm) if sm else None
    if rule == "DCGM_CUSTOM_PROCESS_MEM_USED":
        mem = [p.mem_mib for _, p in procs if p.mem_mib is not None]
        return sum(mem) if mem else None
    if rule == "DCGM_CUSTOM_PROCESS_GPU_MEM_USED_RATIO":
        return memory_ratio(procs)
    raise AssertionError(f"adapter rule {rule}: no source value known in this test")


async def check_adapter_rules(
    found: Findings, fleet: Fleet, t: NodeTruth, everyone: list[NodeTruth]
) -> None:
    """Each rule for the node, for each of its namespaces and pods, and for all its pods
    of a namespace at once, as prometheus-adapter asks (``PodName=~"a|b"``)."""
    pods = sorted({p.pod[:2] for p in t.processes.values() if p.pod})
    namespaces = sorted({ns for ns, _ in pods})
    asks: dict[str, list[tuple[list[str], str | None]]] = {"node": [([t.node], None)]}
    asks["namespace"] = [([ns], None) for ns in namespaces]
    asks["namespace"].append((namespaces, None))
    asks["pod"] = [([pod], ns) for ns, pod in pods]
    asks["pod"] += [([pod for n, pod in pods if n == ns], ns) for ns in namespaces]
    for rule in adapter_rules():
        for resource, label in rule.labels.items():
            for names, namespace in asks[resource]:
                if not names:
                    continue
                query = rule.render(resource, names, namespace)
                where = f"adapter rule {rule.name} of {resource} {'|'.join(names)}"
                got = await answers(found, fleet, where, query, (label,))
                want = {}
                for name in names:
                    procs = processes_of(resource, name, namespace, t, everyone)
                    if (value := rule_value(rule.name, t, procs)) is not None:
                        want[(name,)] = value
                found.compare(where, got, want)


# --- the dashboards -----------------------------------------------------------------------


@dataclass(frozen=True)
class Context:
    t: NodeTruth
    containers: dict[int, str]  # pid -> container_id


@dataclass(frozen=True)
class Want:
    """A query's answer: ``values`` by the ``keys`` labels; ``top``: only the largest."""

    keys: Key
    values: dict[Key, float]
    top: int = 0


def mean(values: Iterable[float]) -> float | None:
    v = list(values)
    return sum(v) / len(v) if v else None


def whole(t: NodeTruth, field: str) -> dict[str, float]:
    """gpu -> ``field`` of each whole GPU that has it."""
    return {d.gpu: d.as48[field] for d in t.whole() if field in d.as48}


def scalar(value: float | None) -> Want:
    return Want((), {} if value is None else {(): value})


def by_node(value: float | None, t: NodeTruth) -> Want:
    return Want(("Hostname",), {} if value is None else {(t.node,): value})


def per_gpu(field: str) -> Callable[[Context], Want]:
    return lambda c: Want(
        ("gpu", "UUID"),
        {(d.gpu, d.uuid): d.as48[field] for d in c.t.whole() if field in d.as48},
    )


def used_share(d: Device) -> float | None:
    """used / (used + free); None where the GPU's memory in use is not known (a Jetson
    whose kernel has no NvMapMemUsed)."""
    used, free = d.as48.get("DCGM_FI_DEV_FB_USED"), d.as48.get("DCGM_FI_DEV_FB_FREE")
    return None if used is None or free is None else used / (used + free)


def per_pod(c: Context, value: Callable[[list[tuple[NodeTruth, Process]]], float | None]) -> Want:
    pods: dict[Key, list[tuple[NodeTruth, Process]]] = {}
    for p in c.t.processes.values():
        if p.pod:
            pods.setdefault(p.pod[:2], []).append((c.t, p))
    out = {key: v for key, procs in pods.items() if (v := value(procs)) is not None}
    return Want(("NamespaceName", "PodName"), out)


def pod_sum(share: str) -> Callable[[list[tuple[NodeTruth, Process]]], float | None]:
    def total(procs: list[tuple[NodeTruth, Process]]) -> float | None:
        values = [(p.mem_mib if share == "MEM" else (p.util or {}).get(share)) for _, p in procs]
        known = [v for v in values if v is not None]
        return sum(known) if known else None

    return total


def per_container(c: Context, share: str) -> Want:
    out: dict[Key, float] = {}
    for (gpu, _gi, cid), procs in by_container(c.t.processes.values(), c.containers).items():
        values = [p.mem_mib if share == "MEM" else (p.util or {}).get(share) for p in procs]
        if None not in values:
            out[(gpu, cid)] = sum(v for v in values if v is not None)
    return Want(("gpu", "container_id"), out)


def per_process(c: Context, share: str) -> Want:
    values = {
        (str(p.pid),): p.mem_mib if share == "MEM" else (p.util or {}).get(share)
        for p in c.t.processes.values()
    }
    return Want(("ProcessId",), {k: v for k, v in values.items() if v is not None})


def fleet_memory_share(t: NodeTruth) -> float | None:
    used = sum(whole(t, "DCGM_FI_DEV_FB_USED").values())
    both = used + sum(whole(t, "DCGM_FI_DEV_FB_FREE").values())
    return used / both if both else None


def total(values: Iterable[float]) -> float | None:
    """A sum, or no answer when there is nothing to add (PromQL's sum() of no series)."""
    v = list(values)
    return sum(v) if v else None


def jetson(c: Context, family: str, label: str) -> Want:
    """A Jetson's series of ``family`` by its own ``label`` (none on an NVML node)."""
    return Want(
        (label,),
        {
            tuple(v for _, v in own): value
            for (name, own), value in c.t.extra.items()
            if name == family
        },
    )


def count(n: int) -> Want:
    return scalar(float(n) if n else None)  # count() of nothing is no answer


UTIL, USED, POWER = "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_POWER_USAGE"
NO_SOURCE = None  # a figure NVML does not give (the agent's spool, time since a push)
CLUSTER, NODE = "edge-gpu-cluster.json", "edge-gpu-node.json"
# (dashboard, panel title, refId) -> what the panel must show for the node, from NVML;
# a table's title is followed by " [table]" (the node dashboard has a stat and a table
# both called "GPU processes").
PANELS: dict[tuple[str, str, str], Callable[[Context], Want] | None] = {
    (CLUSTER, "Nodes online", "A"): lambda c: scalar(1.0),
    (CLUSTER, "Nodes stale or offline", "A"): lambda c: scalar(0.0),
    (CLUSTER, "GPUs", "A"): lambda c: scalar(float(c.t.gpus)),
    (CLUSTER, "Mean GPU utilisation", "A"): lambda c: scalar(mean(whole(c.t, UTIL).values())),
    (CLUSTER, "GPU memory used", "A"): lambda c: scalar(fleet_memory_share(c.t)),
    (CLUSTER, "Power draw", "A"): lambda c: scalar(total(whole(c.t, POWER).values())),
    (CLUSTER, "Unhealthy GPUs", "A"): lambda c: scalar(0.0),
    (CLUSTER, "Spooled batches", "A"): NO_SOURCE,
    (CLUSTER, "Nodes [table]", "A"): lambda c: by_node(1.0, c.t),
    (CLUSTER, "Nodes [table]", "B"): NO_SOURCE,
    (CLUSTER, "Nodes [table]", "C"): lambda c: by_node(float(c.t.gpus), c.t),
    (CLUSTER, "Nodes [table]", "D"): lambda c: by_node(mean(whole(c.t, UTIL).values()), c.t),
    (CLUSTER, "Nodes [table]", "E"): lambda c: by_node(sum(whole(c.t, USED).values()), c.t),
    (CLUSTER, "Nodes [table]", "F"): lambda c: Want(
        ("Hostname", "backend"), {(c.t.node, c.t.backend): 1}
    ),
    (CLUSTER, "GPU utilisation by node", "A"): lambda c: by_node(
        mean(whole(c.t, UTIL).values()), c.t
    ),
    (CLUSTER, "GPU memory used by node", "A"): lambda c: by_node(
        sum(whole(c.t, USED).values()), c.t
    ),
    (CLUSTER, "Power draw by node", "A"): lambda c: by_node(total(whole(c.t, POWER).values()), c.t),
    (CLUSTER, "Hottest GPU by node", "A"): lambda c: by_node(
        max(whole(c.t, "DCGM_FI_DEV_GPU_TEMP").values()), c.t
    ),
    (CLUSTER, "Node online", "A"): lambda c: by_node(1.0, c.t),
    (CLUSTER, "Top pods by GPU memory [table]", "A"): lambda c: Want(
        ("NodeName", "NamespaceName", "PodName"),
        {(c.t.node, *k): v for k, v in per_pod(c, pod_sum("MEM")).values.items()},
        top=10,
    ),
    (CLUSTER, "Spooled batches by node", "A"): NO_SOURCE,
    (CLUSTER, "Spool size by node", "A"): NO_SOURCE,
    (CLUSTER, "Oldest spooled batch", "A"): NO_SOURCE,
    (CLUSTER, "Dropped batches", "A"): NO_SOURCE,
    (NODE, "Connection", "A"): lambda c: scalar(1.0),
    (NODE, "Last push", "A"): NO_SOURCE,
    (NODE, "Agent", "A"): lambda c: Want(("backend",), {(c.t.backend,): 1.0}),
    (NODE, "GPUs", "A"): lambda c: scalar(float(c.t.gpus)),
    (NODE, "GPU processes", "A"): lambda c: count(
        sum(1 for p in c.t.processes.values() if p.mem_mib is not None)
    ),
    (NODE, "Pods on GPUs", "A"): lambda c: count(
        len({p.pod[:2] for p in c.t.processes.values() if p.pod})
    ),
    (NODE, "GPU utilisation", "A"): per_gpu(UTIL),
    (NODE, "GPU memory used", "A"): per_gpu(USED),
    (NODE, "GPU memory used (of used + free)", "A"): lambda c: Want(
        ("gpu", "UUID"),
        {(d.gpu, d.uuid): share for d in c.t.whole() if (share := used_share(d)) is not None},
    ),
    (NODE, "Memory copy utilisation", "A"): per_gpu("DCGM_FI_DEV_MEM_COPY_UTIL"),
    (NODE, "Power draw", "A"): per_gpu(POWER),
    (NODE, "Temperature", "A"): per_gpu("DCGM_FI_DEV_GPU_TEMP"),
    (NODE, "SM clock", "A"): per_gpu("DCGM_FI_DEV_SM_CLOCK"),
    (NODE, "Last XID error", "A"): per_gpu("DCGM_FI_DEV_XID_ERRORS"),
    (NODE, "GPU health (agent)", "A"): lambda c: Want(
        ("gpu", "UUID"), {(d.gpu, d.uuid): 1.0 for d in c.t.whole()}
    ),
    (NODE, "SM utilisation by pod", "A"): lambda c: per_pod(c, pod_sum("SM")),
    (NODE, "GPU memory by pod", "A"): lambda c: per_pod(c, pod_sum("MEM")),
    (NODE, "GPU memory ratio by pod", "A"): lambda c: per_pod(c, memory_ratio),
    (NODE, "SM utilisation by container", "A"): lambda c: per_container(c, "SM"),
    (NODE, "GPU memory by container", "A"): lambda c: per_container(c, "MEM"),
    (NODE, "GPU processes [table]", "A"): lambda c: per_process(c, "MEM"),
    (NODE, "GPU processes [table]", "B"): lambda c: per_process(c, "SM"),
    (NODE, "Power rails", "A"): lambda c: jetson(c, "gpurelay_jetson_rail_power_watts", "rail"),
    (NODE, "Board temperatures", "A"): lambda c: jetson(
        c, "gpurelay_jetson_temperature_celsius", "zone"
    ),
    (NODE, "Memory controller (EMC) utilisation", "A"): lambda c: Want(
        ("UUID",),
        {
            (d.uuid,): v
            for d in c.t.whole()
            if (v := c.t.extra.get(("gpurelay_jetson_emc_utilization_ratio", ()))) is not None
        },
    ),
    (NODE, "Power mode", "A"): lambda c: Want(
        ("mode_id", "mode", "source"), {k: 1.0 for k in c.t.power_mode}
    ),
    (NODE, "Spooled batches", "A"): NO_SOURCE,
    (NODE, "Spool size", "A"): NO_SOURCE,
    (NODE, "Oldest spooled batch", "A"): NO_SOURCE,
    (NODE, "Dropped batches", "A"): NO_SOURCE,
}


async def check_dashboards(found: Findings, fleet: Fleet, c: Context) -> None:
    seen = set()
    for name, dashboard in dashboards().items():
        variables = dict(BUILTINS, datasource="unused")
        for v in dashboard["templating"]["list"]:
            if v["type"] != "datasource":
                variables[v["name"]] = (
                    c.t.node if v["name"] == "node" else v.get("allValue") or ".*"
                )
        for title, target in (
            (p["title"] + (" [table]" if p["type"] == "table" else ""), target)
            for p in panels(dashboard)
            for target in p.get("targets", [])
        ):
            panel = (name, title, target["refId"])
            seen.add(panel)
            if panel not in PANELS:
                found.add(f"{name} {title!r} {target['refId']}", "no expectation in PANELS")
                continue
            expr = substitute(target["expr"], variables)
            expect = PANELS[panel]
            keys = expect(c).keys if expect is not None else None
            where = f"dashboard {name} {title!r} {target['refId']}"
            got = await answers(found, fleet, where, expr, keys)
            if expect is None:
                if not got:
                    found.add(where, f"no answer: {expr}")
                continue
            want = expect(c)
            if want.top:
                check_top(found, where, got, want)
            else:
                found.compare(where, got, want.values)
    for gone in sorted(PANELS.keys() - seen):
        found.add(f"PANELS {gone}", "no such panel in the shipped dashboards")


def check_top(found: Findings, where: str, got: dict[Key, float], want: Want) -> None:
    """topk: the largest of the values, each equal to its source value."""
    found.compare(where, got, {k: v for k, v in want.values.items() if k in got})
    if len(got) != min(want.top, len(want.values)):
        found.add(where, f"{len(got)} answers, want {min(want.top, len(want.values))}")
    left = [v for k, v in want.values.items() if k not in got]
    if got and left and max(left) > min(got.values()):
        found.add(where, f"{max(left)} left out, {min(got.values())} shown")


# --- BIE /v1/collect ----------------------------------------------------------------------


async def check_bie(found: Findings, fleet: Fleet, member: Member) -> None:
    """Memory used and total of each GPU (bytes) and of the node, as NVML gave them."""
    t = member.known
    want: dict[Key, Any] = {("deviceNum",): t.gpus}
    for i, (used, total) in enumerate(d.memory_bytes for d in t.whole()):
        want |= {
            ("devices", str(i), "usedMemory"): used,
            ("devices", str(i), "totalMemory"): total,
            ("devices", str(i), "percent"): used / total,
        }
    used, total = (sum(d.memory_bytes[k] for d in t.whole()) for k in (0, 1))
    want |= {("usedMemory",): used, ("totalMemory",): total, ("percent",): used / total}
    for where, url in (
        ("agent /v1/collect", f"http://127.0.0.1:{member.agent.port}/v1/collect"),
        ("gateway /v1/collect", f"{fleet.gateway_url}/v1/collect"),
    ):
        r = await fleet.http.get(url)
        r.raise_for_status()
        found.compare(where, dict(flat(r.json().get(t.node, {}))), want)


def flat(doc: Any, path: Key = ()) -> Iterable[tuple[Key, Any]]:
    """A JSON document as (path, value) pairs, list indices as strings."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from flat(v, (*path, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from flat(v, (*path, str(i)))
    else:
        yield path, doc


# --- the operator page --------------------------------------------------------------------


Cell = tuple[dict[str, str], str]  # attributes, text


class Rows(HTMLParser):
    """Table rows: (table id, the row's attributes, its cells)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[str, dict[str, str], list[Cell]]] = []
        self._table = ""
        self._text: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "table":
            self._table = a.get("id", "")
        elif tag == "tr":
            self.rows.append((self._table, a, []))
        elif tag == "td" and self.rows:
            self.rows[-1][2].append((a, ""))
            self._text = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._text is not None:
            cells = self.rows[-1][2]
            cells[-1] = (cells[-1][0], "".join(self._text).strip())
            self._text = None

    def handle_data(self, data: str) -> None:
        if self._text is not None:
            self._text.append(data)


async def page_rows(fleet: Fleet, path: str) -> Rows:
    r = await fleet.http.get(
        f"{fleet.gateway_url}{path}", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    r.raise_for_status()
    rows = Rows()
    rows.feed(r.text)
    return rows


def shown_util(d: Device) -> float | None:
    """The utilisation a page shows: NVML's, else (MIG) the graphics engine's activity."""
    if UTIL in d.as48:
        return d.as48[UTIL]
    active = d.as48.get("DCGM_FI_PROF_GR_ENGINE_ACTIVE")
    return None if active is None else 100 * active


async def check_operator_page(found: Findings, fleet: Fleet, t: NodeTruth) -> None:
    """The node's page (each GPU, each MIG GPU instance, each process) and its row of the
    fleet page, as the page formats figures (:func:`mib`, :func:`pct`); the fleet row's
    sort values (``data-v``) exactly."""
    where = f"/ui/nodes/{t.node}"
    shown: dict[Key, Any] = {}
    for table, attrs, cells in (await page_rows(fleet, where)).rows:
        text = [c for _, c in cells]
        if "data-gpu" in attrs:
            device: Key = (attrs["data-gpu"], WHOLE)
        elif "data-instance" in attrs:
            device = tuple(attrs["data-instance"].split("/", 1))
            shown[(*device, "profile")] = text[1]
        elif table == "processes" and len(text) == 9:
            shown |= {("pid", text[1], "memory"): text[7], ("pid", text[1], "SM"): text[8]}
            continue
        else:
            continue
        shown |= {(*device, "utilisation"): text[3], (*device, "memory"): text[4]}
    want: dict[Key, Any] = {}
    for (gpu, gi), d in t.devices.items():
        want[(gpu, gi, "utilisation")] = pct(shown_util(d))
        want[(gpu, gi, "memory")] = f"{mib(d.as48.get(USED))} of {mib(d.memory_bytes[1] / MIB)}"
        if gi != WHOLE:
            want[(gpu, gi, "profile")] = f"MIG {d.profile}"
    for p in t.processes.values():
        if p.mem_mib is not None:
            want[("pid", str(p.pid), "memory")] = mib(p.mem_mib)
            want[("pid", str(p.pid), "SM")] = pct(None if p.util is None else p.util["SM"])
    found.compare(where, shown, want)

    row = next(
        (c for _, a, c in (await page_rows(fleet, "/ui")).rows if a.get("data-node") == t.node),
        None,
    )
    if row is None:
        found.add("/ui", f"no row for {t.node}")
        return
    (util_attrs, util_text), (memory_attrs, memory_text) = row[3], row[4]
    utils = [u for d in t.whole() if (u := shown_util(d)) is not None]
    used = sum(d.as48[USED] for d in t.whole())
    total = sum(d.memory_bytes[1] / MIB for d in t.whole())
    found.compare(
        f"/ui, the row of {t.node}",
        {
            "utilisation": util_text,
            "utilisation value": float(util_attrs.get("data-v") or "nan"),
            "memory": memory_text,
            "memory value": float(memory_attrs.get("data-v") or "nan"),
        },
        {
            "utilisation": " / ".join(pct(u) for u in utils) if utils else "—",
            "utilisation value": sum(utils) / len(utils) if utils else math.nan,
            "memory": f"{mib(used)} of {mib(total)}",
            "memory value": used,
        },
    )
