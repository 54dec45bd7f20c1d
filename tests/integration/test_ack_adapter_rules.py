"""Alibaba ACK's five prometheus-adapter rules for GPU autoscaling, exactly as its
documentation writes them (``tests/fixtures/ack/gpu-hpa-adapter-rules.yaml``, copied
verbatim), against a real Prometheus that scrapes a gateway fed by simulated agents
(:func:`tests.integration.adapter_support.running_fleet`, the same fleet and rule
evaluation as the test of our own rules).

For each rule, as prometheus-adapter would use it:

* discovery: its ``seriesQuery`` finds series that carry every label the rule maps to a
  resource (the adapter registers nothing for a resource whose label is missing: that
  was ACK's two device rules here before device series carried ``NodeName``);
* its ``metricsQuery``, rendered for one and for several nodes, namespaces or pods,
  returns a value for each object, equal to the rule's aggregation recomputed here from
  the raw series fetched at the same evaluation time.

All five are checked before the test fails, so its message says how many work.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from tests.integration.adapter_support import (
    NODES,
    SHARED_NODE,
    Prometheus,
    Rule,
    load_yaml,
    parse_rules,
    running_fleet,
    settled,
    share_pod,
)

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "ack" / "gpu-hpa-adapter-rules.yaml"
PROCESS = {"namespace": "NamespaceName", "node": "NodeName", "pod": "PodName"}
ACK_RULES = [  # (custom metric, resource -> label), in the page's order
    ("DCGM_FI_DEV_GPU_UTIL", {"node": "NodeName"}),
    ("DCGM_CUSTOM_PROCESS_SM_UTIL", PROCESS),
    ("DCGM_FI_DEV_FB_USED", {"node": "NodeName"}),
    ("DCGM_CUSTOM_PROCESS_MEM_USED", PROCESS),
    ("DCGM_CUSTOM_PROCESS_GPU_MEM_USED_RATIO", {"namespace": "NamespaceName", "pod": "PodName"}),
]
# The shapes of ACK's metricsQuery: an aggregation of the rule's series by the resource's
# label, and for the ratio that divided by the sum of another metric by the same label.
SHAPE = re.compile(
    r"(?P<agg>avg|sum)\(<<\.Series>>\{<<\.LabelMatchers>>\}\) by \(<<\.GroupBy>>\)"
    r"(?: / sum\((?P<divisor>\w+)\{\}\) by \(<<\.GroupBy>>\))?"
)
Raw = dict[str, list[dict[str, str]]]


def ack_rules() -> list[Rule]:
    (rules,) = load_yaml(FIXTURE)  # a bare list: what goes under the chart's `custom:`
    return parse_rules(rules)


def test_the_fixture_holds_acks_five_rules() -> None:
    rules = ack_rules()
    assert [(r.name, r.labels) for r in rules] == ACK_RULES
    for rule in rules:
        assert SHAPE.fullmatch(rule.metrics_query), rule.metrics_query
    assert "DCGM_CUSTOM_CONTAINER_MEM_ALLOCATED" in rules[4].metrics_query


def recompute(
    rule: Rule, resource: str, names: list[str], namespace: str | None, raw: Raw
) -> dict[str, float]:
    """The rule's value per object, from the raw series: what PromQL should answer."""
    shape = SHAPE.fullmatch(rule.metrics_query)
    assert shape, rule.metrics_query
    label = rule.labels[resource]
    groups: dict[str, list[float]] = {}
    for s in raw[rule.series]:
        if s.get(label, "") in names and (
            namespace is None or s.get(rule.labels["namespace"], "") == namespace
        ):
            groups.setdefault(s[label], []).append(float(s["value"]))
    if shape["agg"] == "avg":
        want = {obj: sum(values) / len(values) for obj, values in groups.items()}
    else:
        want = {obj: sum(values) for obj, values in groups.items()}
    if shape["divisor"]:  # `/ sum(OTHER{}) by (label)`: one-to-one on the label
        divisor: dict[str, float] = {}
        for s in raw[shape["divisor"]]:
            key = s.get(label, "")
            divisor[key] = divisor.get(key, 0.0) + float(s["value"])
        want = {obj: value / divisor[obj] for obj, value in want.items() if obj in divisor}
    return want


def objects(raw: Raw) -> dict[str, list[tuple[list[str], str | None]]]:
    """(names, namespace) per resource, one object and several, as the adapter asks: the
    nodes; the namespaces with pods; the pod with three processes on two GPUs (see
    share_pod), then every pod of its namespace."""
    pods: dict[str, set[str]] = {}
    processes: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for s in raw["DCGM_CUSTOM_PROCESS_MEM_USED"]:
        if s.get("PodName"):
            pods.setdefault(s["NamespaceName"], set()).add(s["PodName"])
            gpu = (s["NodeName"], s["UUID"])
            processes.setdefault((s["NamespaceName"], s["PodName"]), []).append(gpu)
    (shared,) = [pod for pod, gpus in processes.items() if len(gpus) == 3 and len(set(gpus)) == 2]
    namespace, pod = shared
    assert len(pods) >= 2 and len(pods[namespace]) >= 2, pods
    return {
        "node": [([SHARED_NODE], None), (sorted(NODES), None)],
        "namespace": [([namespace], None), (sorted(pods), None)],
        "pod": [([pod], namespace), (sorted(pods[namespace]), namespace)],
    }


async def check_rule(prom: Prometheus, rule: Rule, raw: Raw, when: float) -> str:
    """'' when the rule works as the adapter would use it, else what is wrong."""
    found = await prom.series(rule.series_query)
    if not found:
        return f"seriesQuery {rule.series_query} finds nothing"
    for resource, label in rule.labels.items():
        if not any(s.get(label) for s in found):
            return f"seriesQuery {rule.series_query}: no series has {label} ({resource})"
    cases = objects(raw)
    for resource in rule.labels:
        for names, namespace in cases[resource]:
            query = rule.render(resource, names, namespace)
            label = rule.labels[resource]
            got = {
                s["metric"].get(label, ""): float(s["value"][1]) for s in await prom.at(query, when)
            }
            want = recompute(rule, resource, names, namespace, raw)
            if not got:
                return f"no data for {resource} {names}: {query}"
            if set(got) != set(want):
                return f"{resource} {names}: values for {sorted(got)}, want {sorted(want)}: {query}"
            for obj, value in want.items():
                if not math.isclose(got[obj], value, rel_tol=1e-9):
                    return f"{resource} {obj}: {got[obj]}, recomputed {value}: {query}"
    return ""


@pytest.mark.parametrize("allocation", ["nvidia", "gpushare"])
async def test_acks_five_rules_verbatim_return_their_aggregation(
    prometheus_bin: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, allocation: str
) -> None:
    """``allocation``: what the agents' simulated kubelet hands out (whole GPUs through
    NVIDIA's device plugin, or ACK GPU sharing's ``aliyun.com/gpu-mem``), which is what
    the ratio rule divides by (``DCGM_CUSTOM_CONTAINER_MEM_ALLOCATED``)."""
    share_pod(monkeypatch)  # a pod with processes on two GPUs
    rules = ack_rules()
    divisors = {
        m["divisor"] for r in rules if (m := SHAPE.fullmatch(r.metrics_query)) and m["divisor"]
    }
    async with running_fleet(prometheus_bin, tmp_path, pod_resources=allocation) as prom:
        when = settled()
        raw = await prom.raw({r.series for r in rules} | divisors, when)
        problems = {rule.name: await check_rule(prom, rule, raw, when) for rule in rules}
    failed = {name: problem for name, problem in problems.items() if problem}
    assert not failed, f"{len(rules) - len(failed)} of {len(rules)} ACK rules work:\n" + "\n".join(
        f"  {name}: {problem}" for name, problem in failed.items()
    )
