"""prometheus-adapter rule evaluation against a real Prometheus, shared by the tests of our
rules (test_adapter_and_dashboards.py) and of ACK's rules verbatim (test_ack_adapter_rules.py).

* :func:`parse_rules` reads custom-metrics rules as prometheus-adapter does (seriesQuery,
  ``name`` matches/as, resource overrides, metricsQuery) and :meth:`Rule.render` builds
  a ``metricsQuery`` the way the adapter does (pkg/naming/metrics_query.go:
  ``<<.LabelMatchers>>`` is the namespace matcher, if any, then ``LABEL="name"`` or
  ``LABEL=~"a|b"``; ``<<.GroupBy>>`` is the resource's label) for nodes, namespaces and
  pods;
* :func:`running_fleet` runs a real gateway with two agents of two simulated GPUs each,
  whose GPU processes live in a fake host tree with Kubernetes pods, and a real
  ``prometheus`` binary (Debian package ``prometheus``) that scrapes the gateway with the
  shipped ``deploy/prometheus/unified.yml``; it yields once both nodes' GPU and pod series
  are stored.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from edge_agent import simhost
from edge_agent.config import AgentConfig
from harness.fleet import agent_config, gateway_config, make_pki, running_agent, running_gateway
from harness.prometheus import running_prometheus
from harness.waiting import wait_for
from tests.integration.test_prometheus_e2e import GATEWAY, UNIFIED_JOB, PromQL, substituted

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
UNIFIED = DEPLOY / "prometheus" / "unified.yml"
TEMPLATE_FIELDS = {"Series", "LabelMatchers", "GroupBy", "LabelValuesByName", "GroupBySlice"}

NODES = {"edge-a": 11, "edge-b": 12}  # node -> simulator seed (distinct GPUs and pods)
GPUS = 2
# On edge-a, the simulated processes 1 and 4 join process 0's container: one pod with two
# processes on GPU 0 and one on GPU 1 (the simulator puts process i on GPU i % GPUS), so a
# rule must count each GPU's memory once per pod, and a pod's GPUs are summed.
SHARED_NODE, SHARED_WITH_FIRST = "edge-a", (1, 4)
READY_DEADLINE = 45.0  # Prometheus start -> GPU and pod series of both nodes seen


def relabelled(text: str, node_label: str) -> str:
    """A shipped rules file or dashboard for a fleet with ``node_label`` (the operator
    guide's ``sed 's/Hostname/hostname/g'``, "The node label")."""
    return text.replace("Hostname", node_label)


def load_yaml(path: Path, node_label: str = "Hostname") -> list[Any]:
    """The YAML documents of ``path``; PyYAML comes with the test extras."""
    text = relabelled(path.read_text(encoding="utf-8"), node_label)
    return [doc for doc in yaml.safe_load_all(text) if doc is not None]


@dataclasses.dataclass(frozen=True)
class Rule:
    series: str  # the series name seriesQuery finds
    series_query: str
    name: str  # the custom metric the adapter exposes
    labels: dict[str, str]  # resource -> Prometheus label
    metrics_query: str

    def render(self, resource: str, names: list[str], namespace: str | None = None) -> str:
        """``metricsQuery`` as prometheus-adapter builds it for these objects."""
        matchers = []
        if namespace is not None:
            matchers.append(f'{self.labels["namespace"]}="{namespace}"')
        label = self.labels[resource]
        if len(names) == 1:
            matchers.append(f'{label}="{names[0]}"')
        else:
            matchers.append(f'{label}=~"{"|".join(names)}"')
        values = {"Series": self.series, "LabelMatchers": ",".join(matchers), "GroupBy": label}
        query = re.sub(r"<<\s*\.(\w+)\s*>>", lambda m: values[m.group(1)], self.metrics_query)
        assert "<<" not in query and ">>" not in query, query
        return query


def parse_rules(raw_rules: list[dict[str, Any]]) -> list[Rule]:
    """Custom-metrics rules (the list under ``rules:``, or the Helm chart's ``custom:``)."""
    rules = []
    for raw in raw_rules:
        assert set(raw) <= {"seriesQuery", "seriesFilters", "resources", "name", "metricsQuery"}
        m = re.fullmatch(r"([A-Za-z_:][\w:]*)(\{.*\})?", raw["seriesQuery"])
        assert m, f"seriesQuery {raw['seriesQuery']!r} is not a series selector"
        series = m.group(1)
        name = series
        if "name" in raw:
            assert set(raw["name"]) == {"matches", "as"}, raw["name"]
            assert re.search(raw["name"]["matches"], series), raw["name"]
            # Go's ${1} / $1 as Python's \1
            repl = re.sub(r"\$\{?(\d+)\}?", r"\\\1", raw["name"]["as"])
            name = re.sub(raw["name"]["matches"], repl, series)
        resources = raw["resources"]
        assert set(resources) == {"overrides"}, "explicit label -> resource overrides only"
        labels = {}
        for label, target in resources["overrides"].items():
            assert set(target) <= {"group", "resource"}, target
            assert target["resource"] in {"node", "namespace", "pod"}, target
            labels[target["resource"]] = label
        query = raw["metricsQuery"]
        fields = set(re.findall(r"<<\s*\.(\w+)\s*>>", query))
        assert fields <= TEMPLATE_FIELDS, fields
        assert {"Series", "LabelMatchers", "GroupBy"} <= fields, query
        assert query.count("(") == query.count(")"), query
        rules.append(Rule(series, raw["seriesQuery"], name, labels, query))
    return rules


def gpu_key(labels: dict[str, str], node_label: str) -> tuple[str, str, str]:
    return (labels[node_label], labels["UUID"], labels.get("GPU_I_ID", ""))


class Prometheus(PromQL):
    async def at(self, expr: str, when: float) -> list[dict[str, Any]]:
        r = await self.client.get("/api/v1/query", params={"query": expr, "time": f"{when:.3f}"})
        assert r.status_code == 200, f"{expr}\n-> {r.status_code} {r.text}"
        doc = r.json()
        assert doc["status"] == "success", doc
        result: list[dict[str, Any]] = doc["data"]["result"]
        return result

    async def series(self, match: str) -> list[dict[str, str]]:
        r = await self.client.get(
            "/api/v1/series", params={"match[]": match, "start": f"{time.time() - 300:.0f}"}
        )
        r.raise_for_status()
        result: list[dict[str, str]] = r.json()["data"]
        return result

    async def raw(self, names: set[str], when: float) -> dict[str, list[dict[str, str]]]:
        """Every series of ``names`` at ``when``: its labels and ``value``."""
        return {
            name: [s["metric"] | {"value": s["value"][1]} for s in await self.at(name, when)]
            for name in names
        }


def share_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rewrite the fake host tree the simulator builds (see SHARED_WITH_FIRST), and what
    its simulated kubelet allocates (edge_agent.simkubelet, where it is on)."""
    build = simhost.build

    def shared_build(root: Path, pids: Sequence[int], seed: int = 0) -> simhost.FakeHost:
        host = build(root, pids, seed)
        if seed != NODES[SHARED_NODE]:
            return host
        first = (host.proc_root / str(pids[0]) / "cgroup").read_text()
        pods = dict(host.pods)
        for i in SHARED_WITH_FIRST:
            (host.proc_root / str(pids[i]) / "cgroup").write_text(first)
            pods[pids[i]] = pods[pids[0]]
        return dataclasses.replace(host, pods=pods)

    monkeypatch.setattr(simhost, "build", shared_build)


@asynccontextmanager
async def running_fleet(
    prometheus_bin: Path,
    tmp_path: Path,
    *,
    pod_resources: str = "",
    node_label: str = "Hostname",
    counters_file: Path | None = None,
) -> AsyncIterator[Prometheus]:
    """The gateway, both agents and Prometheus; ``pod_resources``: the agents' simulated
    kubelet (``[simulate] pod_resources``: "nvidia" or "gpushare"), none by default;
    ``node_label``: the gateway's and the agents' setting; ``counters_file``: the agents'
    (the built-in one by default)."""
    pki = make_pki(tmp_path)
    gateway = gateway_config(pki, node_label=node_label)
    async with running_gateway(gateway) as gw:
        configs: list[AgentConfig] = []
        for node, seed in NODES.items():
            cfg = agent_config(pki, node, gw, gpus=GPUS)
            simulate = dataclasses.replace(cfg.simulate, seed=seed, pod_resources=pod_resources)
            configs.append(
                dataclasses.replace(
                    cfg, simulate=simulate, node_label=node_label, counters_file=counters_file
                )
            )
        async with running_agent(configs[0]), running_agent(configs[1]):
            await wait_for(
                lambda: set(NODES) <= set(gw.registry.states(time.time())),
                what="both agents to connect",
            )
            config = tmp_path / "prometheus.yml"
            config.write_text(
                substituted(
                    UNIFIED.read_text(),
                    {
                        GATEWAY: f"127.0.0.1:{gw.http_port}",
                        "scrape_interval: 15s": "scrape_interval: 1s",
                        "evaluation_interval: 15s": "evaluation_interval: 1s",
                    },
                )
            )
            with running_prometheus(prometheus_bin, config, tmp_path) as (url, log):
                async with httpx.AsyncClient(base_url=url, timeout=5, trust_env=False) as http:
                    prom = Prometheus(http, log)
                    await wait_until_scraped(prom, node_label)
                    yield prom


async def wait_until_scraped(prom: Prometheus, node_label: str = "Hostname") -> None:
    end = time.monotonic() + READY_DEADLINE

    async def started() -> str:
        # Prometheus listens before its TSDB is open, answering 503 until then.
        r = await prom.client.get("/-/ready")
        return "" if r.status_code == 200 else f"/-/ready: {r.status_code} {r.text.strip()}"

    await prom.until("Prometheus to be ready", started, end)

    async def ready() -> str:
        # At settled() already, so that the checks evaluated there see every series.
        when = settled()
        gpus = {
            s["metric"][node_label]: float(s["value"][1])
            for s in await prom.at(
                f'count by ({node_label}) (DCGM_FI_DEV_GPU_UTIL{{job="{UNIFIED_JOB}"}})', when
            )
        }
        if gpus != dict.fromkeys(NODES, float(GPUS)):
            return f"GPUs per node {gpus}"
        pods = {
            s["metric"]["NodeName"]
            for s in await prom.at(
                'count by (NodeName) (DCGM_CUSTOM_PROCESS_MEM_USED{PodName!=""})', when
            )
        }
        if pods != set(NODES):
            return f"nodes with GPU processes in pods {pods}"
        # Two scrapes at least, so range functions ($__rate_interval) have two samples.
        samples = await prom.query("min(count_over_time(DCGM_FI_DEV_GPU_UTIL[1m]))")
        if not samples or float(samples[0]["value"][1]) < 2:
            return f"samples per GPU series {samples}"
        return ""

    await prom.until("GPU and pod series of both nodes", ready, end)


def settled() -> float:
    """An evaluation time whose scrapes are all stored: every query evaluated at it sees
    the same samples, so values computed from raw series compare exactly."""
    return time.time() - 2.0  # two 1 s scrape intervals ago
