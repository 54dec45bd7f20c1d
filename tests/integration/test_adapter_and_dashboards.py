"""prometheus-adapter rules, the HPA example and the Grafana dashboards (deploy/).

Statically: the shapes prometheus-adapter, Kubernetes and Grafana expect. Then against a
real ``prometheus`` binary that scrapes a real gateway with two agents
(:func:`tests.integration.adapter_support.running_fleet`):

* every adapter rule's ``metricsQuery`` is rendered the way prometheus-adapter renders it
  (:meth:`~tests.integration.adapter_support.Rule.render`) for nodes, namespaces and
  pods, run, and compared with the same aggregate computed here from the raw series (the
  GPU memory ratio included);
* every panel query of both dashboards, with the variables substituted, returns data
  (the spool backlog panels included: the agents export gpurelay_agent_spool_*).
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.adapter_support import (
    DEPLOY,
    GPUS,
    NODES,
    Prometheus,
    Rule,
    gpu_key,
    load_yaml,
    parse_rules,
    relabelled,
    running_fleet,
    settled,
    share_pod,
)

RULES = DEPLOY / "prometheus-adapter" / "rules.yaml"
HPA = DEPLOY / "kubernetes" / "hpa-gpu-example.yaml"
DASHBOARDS = sorted((DEPLOY / "grafana").glob("*.json"))

# What the rules must expose (the ACK names): metric -> resource -> the label it maps from.
DEVICE = {"node": "Hostname"}
PROCESS = {"node": "NodeName", "namespace": "NamespaceName", "pod": "PodName"}
EXPECTED_RULES = {
    "DCGM_FI_DEV_GPU_UTIL": DEVICE,
    "DCGM_FI_DEV_FB_USED": DEVICE,
    "DCGM_CUSTOM_PROCESS_SM_UTIL": PROCESS,
    "DCGM_CUSTOM_PROCESS_MEM_USED": PROCESS,
    "DCGM_CUSTOM_PROCESS_GPU_MEM_USED_RATIO": {"namespace": "NamespaceName", "pod": "PodName"},
}
RATIO = "DCGM_CUSTOM_PROCESS_GPU_MEM_USED_RATIO"

# Device panels must work on a stock dcgm-exporter: only its labels.
DCGM_EXPORTER_LABELS = {"Hostname", "gpu", "UUID", "modelName"}
# Exported by the agent's next release (the durable spool). Queries reading them may be
# empty while Prometheus has no such series at all; see the module docstring.
# Grafana's built-in variables, as Grafana would fill them for a recent time range.
BUILTINS = {
    "__rate_interval": "1m",
    "__interval": "15s",
    "__interval_ms": "15000",
    "__range": "1h",
    "__range_s": "3600",
    "__range_ms": "3600000",
}

QUERY_DEADLINE = 15.0  # then every dashboard query answered


# --- loading ------------------------------------------------------------------------------------


def adapter_rules(node_label: str = "Hostname") -> list[Rule]:
    docs = load_yaml(RULES, node_label)
    assert len(docs) == 1, "one YAML document"
    config = docs[0]
    assert set(config) == {"rules"}, f"custom-metrics rules only, got {sorted(config)}"
    return parse_rules(config["rules"])


def dashboards(node_label: str = "Hostname") -> dict[str, dict[str, Any]]:
    return {path.name: json.loads(relabelled(path.read_text(), node_label)) for path in DASHBOARDS}


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' nested panels (collapsed rows) included."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def targets(dashboard: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            yield panel["title"], target


def variable_query(variable: dict[str, Any]) -> str:
    query = variable["query"]
    return str(query["query"] if isinstance(query, dict) else query)


def substitute(expr: str, variables: dict[str, str]) -> str:
    """``expr`` with Grafana's ``$var`` and ``${var}`` / ``${var:format}`` filled in.
    ``$1`` (label_replace) is not a variable: names start with a letter or ``_``."""

    def value(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        assert name in variables, f"unknown variable ${name} in {expr}"
        return variables[name]

    return re.sub(r"\$\{([A-Za-z_]\w*)(?::\w+)?\}|\$([A-Za-z_]\w*)", value, expr)


def labels_used(expr: str) -> set[str]:
    """Label names in matchers, by/without and on/ignoring/group_* lists of ``expr``."""
    used: set[str] = set()
    for selector in re.findall(r"\{([^}]*)\}", expr):
        used.update(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)\s*\"", selector))
    for group in re.findall(
        r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", expr
    ):
        used.update(x.strip() for x in group.split(",") if x.strip())
    return used


# --- statically ---------------------------------------------------------------------------------


def test_adapter_rules_expose_the_ack_metrics_with_our_labels() -> None:
    rules = adapter_rules()
    exposed = {rule.name: rule.labels for rule in rules}
    assert exposed == EXPECTED_RULES
    for rule in rules:
        # Every resource label appears in the seriesQuery's series (checked against real
        # series below) and the query renders for each resource.
        for resource in rule.labels:
            namespace = "ns" if resource == "pod" else None
            one = rule.render(resource, ["x"], namespace)
            many = rule.render(resource, ["x", "y"], namespace)
            assert f'{rule.labels[resource]}="x"' in one
            assert f'{rule.labels[resource]}=~"x|y"' in many
    ratio = next(r for r in rules if r.name == RATIO)
    assert ratio.series == "DCGM_CUSTOM_PROCESS_MEM_USED"
    # The join: process series (NodeName) against device series (Hostname) per GPU.
    assert "label_replace(" in ratio.metrics_query
    assert "on (Hostname, UUID, GPU_I_ID) group_left ()" in ratio.metrics_query


def test_hpa_example_scales_a_deployment_on_an_adapter_pod_metric() -> None:
    docs = load_yaml(HPA)
    kinds = [(d["apiVersion"], d["kind"]) for d in docs]
    assert kinds == [("apps/v1", "Deployment"), ("autoscaling/v2", "HorizontalPodAutoscaler")]
    deployment, hpa = docs

    spec = deployment["spec"]
    template_labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= template_labels.items()
    containers = spec["template"]["spec"]["containers"]
    assert containers, "a container"
    assert any(c["resources"]["limits"].get("nvidia.com/gpu") for c in containers)
    for c in containers:
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", c["name"]), c["name"]

    hspec = hpa["spec"]
    assert hspec["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": deployment["metadata"]["name"],
    }
    assert 1 <= hspec.get("minReplicas", 1) <= hspec["maxReplicas"]
    pod_metrics = {rule.name for rule in adapter_rules() if "pod" in rule.labels}
    assert hspec["metrics"], "at least one metric"
    for metric in hspec["metrics"]:
        assert metric["type"] == "Pods", metric
        assert set(metric) == {"type", "pods"}, metric
        assert metric["pods"]["metric"]["name"] in pod_metrics
        target = metric["pods"]["target"]
        # autoscaling/v2 Pods metrics: AverageValue only, a quantity (a string here).
        assert target == {"type": "AverageValue", "averageValue": target["averageValue"]}
        assert re.fullmatch(r"\d+(\.\d+)?m?", target["averageValue"]), target
    assert any(
        m["pods"]["metric"]["name"] == "DCGM_CUSTOM_PROCESS_SM_UTIL" for m in hspec["metrics"]
    )


@pytest.mark.parametrize("name", [p.name for p in DASHBOARDS])
def test_dashboard_is_importable_and_uses_a_datasource_variable(name: str) -> None:
    dashboard = dashboards()[name]
    assert dashboard["schemaVersion"] >= 36
    assert dashboard["uid"] and dashboard["title"]
    assert dashboard.get("id") is None, "an exported dashboard carries no database id"
    # Import asks for DS_PROMETHEUS and makes it the datasource variable's default.
    inputs = {i["name"]: i for i in dashboard["__inputs"]}
    assert inputs["DS_PROMETHEUS"]["type"] == "datasource"
    assert inputs["DS_PROMETHEUS"]["pluginId"] == "prometheus"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    ds = variables["datasource"]
    assert (ds["type"], ds["query"]) == ("datasource", "prometheus")
    assert ds["current"]["value"] == "${DS_PROMETHEUS}"
    assert json.dumps(dashboard).count("${DS_PROMETHEUS}") == 1, "panels use ${datasource}"
    uses_ds = {"type": "prometheus", "uid": "${datasource}"}
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"] == uses_ds, v["name"]
            assert variable_query(v).startswith("label_values("), v["name"]
    assert variables["node"]["definition"].endswith(", Hostname)")

    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    for panel in panels(dashboard):
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == uses_ds, panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == uses_ds, panel["title"]
            assert target["expr"].strip(), panel["title"]
    for title, target in targets(dashboard):
        expr = target["expr"]
        if "DCGM_FI_DEV_" in expr and "DCGM_CUSTOM_" not in expr:
            extra = labels_used(expr) - DCGM_EXPORTER_LABELS
            assert not extra, f"device panel {title!r} uses labels {extra}: {expr}"


# --- against a real Prometheus ------------------------------------------------------------------


@pytest.fixture
def pod_on_two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    share_pod(monkeypatch)


@pytest.mark.parametrize("node_label", ["Hostname", "hostname"])
async def test_adapter_rules_and_dashboards_against_prometheus(
    prometheus_bin: Path, pod_on_two_gpus: None, tmp_path: Path, node_label: str
) -> None:
    """``hostname``: gateway and agents with ``node_label = "hostname"``, the rules and
    dashboards with Hostname replaced as the operator guide says ("The node label")."""
    async with running_fleet(prometheus_bin, tmp_path, node_label=node_label) as prom:
        ratio_panel = await check_dashboards(prom, node_label)
        await check_adapter_rules(prom, node_label)
        await check_ratio_panel(prom, ratio_panel, node_label)


# --- the adapter rules --------------------------------------------------------------------------


def aggregate(rule: Rule, values: list[float]) -> float:
    outer = rule.metrics_query.lstrip()
    if outer.startswith("avg("):
        return sum(values) / len(values)
    assert outer.startswith("sum("), f"no expected value for {outer[:20]}..."
    return sum(values)


async def check_adapter_rules(prom: Prometheus, node_label: str) -> None:
    rules = adapter_rules(node_label)
    when = settled()
    raw = await prom.raw(
        {r.series for r in rules}
        | {"DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_RESERVED"},
        when,
    )
    totals: dict[tuple[str, str, str], float] = {}
    for name in ("DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_RESERVED"):
        for s in raw[name]:
            key = gpu_key(s, node_label)
            totals[key] = totals.get(key, 0.0) + float(s["value"])
    assert len(totals) == len(NODES) * GPUS, totals

    procs = raw["DCGM_CUSTOM_PROCESS_MEM_USED"]
    pods_by_ns: dict[str, set[str]] = {}
    for s in procs:
        if s.get("PodName"):
            pods_by_ns.setdefault(s["NamespaceName"], set()).add(s["PodName"])
    assert {"ml-serving", "research"} <= set(pods_by_ns), pods_by_ns
    serving = sorted(pods_by_ns["ml-serving"])
    assert len(serving) >= 2, serving
    # The pod of SHARED_WITH_FIRST: three processes, two of them on one GPU.
    gpus_of: dict[str, list[tuple[str, str, str]]] = {}
    for s in procs:
        if s.get("PodName"):
            gpus_of.setdefault(s["PodName"], []).append(gpu_key(s, "NodeName"))
    shared = [pod for pod, gpus in gpus_of.items() if len(gpus) == 3 and len(set(gpus)) == 2]
    assert len(shared) == 1 and shared[0] in serving, gpus_of

    # (resource, names, namespace): one object and several, as the adapter asks.
    cases = {
        "node": [(["edge-a"], None), (sorted(NODES), None)],
        "namespace": [(["ml-serving"], None), (["ml-serving", "research"], None)],
        "pod": [(shared, "ml-serving"), (serving, "ml-serving")],
    }
    checked = 0
    for rule in rules:
        # Discovery: the seriesQuery finds series that carry every mapped label.
        found = await prom.series(rule.series_query)
        assert found, f"seriesQuery {rule.series_query} finds nothing"
        for label in rule.labels.values():
            assert any(s.get(label) for s in found), f"{rule.series_query}: no {label}"

        for resource, label in rule.labels.items():
            for names, namespace in cases[resource]:
                query = rule.render(resource, names, namespace)
                got = {
                    s["metric"].get(label, ""): float(s["value"][1])
                    for s in await prom.at(query, when)
                }
                want = expected(rule, resource, names, namespace, raw, totals)
                assert set(got) == set(want), (
                    f"{rule.name} for {resource} {names}: series for {sorted(got)}, "
                    f"want {sorted(want)}\n{query}"
                )
                for obj, value in want.items():
                    assert math.isclose(got[obj], value, rel_tol=1e-9), (
                        f"{rule.name} of {resource} {obj}: {got[obj]}, want {value}\n{query}"
                    )
                    if rule.name == RATIO:
                        assert 0 < got[obj] < 1, (obj, got[obj])
                checked += 1
    assert checked == sum(len(cases[r]) for rule in rules for r in rule.labels)


def expected(
    rule: Rule,
    resource: str,
    names: list[str],
    namespace: str | None,
    raw: dict[str, list[dict[str, str]]],
    totals: dict[tuple[str, str, str], float],
) -> dict[str, float]:
    """The rule's value per object, computed here from the raw series."""
    label = rule.labels[resource]
    want: dict[str, float] = {}
    for name in names:
        mine = [
            s
            for s in raw[rule.series]
            if s.get(label) == name
            and (namespace is None or s.get(rule.labels["namespace"]) == namespace)
        ]
        assert mine, f"no {rule.series} series for {resource} {name}"
        values = [float(s["value"]) for s in mine]
        if rule.name != RATIO:
            want[name] = aggregate(rule, values)
            continue
        # used by the object's processes / total memory of the GPUs they run on, each once
        gpus = {gpu_key(s, "NodeName") for s in mine}
        want[name] = sum(values) / sum(totals[g] for g in gpus)
    return want


# --- the dashboards -----------------------------------------------------------------------------


async def check_dashboards(prom: Prometheus, node_label: str) -> str:
    """Run every panel query; returns the node dashboard's pod memory ratio query."""
    ratio_panel = ""
    for name, dashboard in dashboards(node_label).items():
        variables = dict(BUILTINS, datasource="unused")
        for v in dashboard["templating"]["list"]:
            if v["type"] == "datasource":
                continue
            # The node dashboard looks at one node; the rest at "All", as they open.
            if v["name"] == "node" and not v.get("multi"):
                variables["node"] = "edge-a"
            else:
                variables[v["name"]] = v.get("allValue") or ".*"
        await check_variables(prom, name, dashboard, variables)

        queries = [(title, substitute(t["expr"], variables)) for title, t in targets(dashboard)]

        async def answered(queries: list[tuple[str, str]] = queries) -> str:
            empty = []
            for title, expr in queries:
                result = await prom.query(expr)  # a PromQL error fails right here
                if result:
                    continue
                empty.append(f"{title!r}: {expr}")
            return "no data from\n  " + "\n  ".join(empty) if empty else ""

        await prom.until(
            f"every query of {name} to return data", answered, time.monotonic() + QUERY_DEADLINE
        )

        for title, expr in queries:
            if title == "GPU memory ratio by pod":
                ratio_panel = expr
    assert ratio_panel, "no panel 'GPU memory ratio by pod'"
    return ratio_panel


async def check_variables(
    prom: Prometheus, name: str, dashboard: dict[str, Any], variables: dict[str, str]
) -> None:
    for v in dashboard["templating"]["list"]:
        if v["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable_query(v))
        assert m, f"{name} ${v['name']}: {variable_query(v)}"
        selector, label = substitute(m.group(1), variables), m.group(2)
        values = {s.get(label, "") for s in await prom.series(selector)} - {""}
        assert values, f"{name} ${v['name']}: no values of {label} in {selector}"
        if v["name"] == "node":
            assert values == set(NODES), values


async def check_ratio_panel(prom: Prometheus, expr: str, node_label: str) -> None:
    """The dashboard's ratio panel computes what the adapter's ratio rule does."""
    when = settled()
    panel = {
        (s["metric"]["NamespaceName"], s["metric"]["PodName"]): float(s["value"][1])
        for s in await prom.at(expr, when)
    }
    rule = next(r for r in adapter_rules(node_label) if r.name == RATIO)
    pods = sorted(panel)
    assert pods, expr
    for namespace, pod in pods:
        adapter = await prom.at(rule.render("pod", [pod], namespace), when)
        assert len(adapter) == 1, adapter
        assert math.isclose(float(adapter[0]["value"][1]), panel[namespace, pod], rel_tol=1e-9)
