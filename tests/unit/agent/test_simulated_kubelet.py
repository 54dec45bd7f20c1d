"""``[simulate] pod_resources``: the simulated pods hold their GPUs through a real
pod-resources server, so device series, process series and ACK's allocation metrics agree.
And an agent on a box without the kubelet's socket never loads gRPC."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from edge_agent.config import load
from gpurelay.exposition import render_text
from gpurelay.model import Snapshot
from harness.pipeline import make_pipeline
from tests.promtool_support import unexpected_findings

ROOT = Path(__file__).resolve().parent.parent.parent.parent
AGENT = (sys.executable, "-m", "edge_agent")
GPUSHARE = ("--simulate-pod-resources", "gpushare")


def snapshot(tmp_path: Path, mode: str, *, gpus: int = 2, mig: bool = True) -> Snapshot:
    base = load(None, {})
    cfg = dataclasses.replace(base, simulate=dataclasses.replace(base.simulate, pod_resources=mode))
    pipeline, _sim, _clock = make_pipeline(tmp_path, gpus=gpus, mig=mig, cfg=cfg)
    try:
        return pipeline.collection.collect()
    finally:
        pipeline.close()


def by_name(snap: Snapshot, name: str) -> list[dict[str, str | float]]:
    return [{**dict(s.labels), "value": s.value} for s in snap.samples if s.name == name]


@pytest.mark.parametrize("mode", ["nvidia", "gpushare"])
def test_process_pods_have_allocations_and_the_ack_ratio_is_defined(
    tmp_path: Path, mode: str
) -> None:
    snap = snapshot(tmp_path, mode)
    used: dict[tuple[str, str], float] = defaultdict(float)
    for s in by_name(snap, "DCGM_CUSTOM_PROCESS_MEM_USED"):
        if s["PodName"]:
            used[(str(s["NamespaceName"]), str(s["PodName"]))] += float(s["value"])
    given: dict[tuple[str, str], float] = defaultdict(float)
    for s in by_name(snap, "DCGM_CUSTOM_CONTAINER_MEM_ALLOCATED"):
        given[(str(s["NamespaceName"]), str(s["PodName"]))] += float(s["value"])
    assert used and set(used) == set(given)
    for key, mib in used.items():  # ACK's _GPU_MEM_USED_RATIO: used / allocated, by pod
        assert 0 < mib / given[key] <= 1, key
    mode_value = by_name(snap, "DCGM_CUSTOM_ALLOCATE_MODE")[0]["value"]
    assert mode_value == (2 if mode == "gpushare" else 1)


def test_device_series_carry_the_pods_that_run_on_them(tmp_path: Path) -> None:
    snap = snapshot(tmp_path, "nvidia")
    running: dict[tuple[str, str], set[str]] = defaultdict(set)  # (uuid, gi) -> pods
    for s in by_name(snap, "DCGM_CUSTOM_PROCESS_MEM_USED"):
        if s["PodName"]:
            running[(str(s["UUID"]), str(s["GPU_I_ID"]))].add(str(s["PodName"]))
    labelled: dict[tuple[str, str], set[str]] = defaultdict(set)
    for s in by_name(snap, "DCGM_FI_DEV_FB_USED"):
        if "pod" in s:
            labelled[(str(s["UUID"]), str(s.get("GPU_I_ID", "")))].add(str(s["pod"]))
    assert labelled and set(labelled) == set(running)
    for key, pods in labelled.items():
        assert pods == {min(running[key])}, key  # one series, the first of the sharers


def test_without_the_setting_there_is_no_kubelet(tmp_path: Path) -> None:
    snap = snapshot(tmp_path, "")
    names = {s.name for s in snap.samples}
    assert not names & {"DCGM_CUSTOM_CONTAINER_MEM_ALLOCATED", "DCGM_CUSTOM_ALLOCATE_MODE"}
    assert not any(k == "pod" for s in snap.samples for k, _ in s.labels)


def test_the_cli_flag_turns_it_on() -> None:
    out = subprocess.run(
        [*AGENT, "once", "--format", "json", "--simulate", "1", *GPUSHARE],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=True,
    ).stdout
    names = {s["name"] for s in json.loads(out)["samples"]}
    assert "DCGM_CUSTOM_CONTAINER_MEM_ALLOCATED" in names


# argv: fake host directory, [simulate] pod_resources; prints whether grpc was imported
_AGENT_BUILDS_AND_COLLECTS = """
import dataclasses, sys
from pathlib import Path
from edge_agent.sim import host as simhost, kubelet as simkubelet
from edge_agent.backend import Backend
from edge_agent.pipeline import build_pipeline
from edge_agent.config import load
from edge_agent.sim.nvml import SimulatedNvml

base = load(None, {})
pids = simhost.default_pids(4)
host = simhost.build(Path(sys.argv[1]), pids)
attribution = dataclasses.replace(  # the default socket path, as outside the simulator
    simhost.attribution_config(host, base.attribution),
    pod_resources_socket=base.attribution.pod_resources_socket,
)
simulate = dataclasses.replace(base.simulate, pod_resources=sys.argv[2])
cfg = dataclasses.replace(base, simulate=simulate, attribution=attribution)
sim = SimulatedNvml(1, pids=pids)
sim.nvmlInit()
cfg, stop = simkubelet.attach(cfg, host, sim)
pipeline = build_pipeline(Backend(sim, "simulated", cfg, on_close=[stop] if stop else []))
pipeline.collection.collect()
pipeline.collection.collect()
print("grpc" in sys.modules)
pipeline.close()
"""


@pytest.mark.parametrize(("mode", "loaded"), [("", False), ("nvidia", True)])
def test_grpc_is_loaded_only_where_a_kubelet_socket_exists(
    tmp_path: Path, mode: str, loaded: bool
) -> None:
    assert not Path("/var/lib/kubelet/pod-resources/kubelet.sock").exists()
    out = subprocess.run(
        [sys.executable, "-c", _AGENT_BUILDS_AND_COLLECTS, str(tmp_path), mode],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=True,
    ).stdout
    assert out.strip() == str(loaded)


@pytest.mark.promtool
@pytest.mark.parametrize("mode", ["nvidia", "gpushare"])
def test_promtool_finds_nothing_but_the_compatible_names(
    tmp_path: Path, promtool: Path, mode: str
) -> None:
    body = render_text(snapshot(tmp_path, mode))
    assert b"DCGM_CUSTOM_DEV_FB_ALLOCATED" in body and b'pod="' in body
    assert unexpected_findings(promtool, body) == []
