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
  shipped ``deploy/prometheus/unified.yml`` (or ``prometheus.yml``: both jobs, the
  unified one and the proxied one through the gateway); it yields once both nodes' GPU
  and pod series are stored (through every job);
* :func:`published` reads what the gateway and the agents publish on their own
  ``/metrics``, the truth a query's answer is compared with.
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

from edge_agent.config import AgentConfig
from edge_agent.sim import host as simhost
from gpurelay.naming import by_old
from harness.fleet import (
    TOKEN,
    agent_config,
    gateway_config,
    make_pki,
    running_agent,
    running_gateway,
)
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

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
# GPU utilisation under dcgm-exporter 4.8's name or 4.9's (agents on either scheme)
UTIL = "DCGM_FI_DEV_GPU_UTIL|DCGM_FI_DEV_GPU_UTIL_RATIO"
UNIFIED = DEPLOY / "prometheus" / "unified.yml"
BOTH = DEPLOY / "prometheus" / "prometheus.yml"  # the unified and the proxied job
TEMPLATE_FIELDS = {"Series", "LabelMatchers", "GroupBy", "LabelValuesByName", "GroupBySlice"}

NODES = {"edge-a": 11, "edge-b": 12}  # node -> simulator seed (distinct GPUs and pods)
GPUS = 2
# On edge-a, the simulated processes 1 and 4 join process 0's container: one pod with two
# processes on GPU 0 and one on GPU 1 (the simulator puts process i on GPU i % GPUS), so a
# rule must count each GPU's memory once per pod, and a pod's GPUs are summed.
SHARED_NODE, SHARED_WITH_FIRST = "edge-a", (1, 4)
READY_DEADLINE = 45.0  # Prometheus start -> GPU and pod series of both nodes seen
# A sample line of the text format, and a label of it (published())
SAMPLE = re.compile(r"(?P<name>[A-Za-z_:][\w:]*)(?:\{(?P<labels>.*)\})? (?P<value>\S+)(?: \S+)?")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


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
        # or several names, {__name__=~"A|B",...}: a field under dcgm-exporter 4.8's and
        # 4.9's names, each series named as the first by ``name`` (docs/migration.md)
        either = re.fullmatch(r'\{__name__=~"([\w|]+)",.*\}', raw["seriesQuery"])
        assert m or either, f"seriesQuery {raw['seriesQuery']!r} is not a series selector"
        found = either.group(1).split("|") if either else [m.group(1)]  # type: ignore[union-attr]
        series = found[0]
        name = series
        if "name" in raw:
            assert set(raw["name"]) == {"matches", "as"}, raw["name"]
            # Go's ${1} / $1 as Python's \1
            repl = re.sub(r"\$\{?(\d+)\}?", r"\\\1", raw["name"]["as"])
            names = set()
            for each in found:
                assert re.search(raw["name"]["matches"], each), (raw["name"], each)
                names.add(re.sub(raw["name"]["matches"], repl, each))
            (name,) = names  # one custom metric, whichever name the series has
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
        assert {"LabelMatchers", "GroupBy"} <= fields, query
        assert "Series" in fields or len(found) > 1, query
        assert query.count("(") == query.count(")"), query
        rules.append(Rule(series, raw["seriesQuery"], name, labels, query))
    return rules


def gpu_key(labels: dict[str, str], node_label: str) -> tuple[str, str, str]:
    return (labels[node_label], labels["UUID"], labels.get("GPU_I_ID", ""))


class Prometheus(PromQL):
    """A Prometheus of :func:`running_fleet`: ``jobs`` are its scrape jobs, ``sources``
    the ``/metrics`` URLs of the gateway and of each node's agent."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        log: Path,
        jobs: tuple[str, ...] = (UNIFIED_JOB,),
        sources: dict[str, str] | None = None,
    ) -> None:
        super().__init__(client, log)
        self.jobs = jobs
        self.sources = sources or {}

    async def series(self, match: str) -> list[dict[str, str]]:
        r = await self.client.get(
            "/api/v1/series", params={"match[]": match, "start": f"{time.time() - 300:.0f}"}
        )
        r.raise_for_status()
        result: list[dict[str, str]] = r.json()["data"]
        return result

    async def raw(self, names: set[str], when: float) -> dict[str, list[dict[str, str]]]:
        """Every series of ``names`` at ``when``: its labels and ``value``. A name dcgm-exporter
        4.9 renamed (gpurelay.naming) also finds the series of agents on 4.9's names, its
        value in 4.8's unit (bytes as MiB, a ratio as %)."""
        out = {}
        for name in names:
            rows = [s["metric"] | {"value": s["value"][1]} for s in await self.at(name, when)]
            rename = by_old().get(name)
            if rename is not None:
                rows += [
                    s["metric"]
                    | {"__name__": name, "value": str(rename.to_old(float(s["value"][1])))}
                    for s in await self.at(rename.new, when)
                ]
            out[name] = rows
        return out


def share_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rewrite the fake host tree the simulator builds (see SHARED_WITH_FIRST), and what
    its simulated kubelet allocates (edge_agent.sim.kubelet, where it is on)."""
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
    config: Path = UNIFIED,
    interval_seconds: float | None = None,
    rule_files: Sequence[Path] = (),
) -> AsyncIterator[Prometheus]:
    """The gateway, both agents and Prometheus; ``pod_resources``: the agents' simulated
    kubelet (``[simulate] pod_resources``: "nvidia" or "gpushare"), none by default;
    ``node_label``: the gateway's and the agents' setting; ``counters_file``: the agents'
    (the built-in one by default); ``config``: the shipped Prometheus config, UNIFIED or
    BOTH (with ``node_label = "hostname"`` run through the operator guide's sed, as
    ``rule_files`` are); ``interval_seconds``: the agents' collection (and process)
    interval, 0.2 s by default: a long one keeps every value still while a test reads it
    from Prometheus and from the ``/metrics`` it came from."""
    pki = make_pki(tmp_path)
    gateway = gateway_config(pki, node_label=node_label)
    async with running_gateway(gateway) as gw:
        configs: list[AgentConfig] = []
        for node, seed in NODES.items():
            cfg = agent_config(pki, node, gw, gpus=GPUS)
            simulate = dataclasses.replace(cfg.simulate, seed=seed, pod_resources=pod_resources)
            cfg = dataclasses.replace(
                cfg, simulate=simulate, node_label=node_label, counters_file=counters_file
            )
            if interval_seconds is not None:
                cfg = dataclasses.replace(
                    cfg,
                    interval_seconds=interval_seconds,
                    process_interval_seconds=interval_seconds,
                )
            configs.append(cfg)
        async with running_agent(configs[0]) as agent_a, running_agent(configs[1]) as agent_b:
            # Connected, and (for the proxied job's service discovery) each agent's
            # exporter published.
            await wait_for(
                lambda: (
                    set(NODES) <= set(gw.registry.states(time.time()))
                    and gw.endpoints.count() == len(NODES)
                ),
                what="both agents to connect and publish their exporters",
            )
            sources = {"gateway": f"http://127.0.0.1:{gw.http_port}/metrics"}
            for node, agent in zip(NODES, (agent_a, agent_b), strict=True):
                sources[node] = f"http://127.0.0.1:{agent.port}/metrics"
            replacements = {
                GATEWAY: f"127.0.0.1:{gw.http_port}",
                "scrape_interval: 15s": "scrape_interval: 1s",
                "evaluation_interval: 15s": "evaluation_interval: 1s",
            }
            jobs: tuple[str, ...] = (UNIFIED_JOB,)
            text = config.read_text()
            if config == BOTH:
                token_file = tmp_path / "edge-gpu-relay.token"
                token_file.write_text(TOKEN + "\n")
                replacements |= {TOKEN_FILE: str(token_file), **FAST}
                jobs = (UNIFIED_JOB, PROXIED_JOB)
                text = relabelled(text, node_label)
            text = substituted(text, replacements)
            if rule_files:
                rules_dir = tmp_path / "rules"
                rules_dir.mkdir()
                text += "\nrule_files:\n"
                for path in rule_files:
                    (rules_dir / path.name).write_text(relabelled(path.read_text(), node_label))
                    text += f"  - {rules_dir / path.name}\n"
            prometheus_yml = tmp_path / "prometheus.yml"
            prometheus_yml.write_text(text)
            with running_prometheus(prometheus_bin, prometheus_yml, tmp_path) as (url, log):
                async with httpx.AsyncClient(base_url=url, timeout=5, trust_env=False) as http:
                    prom = Prometheus(http, log, jobs, sources)
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
        for job in prom.jobs:
            gpus = {
                s["metric"].get(node_label, ""): float(s["value"][1])
                for s in await prom.at(
                    f'count by ({node_label}) ({{__name__=~"{UTIL}",job="{job}"}})', when
                )
            }
            if gpus != dict.fromkeys(NODES, float(GPUS)):
                return f"GPUs per node through job {job}: {gpus}"
            pods = {
                s["metric"]["NodeName"]
                for s in await prom.at(
                    f'count by (NodeName) (DCGM_CUSTOM_PROCESS_MEM_USED{{job="{job}",'
                    'PodName!=""})',
                    when,
                )
            }
            if pods != set(NODES):
                return f"nodes with GPU processes in pods through job {job}: {pods}"
        # Two scrapes at least, so range functions ($__rate_interval) have two samples.
        samples = await prom.at(f'min(count_over_time({{__name__=~"{UTIL}"}}[1m]))', when)
        if not samples or float(samples[0]["value"][1]) < 2:
            return f"samples per GPU series {samples}"
        return ""

    await prom.until("GPU and pod series of both nodes", ready, end)


Published = dict[str, list[dict[str, str]]]  # name -> each series' labels and "value"


async def published(url: str) -> Published:
    """Every sample of the ``/metrics`` at ``url``, named as Prometheus stores it (a
    counter without ``_total`` keeps its name), in the shape of :meth:`Prometheus.raw`."""
    async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
        r = await client.get(url)
        r.raise_for_status()
    out: Published = {}
    for line in r.text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = SAMPLE.fullmatch(line)
        assert m, f"not a sample line of the text format: {line!r}"
        labels = {
            k: re.sub(r"\\(.)", lambda e: "\n" if e.group(1) == "n" else e.group(1), v)
            for k, v in LABEL.findall(m.group("labels") or "")
        }
        out.setdefault(m.group("name"), []).append(labels | {"value": m.group("value")})
    return out


def settled() -> float:
    """An evaluation time whose scrapes are all stored: every query evaluated at it sees
    the same samples, so values computed from raw series compare exactly."""
    return time.time() - 2.0  # two 1 s scrape intervals ago
