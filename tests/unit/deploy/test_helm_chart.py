"""deploy/helm/edge-gpu-relay: rendered by Helm's own template engine (helm-python-sdk binds
Helm v4's Go SDK, no helm binary), linted, every documented values combination valid for
Kubernetes, and the default values equal to the raw manifests in deploy/kubernetes/ that
describe the same objects (one meaning for both: the manifests' comments document the
chart).

helm-python-sdk has wheels for Linux x86-64 only: elsewhere the tests that render are
skipped, unless EDGE_GPU_RELAY_REQUIRE_HELM=1 (set by .ci/run) makes that a failure."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from edge_agent.config import load

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "deploy" / "helm" / "edge-gpu-relay"
K8S = ROOT / "deploy" / "kubernetes"
K8S_VERSION = "1.30"
Doc = dict[str, Any]


def helm() -> Any:
    try:
        import helm_python
    except ImportError as exc:  # no wheel for this platform
        msg = f"helm-python-sdk is not installed ({exc})"
        if os.environ.get("EDGE_GPU_RELAY_REQUIRE_HELM") == "1":
            pytest.fail(f"{msg}; EDGE_GPU_RELAY_REQUIRE_HELM=1 makes this a failure")
        pytest.skip(msg)
    return helm_python


def render(values: dict[str, Any] | None = None) -> list[Doc]:
    chart = helm().Chart.load(CHART)
    out = chart.render(values, name="edge-gpu-relay", namespace="default", is_install=True)
    return [
        doc
        for path, text in sorted(out.items())
        if path.endswith(".yaml")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def raw(*names: str) -> list[Doc]:
    return [d for n in names for d in yaml.safe_load_all((K8S / n).read_text()) if d]


def by_key(docs: list[Doc]) -> dict[tuple[str, str], Doc]:
    keyed = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    assert len(keyed) == len(docs), "two objects of the same kind and name"
    return keyed


def find(docs: list[Doc], kind: str, name: str) -> Doc:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


# Each documented value that changes what is rendered, at a non-default setting.
COMBINATIONS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "no agent": {"agent": {"enabled": False}},
    "no rule": {"prometheusRule": {"enabled": False}},
    "agent only, own namespace": {
        "agent": {"namespace": "gpu-telemetry", "createNamespace": False},
        "gateway": {"enabled": False},
        "prometheusRule": {"enabled": False},
    },
    "default runtime": {"agent": {"runtimeClassName": ""}},
    "gateway address": {"agent": {"gatewayAddress": "gw.example.com:2222"}},
    "pod labels": {"agent": {"podLabelsRbac": True}},
    "extra env and image": {
        "agent": {
            "extraEnv": [{"name": "EDGE_AGENT_LOG_LEVEL", "value": "debug"}],
            "image": {"repository": "registry.example.com/edge-agent", "tag": "0.1.1"},
            # Helm merges maps with the defaults: null drops a default key
            "nodeSelector": {"gpu": "yes", "nvidia.com/gpu.present": None},
            "tolerations": [],
        }
    },
    "rule for a release": {"prometheusRule": {"labels": {"release": "kube-prometheus-stack"}}},
    "no gateway": {"gateway": {"enabled": False}},
    "gateway, own secrets and namespace": {
        "agent": {"enabled": False},
        "prometheusRule": {"enabled": False},
        "gateway": {
            "namespace": "gpu-gateway",
            "createNamespace": False,
            "secrets": {"create": False},
            "serviceMonitor": {"enabled": False},
            "proxiedScrapeConfig": False,
        },
    },
    "gateway secrets from values": {
        "gateway": {
            "secrets": {
                "placeholder": False,
                "userCaPub": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIA user-ca\n",
                "revocations": "",
                "hostKey": "-----BEGIN OPENSSH PRIVATE KEY-----\n...\n",
                "hostKeyCertificate": "ssh-ed25519-cert-v01@openssh.com AAAA host\n",
                "operatorToken": "t" * 43,
            }
        }
    },
    "gateway behind a node port": {
        "gateway": {
            "sshService": {"type": "NodePort", "annotations": {"example.com/lb": "x"}},
            "serviceMonitor": {"interval": "30s", "labels": {"release": "prom"}},
        }
    },
    "gateway on a cluster IP": {"gateway": {"sshService": {"type": "ClusterIP"}}},
    "BIE collector too": {"bie": {"enabled": True}},
    "Jetson agents too": {"jetson": {"enabled": True}},
    "Jetson agents only": {"jetson": {"enabled": True}, "agent": {"enabled": False}},
}


def test_the_chart_carries_the_alert_rules_unchanged() -> None:
    shipped = ROOT / "deploy" / "prometheus" / "alerts.yml"
    assert (CHART / "files" / "alerts.yml").read_bytes() == shipped.read_bytes(), (
        "copy deploy/prometheus/alerts.yml to deploy/helm/edge-gpu-relay/files/"
    )


def test_defaults_render_the_raw_manifests() -> None:
    rendered = by_key(render())
    expected = by_key(
        raw("edge-agent-daemonset.yaml", "cloud-gateway.yaml", "prometheus-rules.yaml")
    )
    assert set(rendered) == set(expected)
    for key, doc in expected.items():
        assert rendered[key] == doc, f"{key} differs from deploy/kubernetes/"


def test_pod_labels_render_the_raw_rbac_and_mount_the_token() -> None:
    docs = render({"agent": {"podLabelsRbac": True}})
    rendered = by_key(docs)
    for key, doc in by_key(raw("edge-agent-pod-labels-rbac.yaml")).items():
        assert rendered[key] == doc
    assert find(docs, "ServiceAccount", "edge-agent")["automountServiceAccountToken"] is True
    pod = find(docs, "DaemonSet", "edge-agent")["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is True


@pytest.mark.parametrize("name", list(COMBINATIONS))
def test_every_combination_is_valid_for_kubernetes(name: str) -> None:
    docs = render(COMBINATIONS[name])
    for doc in docs:
        if doc["kind"] == "PrometheusRule":  # no schema in kubernetes-validate
            assert set(doc["spec"]) == {"groups"} and doc["spec"]["groups"]
            continue
        if doc["kind"] == "ServiceMonitor":  # nor for this one: its fields as in the raw one
            expected = by_key(raw("cloud-gateway.yaml"))[("ServiceMonitor", "cloud-gateway")]
            assert set(doc["spec"]) == set(expected["spec"])
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_values_reach_the_objects() -> None:
    docs = render(COMBINATIONS["agent only, own namespace"])
    assert {d["kind"] for d in docs} == {"ServiceAccount", "ConfigMap", "DaemonSet"}
    assert {d["metadata"]["namespace"] for d in docs} == {"gpu-telemetry"}
    docs = render({"agent": {"namespace": "gpu-telemetry", "podLabelsRbac": True}})
    binding = find(docs, "ClusterRoleBinding", "edge-gpu-relay-agent-pods")
    assert binding["subjects"][0]["namespace"] == "gpu-telemetry"
    pod = find(render(COMBINATIONS["gateway address"]), "DaemonSet", "edge-agent")["spec"][
        "template"
    ]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["EDGE_AGENT_GATEWAY_ADDRESS"] == "gw.example.com:2222"
    assert (
        "runtimeClassName"
        not in find(render(COMBINATIONS["default runtime"]), "DaemonSet", "edge-agent")["spec"][
            "template"
        ]["spec"]
    )
    pod = find(render(COMBINATIONS["extra env and image"]), "DaemonSet", "edge-agent")["spec"][
        "template"
    ]["spec"]
    container = pod["containers"][0]
    assert container["image"] == "registry.example.com/edge-agent:0.1.1"
    assert container["env"][-1] == {"name": "EDGE_AGENT_LOG_LEVEL", "value": "debug"}
    assert pod["nodeSelector"] == {"gpu": "yes"} and "tolerations" not in pod
    rule = find(render(COMBINATIONS["rule for a release"]), "PrometheusRule", "edge-gpu-relay")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    no_agent = render(COMBINATIONS["no agent"])
    assert not [d for d in no_agent if d["metadata"]["name"].startswith("edge-agent")]
    assert ("Namespace", "edge-gpu-relay") not in by_key(no_agent)


def test_gateway_values_reach_the_objects() -> None:
    docs = render(COMBINATIONS["gateway, own secrets and namespace"])
    gateway = [d for d in docs if d["metadata"].get("namespace") == "gpu-gateway"]
    assert {d["kind"] for d in gateway} == {"ServiceAccount", "ConfigMap", "Deployment", "Service"}
    assert not [d for d in docs if d["kind"] in ("Secret", "ServiceMonitor", "Namespace")]
    secrets = by_key(render(COMBINATIONS["gateway secrets from values"]))
    host = secrets[("Secret", "cloud-gateway-host")]
    assert host["stringData"]["host_key"].startswith("-----BEGIN OPENSSH PRIVATE KEY-----")
    assert "edge-gpu-relay/placeholder" not in host["metadata"]["labels"]
    assert secrets[("Secret", "cloud-gateway-tokens")]["stringData"]["operator.token"] == "t" * 43
    nodeport = by_key(render(COMBINATIONS["gateway behind a node port"]))
    ssh = nodeport[("Service", "cloud-gateway-ssh")]
    assert ssh["spec"]["type"] == "NodePort"
    assert ssh["metadata"]["annotations"] == {"example.com/lb": "x"}
    monitor = nodeport[("ServiceMonitor", "cloud-gateway")]
    assert monitor["spec"]["endpoints"][0]["interval"] == "30s"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    inside = by_key(render(COMBINATIONS["gateway on a cluster IP"]))[
        ("Service", "cloud-gateway-ssh")
    ]
    assert inside["spec"]["type"] == "ClusterIP" and "externalTrafficPolicy" not in inside["spec"]


def cluster_values(**gateway: Any) -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load((CHART / "values-cluster.yaml").read_text())
    values["gateway"].update(gateway)
    return {**values, "agent": {"enabled": False}, "prometheusRule": {"enabled": False}}


def test_values_cluster_render_the_raw_cluster_manifest() -> None:
    rendered = by_key(render(cluster_values()))
    expected = by_key(raw("cloud-gateway-cluster.yaml"))
    assert set(rendered) == set(expected)
    for key, doc in expected.items():
        assert rendered[key] == doc, f"{key} differs from deploy/kubernetes/"


def test_bie_renders_the_raw_bie_manifest() -> None:
    only_bie = {
        "bie": {"enabled": True},
        "agent": {"enabled": False},
        "gateway": {"enabled": False},
        "prometheusRule": {"enabled": False},
    }
    assert by_key(render(only_bie)) == by_key(raw("bie-accelerator-metrics.yaml"))
    assert not [d for d in render() if d["metadata"].get("namespace") == "baetyl-edge-system"]


@pytest.mark.parametrize("with_nvml_agent", [True, False])
def test_jetson_renders_the_raw_jetson_manifest(with_nvml_agent: bool) -> None:
    """jetson.enabled: the objects of deploy/kubernetes/edge-agent-jetson.yaml, beside the
    NVML agent's (sharing its namespace and service account) or alone."""
    values = {
        "jetson": {"enabled": True},
        "agent": {"enabled": with_nvml_agent},
        "gateway": {"enabled": False},
        "prometheusRule": {"enabled": False},
    }
    rendered = by_key(render(values))
    expected = by_key(raw("edge-agent-jetson.yaml"))
    for key, doc in expected.items():
        assert rendered[key] == doc, f"{key} differs from deploy/kubernetes/"
    nvml = {("DaemonSet", "edge-agent"), ("ConfigMap", "edge-agent-config")}
    assert set(rendered) == set(expected) | (nvml if with_nvml_agent else set())
    assert ("DaemonSet", "edge-agent-jetson") not in by_key(render())


def test_cluster_values_reach_the_objects() -> None:
    secrets = {
        "placeholder": False,
        "databaseDsn": "postgresql://gw:pw@db:5432/relay",
        "peerToken": "p" * 43,
    }
    docs = by_key(render(cluster_values(cluster={"replicas": 5}, secrets=secrets)))
    assert docs[("Deployment", "cloud-gateway")]["spec"]["replicas"] == 5
    dsn = docs[("Secret", "cloud-gateway-database")]
    assert dsn["stringData"]["dsn"] == "postgresql://gw:pw@db:5432/relay"
    assert "edge-gpu-relay/placeholder" not in dsn["metadata"]["labels"]
    assert docs[("Secret", "cloud-gateway-peer")]["stringData"]["peer.token"] == "p" * 43
    for doc in docs.values():
        if doc["kind"] != "ServiceMonitor":
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    own = render(cluster_values(secrets={"create": False}))
    assert not [d for d in own if d["kind"] == "Secret"]


def test_a_mode_the_chart_does_not_have_is_a_clear_error() -> None:
    with pytest.raises(helm().HelmRenderError, match=r"single \(one gateway\) or cluster"):
        render({"gateway": {"mode": "ha"}})


def test_the_config_value_is_the_agents_configuration(tmp_path: Path) -> None:
    """The chart's default agent.toml loads in the agent (as the raw ConfigMap's does)."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    config = find(render(), "ConfigMap", "edge-agent-config")["data"]["agent.toml"]
    assert config == values["agent"]["config"]
    path = tmp_path / "agent.toml"
    path.write_text(config)
    cfg = load(path, {})
    assert cfg.gateway.address == "gateway.example.com:2222"


def test_lint_finds_nothing_above_info() -> None:
    report = helm().lint(CHART, strict=True, kube_version="v1.30.0")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []
