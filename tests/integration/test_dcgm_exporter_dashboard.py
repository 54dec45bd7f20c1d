"""NVIDIA's dcgm-exporter Grafana dashboard, query for query, against a real Prometheus.

The panel queries and variables below are copied from NVIDIA's dashboard
(github.com/NVIDIA/dcgm-exporter, grafana/dcgm-exporter-dashboard.json, "NVIDIA DCGM
Exporter Dashboard", at commit d5e5f510a1b6b393f39a43293ccd9dc985defc79), unchanged but for
the variables, which are filled in as Grafana would. The fleet (adapter_support.running_fleet:
a real gateway, two agents of two simulated H100s each, Prometheus scraping the gateway with
the shipped unified.yml) runs with NVIDIA's own default-counters.csv, so this is what a
dcgm-exporter user sees after pointing that dashboard at us: every panel has data for every
node and GPU, "Tensor Core Utilization" (DCGM_FI_PROF_PIPE_TENSOR_ACTIVE, from NVML GPM)
included.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from tests.integration.adapter_support import GPUS, NODES, Prometheus, running_fleet

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "dcgm-exporter"

# The dashboard's template variables: multi-value, "All" included, no allValue.
VARIABLES = {
    "instance": "label_values(DCGM_FI_DEV_GPU_TEMP, instance)",
    "gpu": "label_values(DCGM_FI_DEV_GPU_TEMP, gpu)",
}
# Panel title -> query, in the dashboard's order.
PANELS = {
    "GPU Temperature": 'DCGM_FI_DEV_GPU_TEMP{instance=~"$instance", gpu=~"$gpu"}',
    "GPU Avg. Temp": 'avg(DCGM_FI_DEV_GPU_TEMP{instance=~"$instance", gpu=~"$gpu"})',
    "GPU Power Usage": 'DCGM_FI_DEV_POWER_USAGE{instance=~"$instance", gpu=~"$gpu"}',
    "GPU Power Total": 'sum(DCGM_FI_DEV_POWER_USAGE{instance=~"$instance", gpu=~"$gpu"})',
    "GPU SM Clocks": 'DCGM_FI_DEV_SM_CLOCK{instance=~"$instance", gpu=~"$gpu"} * 1000000',
    "GPU Utilization": 'DCGM_FI_DEV_GPU_UTIL{instance=~"$instance", gpu=~"$gpu"}',
    "GPU Framebuffer Mem Used": 'DCGM_FI_DEV_FB_USED{instance=~"$instance", gpu=~"$gpu"}',
    "Tensor Core Utilization": (
        'DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{instance=~"$instance", gpu=~"$gpu"}'
    ),
}
AGGREGATES = {"GPU Avg. Temp", "GPU Power Total"}  # one series; the others one per GPU
REGEX_SPECIAL = r"[\\^$*+?.()|[\]{}]"  # what Grafana escapes in a variable
QUERY_DEADLINE = 15.0  # after both nodes' series are stored, every panel answered


def fill(expr: str, values: dict[str, list[str]]) -> str:
    """``expr`` with ``$var`` as Grafana's Prometheus data source fills a multi-value
    variable: one value as itself, several as ``(a|b)``, each with regex metacharacters
    escaped by a double backslash (its prometheusRegularEscape)."""

    def one(m: re.Match[str]) -> str:
        chosen = [re.sub(REGEX_SPECIAL, r"\\\\\g<0>", v) for v in values[m.group(1)]]
        return chosen[0] if len(chosen) == 1 else "(" + "|".join(chosen) + ")"

    return re.sub(r"\$(\w+)", one, expr)


def test_the_copied_queries_use_only_instance_and_gpu() -> None:
    for title, expr in PANELS.items():
        matchers = set(re.findall(r"(\w+)=~", expr))
        assert matchers == {"instance", "gpu"}, title
        assert not re.search(r"\b(by|without|on|ignoring)\s*\(", expr), title


async def variable_values(prom: Prometheus, query: str) -> list[str]:
    """``label_values(METRIC, LABEL)`` the way Grafana asks Prometheus for it."""
    m = re.fullmatch(r"label_values\((\w+), (\w+)\)", query)
    assert m, query
    metric, label = m.groups()
    r = await prom.client.get(f"/api/v1/label/{label}/values", params={"match[]": metric})
    r.raise_for_status()
    values: list[str] = r.json()["data"]
    return sorted(values)


async def test_every_panel_of_nvidias_dashboard_returns_data(
    prometheus_bin: Path, tmp_path: Path
) -> None:
    counters = FIXTURES / "default-counters.csv"
    async with running_fleet(prometheus_bin, tmp_path, counters_file=counters) as prom:
        values = {name: await variable_values(prom, q) for name, q in VARIABLES.items()}
        # Every node is an instance (unified.yml copies the node name into it).
        assert set(NODES) <= set(values["instance"]), values
        assert values["gpu"] == [str(i) for i in range(GPUS)], values
        # As the dashboard opens ("All"), and with one node and one GPU picked.
        selections = [values, {"instance": [sorted(NODES)[0]], "gpu": ["1"]}]

        async def answered() -> str:
            empty = []
            for chosen in selections:
                nodes = [n for n in chosen["instance"] if n in NODES]
                for title, expr in PANELS.items():
                    query = fill(expr, chosen)
                    result = await prom.query(query)  # a PromQL error fails here
                    want = 1 if title in AGGREGATES else len(nodes) * len(chosen["gpu"])
                    if title not in AGGREGATES:
                        # Series of other instances (the gateway's own) carry no gpu.
                        result = [s for s in result if s["metric"].get("instance") in NODES]
                    if len(result) != want:
                        empty.append(f"{title!r}: {len(result)} series, want {want}: {query}")
            return "\n  ".join(["panels without their data:", *empty]) if empty else ""

        await prom.until(
            "every panel of NVIDIA's dashboard", answered, time.monotonic() + QUERY_DEADLINE
        )
        # dcgm-exporter's units: the tensor pipe as a ratio, not percent.
        tensor = await prom.query(fill(PANELS["Tensor Core Utilization"], values))
        assert tensor and all(0 <= float(s["value"][1]) <= 1 for s in tensor), tensor
        assert any(float(s["value"][1]) > 0 for s in tensor), tensor
