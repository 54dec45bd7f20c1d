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

from gpurelay import naming
from tests.integration.adapter_support import (
    BOTH,
    DEPLOY,
    GPUS,
    NODES,
    Prometheus,
    Published,
    Rule,
    gpu_key,
    load_yaml,
    parse_rules,
    published,
    relabelled,
    running_fleet,
    settled,
    share_pod,
)
from tests.integration.test_prometheus_e2e import PROXIED_JOB, UNIFIED_JOB

RULES = DEPLOY / "prometheus-adapter" / "rules.yaml"
HPA = DEPLOY / "kubernetes" / "hpa-gpu-example.yaml"
DASHBOARDS = sorted((DEPLOY / "grafana").glob("*.json"))
COUNTERS_49 = DEPLOY.parent / "edge_agent" / "data" / "default-counters-4.9.csv"

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
FB = ("DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_RESERVED")  # a GPU's total

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


@pytest.mark.parametrize(
    ("node_label", "naming"), [("Hostname", "4.8"), ("hostname", "4.8"), ("Hostname", "4.9")]
)
async def test_adapter_rules_and_dashboards_against_prometheus(
    prometheus_bin: Path, pod_on_two_gpus: None, tmp_path: Path, node_label: str, naming: str
) -> None:
    """``hostname``: gateway and agents with ``node_label = "hostname"``, the rules and
    dashboards with Hostname replaced as the operator guide says ("The node label").
    ``4.9``: agents on dcgm-exporter 4.9's names (the built-in 4.9 counters), read by the
    same rules and dashboards."""
    counters = COUNTERS_49 if naming == "4.9" else None
    async with running_fleet(
        prometheus_bin, tmp_path, node_label=node_label, counters_file=counters
    ) as prom:
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


async def check_adapter_rules(
    prom: Prometheus, node_label: str, truth: Published | None = None
) -> None:
    """Each rule's value, rendered for nodes, namespaces and pods, equals its aggregate
    computed here from the raw series: those in Prometheus, or ``truth`` (what the gateway
    published on its /metrics, when Prometheus holds every series twice). Every value is
    checked before the test fails, so its message lists all that are wrong."""
    rules = adapter_rules(node_label)
    when = settled()
    names = {r.series for r in rules} | set(FB)
    if truth is None:
        raw = await prom.raw(names, when)
    else:
        raw = {name: truth.get(name, []) for name in names}
    totals: dict[tuple[str, str, str], float] = {}
    for name in FB:
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
    wrong: list[str] = []
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
                    if not math.isclose(got[obj], value, rel_tol=1e-9):
                        wrong.append(
                            f"{rule.name} of {resource} {obj}: {got[obj]:g}, want {value:g}"
                            f"\n  {query}"
                        )
                    if rule.name == RATIO:
                        assert 0 < got[obj] < 1, (obj, got[obj])
                checked += 1
    assert not wrong, f"{len(wrong)} adapter rule values wrong:\n" + "\n".join(wrong)
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


JETSON_ONLY = "gpurelay_jetson_"  # the node dashboard's Jetson row (docs/jetson.md)


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
                if result or JETSON_ONLY in expr:  # this fleet has no Jetson: the truth
                    continue  # e2e checks those panels against its boards' files
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


# --- both scrape paths at once ------------------------------------------------------------------
#
# deploy/prometheus/prometheus.yml scrapes every series an agent exports twice: from the
# gateway's unified /metrics (job edge-gpu) and from the agent's own exporter through the
# gateway (job edge-gpu-proxied). Every query must still give one answer, the one the
# agent published, never the sum of the two copies.

ALERTS = DEPLOY / "prometheus" / "alerts.yml"
COMPAT = DEPLOY / "prometheus" / "per-container-exporter-compat.rules.yml"
# The agents' collection interval here: one collection, then nothing changes while the
# test compares what Prometheus holds with what the gateway and the agents publish.
STILL = 600.0
MIB = 1048576
NODE = "edge-a"  # the node dashboard's $node
RULES_DEADLINE = 20.0  # Prometheus ready -> every rule group evaluated


@pytest.mark.parametrize("node_label", ["Hostname", "hostname"])
async def test_both_scrape_paths_give_one_answer(
    prometheus_bin: Path, pod_on_two_gpus: None, tmp_path: Path, node_label: str
) -> None:
    """The shipped prometheus.yml (both jobs), the adapter rules, the dashboards, the
    recording and the alert rules in one real Prometheus, against what the gateway's and
    the agents' /metrics publish:

    * every series an agent exports is stored once per job, with the same labels but for
      ``job`` and ``instance`` (so ``max without (job, instance)`` makes it one again),
      and a device or process value is the published one through both;
    * every adapter rule gives the value computed from the gateway's /metrics;
    * every dashboard query gives the answer it gives on either job alone, and the pod
      panels the pods' sums computed from the gateway's /metrics;
    * used_gpu_memory (the exporter-compat recording rule) is ours x 1048576 per process;
    * every alert rule evaluates, and every label its text names is on its series
      through both jobs.

    ``hostname``: gateway and agents with ``node_label = "hostname"``, every shipped file
    run through the operator guide's sed ("The node label")."""
    async with running_fleet(
        prometheus_bin,
        tmp_path,
        node_label=node_label,
        config=BOTH,
        interval_seconds=STILL,
        rule_files=(COMPAT, ALERTS),
    ) as prom:
        assert prom.jobs == (UNIFIED_JOB, PROXIED_JOB)
        gateway = await published(prom.sources["gateway"])
        agents = {node: await published(prom.sources[node]) for node in NODES}
        problems = await check_one_series_per_source(prom, gateway, agents)
        problems += await check_dashboards_give_one_answer(prom, gateway, node_label)
        problems += await check_recording_rule(prom, gateway)
        problems += await check_alert_rules(prom, node_label)
        try:
            await check_adapter_rules(prom, node_label, truth=gateway)
        except AssertionError as exc:
            problems.append(str(exc))
        assert not problems, f"{len(problems)} wrong with both jobs:\n" + "\n".join(problems)


def without_value(labels: dict[str, str]) -> frozenset[tuple[str, str]]:
    """A published series' labels as Prometheus stores them: no value, no empty label."""
    return frozenset((k, v) for k, v in labels.items() if k != "value" and v)


async def check_one_series_per_source(
    prom: Prometheus, gateway: Published, agents: dict[str, Published]
) -> list[str]:
    """Each series of an agent's exporter is in Prometheus twice, once per job, with the
    labels the gateway publishes it with (the node stamped), nothing more; a device or
    process value is the same on the agent's and the gateway's /metrics, and stored
    through both jobs."""
    when = settled()
    problems: list[str] = []
    names = sorted({name for body in agents.values() for name in body})
    assert any(n.startswith("DCGM_CUSTOM_PROCESS_") for n in names), names
    for name in names:
        want = {without_value(s): float(s["value"]) for s in gateway.get(name, [])}
        assert want, f"{name}: on an agent's /metrics, not on the gateway's"
        counted = {
            frozenset(s["metric"].items()): s["value"][1]
            for s in await prom.at(f'count without (job, instance) ({{__name__="{name}"}})', when)
        }
        if set(counted) != set(want):
            extra = [dict(k) for k in set(counted) - set(want)]
            missing = [dict(k) for k in set(want) - set(counted)]
            problems.append(
                f"{name}: {len(counted)} label sets but job and instance, want {len(want)}"
                f" (the gateway's); not published {extra[:2]}; not stored {missing[:2]}"
            )
            continue
        if any(count != "2" for count in counted.values()):
            problems.append(f"{name}: series per label set {sorted(set(counted.values()))}")
        if not name.startswith("DCGM_"):
            continue  # the agent's own counters move between its exporter and its pushes
        for node, body in agents.items():
            for series in body.get(name, []):
                labels = without_value(series)
                if labels not in want or float(series["value"]) != want[labels]:
                    problems.append(
                        f"{name}{dict(labels)}: {series['value']} on {node}'s /metrics, "
                        f"{want.get(labels)} on the gateway's"
                    )
        for agg in ("min", "max"):
            for s in await prom.at(f'{agg} without (job, instance) ({{__name__="{name}"}})', when):
                labels = frozenset(s["metric"].items())
                if not math.isclose(float(s["value"][1]), want[labels], rel_tol=1e-9):
                    problems.append(
                        f"{name}{dict(labels)}: {agg} over the jobs {s['value'][1]}, "
                        f"published {want[labels]:g}"
                    )
    return problems


def only_job(expr: str, job: str) -> str:
    """``expr`` with every series selector restricted to ``job`` (they all have braces)."""
    return re.sub(r"\b([A-Za-z_:][\w:]*)\{", rf'\1{{job="{job}",', expr)


async def carries(prom: Prometheus, job: str, expr: str, when: float) -> bool:
    """Whether ``job`` has series of every metric ``expr`` reads (under dcgm-exporter 4.8's
    or 4.9's name: the shipped queries read a renamed field as ``(old or new * k)``)."""
    for metric in set(re.findall(r"\b([A-Za-z_:][\w:]*)\{", expr)):
        either = {metric, naming.name_in(metric, "4.8"), naming.name_in(metric, "4.9")}
        if not any([await prom.at(f'{m}{{job="{job}"}}', when) for m in sorted(either)]):
            return False
    return True


def answer(result: list[dict[str, Any]]) -> dict[frozenset[tuple[str, str]], float]:
    return {frozenset(s["metric"].items()): float(s["value"][1]) for s in result}


def same(a: dict[Any, float], b: dict[Any, float]) -> bool:
    return set(a) == set(b) and all(math.isclose(a[k], b[k], rel_tol=1e-9) for k in a)


def show(a: dict[frozenset[tuple[str, str]], float]) -> str:
    return "{" + ", ".join(f"{dict(sorted(k))}: {v:g}" for k, v in sorted(a.items(), key=str)) + "}"


def pod_truth(gateway: Published, node_label: str) -> dict[str, dict[Any, float]]:
    """What the node dashboard's pod panels (for NODE) and the cluster dashboard's top
    pods must show, computed from the process and device series the gateway publishes."""
    procs = gateway["DCGM_CUSTOM_PROCESS_MEM_USED"]
    sm = gateway["DCGM_CUSTOM_PROCESS_SM_UTIL"]
    totals: dict[tuple[str, str, str], float] = {}
    for name in FB:
        for s in gateway.get(name, []):
            key = gpu_key(s, node_label)
            totals[key] = totals.get(key, 0.0) + float(s["value"])

    def per_pod(series: list[dict[str, str]], labels: tuple[str, ...]) -> dict[Any, float]:
        out: dict[Any, float] = {}
        for s in series:
            if s.get("PodName") and (s["NodeName"] == NODE or "NodeName" in labels):
                key = frozenset((k, s[k]) for k in labels)
                out[key] = out.get(key, 0.0) + float(s["value"])
        return out

    pod = ("NamespaceName", "PodName")
    memory = per_pod(procs, pod)
    gpus: dict[Any, set[tuple[str, str, str]]] = {}
    for s in procs:
        if s.get("PodName") and s["NodeName"] == NODE:
            of = frozenset((k, s[k]) for k in pod)
            gpus.setdefault(of, set()).add(gpu_key(s, "NodeName"))
    everywhere = per_pod(procs, ("NodeName", *pod))
    top = dict(sorted(everywhere.items(), key=lambda kv: -kv[1])[:10])
    return {
        "SM utilisation by pod": per_pod(sm, pod),
        "GPU memory by pod": memory,
        "GPU memory ratio by pod": {
            k: v / sum(totals[g] for g in gpus[k]) for k, v in memory.items()
        },
        "Top pods by GPU memory": top,
        "GPU processes": {frozenset(): float(sum(1 for s in procs if s["NodeName"] == NODE))},
    }


async def check_dashboards_give_one_answer(
    prom: Prometheus, gateway: Published, node_label: str
) -> list[str]:
    """Every panel query gives, with both jobs stored, the answer it gives on each job
    alone (where that job has its series), and so does the query with every ``sum`` and
    ``avg`` replaced by ``count``: a value of 0 (the spool panels here: nothing waits in a
    spool) cannot show that a sum adds both copies, their count can. The pod panels give
    the pods' sums computed from the gateway's /metrics."""
    when = settled()
    truth = pod_truth(gateway, node_label)
    problems: list[str] = []
    checked: set[str] = set()
    for name, dashboard in dashboards(node_label).items():
        variables = dict(BUILTINS, datasource="unused")
        for v in dashboard["templating"]["list"]:
            if v["type"] == "datasource":
                continue
            if v["name"] == "node" and not v.get("multi"):
                variables["node"] = NODE
            else:
                variables[v["name"]] = v.get("allValue") or ".*"
        for title, target in targets(dashboard):
            expr = substitute(target["expr"], variables)
            what = f"{name} {title!r}"
            got = answer(await prom.at(expr, when))
            if not got and JETSON_ONLY in expr:
                continue  # no Jetson here: the truth e2e runs these on each job alone
            if not got:
                problems.append(f"{what}: no data: {expr}")
                continue
            problems += await as_on_one_job(prom, what, expr, when)
            counted = re.sub(r"\b(?:sum|avg)\b", "count", expr)
            if counted != expr:
                problems += await as_on_one_job(prom, f"{what} (counted)", counted, when)
            if title in truth and (title != "GPU processes" or expr.startswith("count(")):
                checked.add(title)
                if not same(got, truth[title]):
                    problems.append(
                        f"{what}: {show(got)}, published {show(truth[title])}\n  {expr}"
                    )
    assert checked == set(truth), f"panels not found: {set(truth) - checked}"
    return problems


async def as_on_one_job(prom: Prometheus, what: str, expr: str, when: float) -> list[str]:
    """``expr`` answers as it does with its selectors restricted to each job alone, where
    that job has the series and an answer (one of them at least)."""
    got = answer(await prom.at(expr, when))
    problems = []
    compared = 0
    for job in prom.jobs:
        if not await carries(prom, job, expr, when):
            continue  # e.g. gpurelay_node_*: the gateway's own, unified only
        alone = answer(await prom.at(only_job(expr, job), when))
        if not alone:
            continue  # e.g. increase() of a counter the gateway has one sample of
        compared += 1
        if not same(got, alone):
            problems.append(f"{what}: {show(got)}, on job {job} alone {show(alone)}\n  {expr}")
    if not compared:
        problems.append(f"{what}: no job alone answers {expr}")
    return problems


async def check_recording_rule(prom: Prometheus, gateway: Published) -> list[str]:
    """used_gpu_memory: one series per job and process, ours x 1048576 through both."""
    want = {
        (s["NodeName"], s["ProcessId"]): float(s["value"]) * MIB
        for s in gateway["DCGM_CUSTOM_PROCESS_MEM_USED"]
    }

    async def recorded() -> str:
        counts = await prom.query("count without (job, instance) (used_gpu_memory)")
        per_process = {s["value"][1] for s in counts}
        return "" if len(counts) == len(want) and per_process == {"2"} else f"{counts}"

    await prom.until(
        "used_gpu_memory of every process through both jobs", recorded, rules_deadline()
    )
    problems = []
    for agg in ("min", "max"):
        got = {
            (s["metric"]["NodeName"], s["metric"]["pid"]): float(s["value"][1])
            for s in await prom.at(f"{agg} without (job, instance) (used_gpu_memory)", settled())
        }
        if not same(got, want):
            problems.append(f"used_gpu_memory, {agg} over the jobs: {got}, published {want}")
    return problems


def rules_deadline() -> float:
    return time.monotonic() + RULES_DEADLINE


async def check_alert_rules(prom: Prometheus, node_label: str) -> list[str]:
    """Every alert rule evaluates; every label its text names (``$labels.X``) is set on
    every series of the metrics it reads, through both jobs, so an alert from either
    names its node (and GPU, reason, ...)."""

    async def evaluated() -> str:
        r = await prom.client.get("/api/v1/rules")
        r.raise_for_status()
        groups = r.json()["data"]["groups"]
        rules = [rule for g in groups for rule in g["rules"]]
        late = [x["name"] for x in rules if x["lastEvaluation"].startswith("0001-")]
        if late or not rules:
            return f"not evaluated yet: {late}"
        bad = [f"{x['name']}: {x.get('lastError')}" for x in rules if x["health"] != "ok"]
        assert not bad, bad
        return ""

    await prom.until("every rule evaluated", evaluated, rules_deadline())
    when = settled()
    problems = []
    (doc,) = load_yaml(ALERTS, node_label)
    for group in doc["groups"]:
        for rule in group["rules"]:
            text = json.dumps([rule.get("labels", {}), rule.get("annotations", {})])
            named = set(re.findall(r"\$labels\.(\w+)", text))
            for metric in sorted(set(re.findall(r"\b(?:DCGM|gpurelay)_\w+", rule["expr"]))):
                for job in prom.jobs:
                    for s in await prom.at(f'{metric}{{job="{job}"}}', when):
                        unset = sorted(x for x in named if not s["metric"].get(x))
                        if unset:
                            problems.append(
                                f"alert {rule['alert']} on {metric} of job {job}: "
                                f"no {', '.join(unset)} in {s['metric']}"
                            )
                            break
    return problems
