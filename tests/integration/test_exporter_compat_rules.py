"""deploy/prometheus/per-container-exporter-compat.rules.yml: the per-container GPU memory
exporter's ``used_gpu_memory{container_id,container_name,gpu,pid,unit}`` (bytes, ``unit``
"bits" as that exporter writes it; ../shared/seeds/per-container-gpu-memory-exporter.zh.txt)
rebuilt from our ``DCGM_CUSTOM_PROCESS_MEM_USED`` (MiB).

* ``promtool check rules`` and ``promtool test rules`` on the shipped file;
* a real Prometheus that scrapes a real gateway (``deploy/prometheus/unified.yml``) fed by a
  real agent over SSH, with simulated GPUs whose processes run in Kubernetes pods, plain
  Docker containers (named by a Docker Engine API on a unix socket) and on the host, and
  the rule file loaded: every process has its ``used_gpu_memory`` series with the
  exporter's labels, equal to ours x 1048576 at the rule's own evaluation time.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from edge_agent.config import AttributionConfig
from edge_agent.sim import host as simhost
from harness.fleet import agent_config, gateway_config, make_pki, running_agent, running_gateway
from harness.prometheus import running_prometheus
from harness.waiting import wait_for
from tests.integration.test_prometheus_e2e import (
    DEPLOY,
    FAST,
    GATEWAY,
    UNIFIED_JOB,
    PromQL,
    substituted,
)
from tests.unit.agent.test_attribute import FakeEngine

RULES = DEPLOY / "per-container-exporter-compat.rules.yml"
EXPORTER_LABELS = {"container_id", "container_name", "gpu", "pid", "unit"}
NODE_LABELS = {"instance", "job", "NodeName"}  # kept beside the exporter's: which node
SCRAPED = 'instance="edge-a",job="edge-gpu",NodeName="edge-a"'  # a scraped series' node
MIB = 1048576
NODE = "edge-a"
GPUS = 2
DEADLINE = 60.0  # Prometheus start -> recorded series of every process, values compared


# --- promtool -------------------------------------------------------------------------------


def promtool_run(promtool: Path, *args: str) -> None:
    proc = subprocess.run(
        [str(promtool), *args], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_promtool_checks_the_rules(promtool: Path) -> None:
    promtool_run(promtool, "check", "rules", str(RULES))


def test_promtool_unit_test_of_the_rules(promtool: Path, tmp_path: Path) -> None:
    """The exporter's own sample (a Kubernetes container of 1933 MiB on GPU 0, an
    `ivws-channels` container of 835 MiB) written the way we publish it."""
    ours = (
        "DCGM_CUSTOM_PROCESS_MEM_USED{{" + SCRAPED + ","
        'container_id="{cid}",container_name="{name}",gpu="{gpu}",UUID="GPU-1",'
        'ProcessId="{pid}",ProcessName="python3",ProcessType="C"}}'
    )
    shim = "k8s_iat_iat-tel-gpu01-bb7cf87b-szrdl_iat_9f24479b-c1b6-11eb-90a6-b8ca3af096f1_0"
    tests = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {
                        "series": ours.format(cid="d3719911f2cd", name=shim, gpu=0, pid=220678),
                        "values": "1933 1933",
                    },
                    {
                        "series": ours.format(
                            cid="a78fcbd9564f", name="ivws-channels", gpu=0, pid=159355
                        ),
                        "values": "835 835",
                    },
                    {  # a host process: no container labels at all
                        "series": "DCGM_CUSTOM_PROCESS_MEM_USED{" + SCRAPED + ","
                        'gpu="1",ProcessId="4242",ProcessName="gpu_burn"}',
                        "values": "0.5 0.5",
                    },
                ],
                "promql_expr_test": [
                    {
                        "expr": "used_gpu_memory",
                        "eval_time": "1m",
                        "exp_samples": [
                            {
                                "labels": f"used_gpu_memory{{{SCRAPED},"
                                f'container_id="d3719911f2cd",container_name="{shim}",'
                                'gpu="0",pid="220678",unit="bits"}',
                                "value": 2.026897408e09,  # the exporter's own number
                            },
                            {
                                "labels": f"used_gpu_memory{{{SCRAPED},"
                                'container_id="a78fcbd9564f",container_name="ivws-channels",'
                                'gpu="0",pid="159355",unit="bits"}',
                                "value": 8.7556096e08,
                            },
                            {
                                "labels": f"used_gpu_memory{{{SCRAPED},"
                                'gpu="1",pid="4242",unit="bits"}',
                                "value": 524288,
                            },
                        ],
                    },
                    {  # a report of the exporter's kind: MiB per container
                        "expr": "sum by (container_name) "
                        '(used_gpu_memory{unit="bits"}) / 1024 / 1024',
                        "eval_time": "1m",
                        "exp_samples": [
                            {"labels": f'{{container_name="{shim}"}}', "value": 1933},
                            {"labels": '{container_name="ivws-channels"}', "value": 835},
                            {"labels": "{}", "value": 0.5},
                        ],
                    },
                ],
            },
            {  # remote-written: no instance or job; two nodes with the same gpu and pid
                "interval": "1m",
                "input_series": [
                    {
                        "series": f'DCGM_CUSTOM_PROCESS_MEM_USED{{NodeName="{node}",gpu="0",'
                        'ProcessId="4000",container_id="0123456789ab"}',
                        "values": f"{mib} {mib}",
                    }
                    for node, mib in (("edge-a", 100), ("edge-b", 200))
                ],
                "promql_expr_test": [
                    {
                        "expr": "used_gpu_memory",
                        "eval_time": "1m",
                        "exp_samples": [
                            {
                                "labels": f'used_gpu_memory{{NodeName="{node}",gpu="0",'
                                'pid="4000",container_id="0123456789ab",unit="bits"}',
                                "value": mib * MIB,
                            }
                            for node, mib in (("edge-a", 100), ("edge-b", 200))
                        ],
                    }
                ],
            },
        ],
    }
    path = tmp_path / "compat-test.yml"
    path.write_text(json.dumps(tests))  # JSON is YAML
    promtool_run(promtool, "test", "rules", str(path))


# --- a real Prometheus, gateway and agent -----------------------------------------------------


class AnyContainer(dict[str, bytes]):
    """Docker Engine answers for every container id: named ``svc-<first 8 hex>``."""

    def get(self, key: str, default: bytes | None = None) -> bytes | None:
        return json.dumps({"Id": key, "Name": f"/svc-{key[:8]}", "Config": {"Labels": {}}}).encode()


@pytest.fixture
def docker_socket(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A Docker Engine API on a unix socket that the simulated host's attribution asks
    (simhost itself points the agent at no runtime socket)."""
    directory = Path(tempfile.mkdtemp(prefix="compat-", dir="/tmp"))  # AF_UNIX: short path
    path = directory / "docker.sock"
    engine = FakeEngine(str(path), AnyContainer())
    original = simhost.attribution_config

    def with_docker(host: simhost.FakeHost, base: AttributionConfig) -> AttributionConfig:
        return dataclasses.replace(original(host, base), runtime_sockets=(path,))

    monkeypatch.setattr(simhost, "attribution_config", with_docker)
    try:
        yield path
    finally:
        engine.stop()
        shutil.rmtree(directory, ignore_errors=True)


def key(labels: dict[str, str], pid_label: str) -> tuple[str, str, str, str]:
    return (labels["instance"], labels["job"], labels["gpu"], labels[pid_label])


async def at(prom: PromQL, expr: str, when: float) -> list[dict[str, Any]]:
    r = await prom.client.get("/api/v1/query", params={"query": expr, "time": f"{when:.3f}"})
    r.raise_for_status()
    result: list[dict[str, Any]] = r.json()["data"]["result"]
    return result


async def test_a_real_prometheus_records_the_exporters_series(
    prometheus_bin: Path, tmp_path: Path, docker_socket: Path
) -> None:
    pki = make_pki(tmp_path)
    async with running_gateway(gateway_config(pki)) as gw:
        async with running_agent(agent_config(pki, NODE, gw, gpus=GPUS)):
            await wait_for(lambda: NODE in gw.registry.states(time.time()), what="the agent")
            config = tmp_path / "prometheus.yml"
            config.write_text(
                substituted(
                    (DEPLOY / "unified.yml").read_text(),
                    {
                        GATEWAY: f"127.0.0.1:{gw.http_port}",
                        **{k: v for k, v in FAST.items() if "refresh" not in k},
                    },
                )
                + f"\nrule_files:\n  - {RULES}\n"
            )
            with running_prometheus(prometheus_bin, config, tmp_path) as (url, log):
                async with httpx.AsyncClient(base_url=url, timeout=5, trust_env=False) as http:
                    prom = PromQL(http, log)
                    seen: dict[str, Any] = {}

                    async def compared() -> str:
                        return await compare(prom, seen)

                    await prom.until(
                        "used_gpu_memory of every process, equal to ours x 1048576",
                        compared,
                        time.monotonic() + DEADLINE,
                    )
    recorded, ours = seen["recorded"], seen["ours"]
    # What the simulated host holds: processes in pods, in Docker containers, on the host.
    named = [r for r in recorded if r["metric"].get("container_name", "").startswith("svc-")]
    assert named, "no Docker container was named"
    for r in named:
        assert r["metric"]["container_name"] == f"svc-{r['metric']['container_id'][:8]}"
    assert any("container_id" not in r["metric"] for r in recorded), "no host process"
    in_pods = {key(o["metric"], "ProcessId") for o in ours if o["metric"].get("PodName")}
    assert in_pods and in_pods <= {key(r["metric"], "pid") for r in recorded}
    print(
        f"{len(recorded)} used_gpu_memory series ({len(named)} named Docker containers), "
        f"values = DCGM_CUSTOM_PROCESS_MEM_USED x {MIB} at t={seen['t']:.3f}"
    )


async def compare(prom: PromQL, seen: dict[str, Any]) -> str:
    """ "" when, at the rule's latest evaluation time, every process has one recorded
    series with the exporter's labels and our value x 1048576; else what is missing."""
    stamp = await prom.query("max(timestamp(used_gpu_memory))")
    if not stamp:
        return "no used_gpu_memory yet"
    t = float(stamp[0]["value"][1])
    recorded = await at(prom, "used_gpu_memory", t)
    ours = await at(prom, f'DCGM_CUSTOM_PROCESS_MEM_USED{{job="{UNIFIED_JOB}"}}', t)
    if len(ours) < GPUS:
        return f"{len(ours)} process series of ours"
    by_key = {key(r["metric"], "pid"): r for r in recorded}
    if len(by_key) != len(recorded):
        return f"two recorded series for one process: {recorded}"
    for o in ours:
        m = o["metric"]
        r = by_key.get(key(m, "ProcessId"))
        if r is None:
            return f"no used_gpu_memory for {m}"
        labels = r["metric"]
        extra = set(labels) - EXPORTER_LABELS - {"__name__", *NODE_LABELS}
        if extra or labels["unit"] != "bits" or labels["instance"] != NODE:
            return f"labels {labels}"
        for name in ("container_id", "container_name"):
            if m.get(name, "") != labels.get(name, ""):
                return f"{name}: ours {m.get(name)!r}, recorded {labels.get(name)!r}"
        if float(r["value"][1]) != float(o["value"][1]) * MIB:
            # A scrape may land at t after the rule ran: compare at the next evaluation.
            return f"{labels}: {r['value'][1]} != {o['value'][1]} x {MIB}"
    if len(recorded) != len(ours):
        return f"{len(recorded)} recorded series for {len(ours)} processes"
    seen.update(recorded=recorded, ours=ours, t=t)
    return ""


def test_the_readme_documents_the_rule() -> None:
    assert RULES.name in (DEPLOY / "README.md").read_text()
