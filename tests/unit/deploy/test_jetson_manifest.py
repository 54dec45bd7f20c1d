"""deploy/kubernetes/edge-agent-jetson.yaml: the agent on Jetson nodes (issue 28).

Its schema is checked with every manifest (test_kubernetes_manifests.py). Here: what the
Jetson backend needs from the pod (the host's / read-only where ``[gpu] host_root`` says,
the host's PIDs, one capability to read debugfs, no NVIDIA runtime), and that the config
the pod runs with, its paths mapped onto a fake board's tree as Kubernetes maps them onto
the node's, collects that board through the real pipeline.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from edge_agent import pipeline
from edge_agent.backend import open_backend
from edge_agent.sim import host as simhost
from edge_agent.sim.jetson import build, client_pids
from tests.unit.deploy.test_kubernetes_manifests import (
    AGENT_FILE,
    K8S,
    NODE,
    find,
    load_agent,
    mount_at,
    mount_for,
    only_container,
    pod_env,
    pod_spec,
)

JETSON_FILE = K8S / "edge-agent-jetson.yaml"


def test_selects_jetson_nodes_without_the_nvidia_runtime() -> None:
    workload = find(JETSON_FILE, "DaemonSet")
    spec = pod_spec(workload)
    assert spec["nodeSelector"] == {
        "kubernetes.io/arch": "arm64",
        "edge-gpu-relay.io/jetson": "true",
    }
    assert "runtimeClassName" not in spec
    assert spec["hostPID"] is True  # nvmap lists the host's PIDs
    env = pod_env(only_container(workload), {"spec.nodeName": NODE})
    assert not {k for k in env if k.startswith("NVIDIA_")}


def test_one_read_capability_and_nothing_else() -> None:
    security = only_container(find(JETSON_FILE, "DaemonSet"))["securityContext"]
    assert security["capabilities"] == {"drop": ["ALL"], "add": ["DAC_READ_SEARCH"]}
    assert security["privileged"] is False and security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True


def test_the_config_reads_the_hosts_root_read_only(tmp_path: Path) -> None:
    workload, cfg, _ = load_agent(JETSON_FILE, tmp_path)
    assert cfg.gpu.backend == "jetson"
    mount, vol = mount_at(workload, str(cfg.gpu.host_root))
    assert mount["readOnly"] is True and vol["hostPath"]["path"] == "/"
    assert mount["mountPropagation"] == "HostToContainer"
    for path in (cfg.attribution.proc_root, cfg.gpu.host_root / "sys" / "kernel" / "debug"):
        assert mount_for(workload, path)[0]["name"] == "host-root"
    assert cfg.attribution.pod_resources_socket is None
    assert cfg.gateway.key == Path(f"/etc/edge-gpu-relay/certs/{NODE}.key")
    # the same Secret and namespace as the NVML DaemonSet's
    nvml = find(AGENT_FILE, "DaemonSet")
    assert workload["metadata"]["namespace"] == nvml["metadata"]["namespace"]
    secret = [v for v in pod_spec(workload)["volumes"] if "secret" in v]
    assert secret == [v for v in pod_spec(nvml)["volumes"] if "secret" in v]


def test_the_pods_config_collects_a_board(tmp_path: Path) -> None:
    """The ConfigMap's config, /host mapped onto a fake Orin Nano's tree (as the hostPath
    maps it onto the node's /): the Jetson backend, every figure, attributed processes."""
    workload, cfg, _ = load_agent(JETSON_FILE, tmp_path)
    node_root = tmp_path / "node"
    build(node_root, "jetson-orin-nano")
    host = simhost.build(node_root, client_pids("jetson-orin-nano"))

    def on_node(path: Path) -> Path:  # where the pod's path lands on the node
        mount, rel = mount_for(workload, path)
        assert mount["name"] == "host-root"
        return node_root / rel

    assert on_node(cfg.attribution.proc_root) == host.proc_root
    cfg = dataclasses.replace(
        cfg,
        gpu=dataclasses.replace(cfg.gpu, host_root=node_root),
        attribution=dataclasses.replace(
            simhost.attribution_config(host, cfg.attribution),
            proc_root=on_node(cfg.attribution.proc_root),
        ),
        gateway=dataclasses.replace(cfg.gateway, address=""),  # collect only
        node_name=NODE,  # KUBE_NODE_NAME in the pod (test_kubernetes_manifests.py)
    )
    p = pipeline.build_pipeline(open_backend(cfg))
    try:
        snap = p.collection.collect()
    finally:
        p.close()
    names = {s.name for s in snap.samples}
    assert p.backend == "jetson"
    assert {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "gpurelay_jetson_rail_power_watts"} <= (
        names
    )
    (proc,) = [dict(s.labels) for s in snap.samples if s.name == "DCGM_CUSTOM_PROCESS_MEM_USED"]
    assert proc["PodName"] and proc["NodeName"] == NODE
