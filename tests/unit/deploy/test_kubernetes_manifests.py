"""deploy/kubernetes/: every manifest schema-valid offline, and true to the product.

Schema: every document of every YAML file validates in strict mode (an unknown field is an
error) against the Kubernetes OpenAPI schemas that the ``kubernetes-validate`` package
ships, without a cluster. Custom resources (the Prometheus Operator's kinds) have no schema
there: they are listed in CUSTOM_KINDS and their shape is checked by hand.

Contracts: what the agent and the gateway need from their pods (node name from
spec.nodeName, read-only host mounts for attribution, the spool, the certificate, ports,
probes, the BIE namespace and label, the Services), that the Prometheus relabelling is the
one deploy/prometheus/ ships, and that the TOML in the ConfigMaps loads with the real
config loaders, the pod's environment applied as Kubernetes would expand it, so a typo in
a key or an EDGE_AGENT_* variable fails here rather than on a node.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path, PurePosixPath
from typing import Any

import kubernetes_validate
import pytest
import tomllib
import yaml

from cloud_gateway import config as gateway_config
from cloud_gateway.errors import GatewayConfigError
from cloud_gateway.trust.revocation import RevocationList
from edge_agent import config as agent_config
from gpurelay.settings import split_host_port

ROOT = Path(__file__).resolve().parents[3]
K8S = ROOT / "deploy" / "kubernetes"
PROMETHEUS = ROOT / "deploy" / "prometheus"

# The schemas to validate against: a version every supported cluster has reached. The
# manifests use nothing newer than Kubernetes 1.20 (runtimeClassName, seccompProfile).
K8S_VERSION = "1.30"

AGENT_FILE = K8S / "edge-agent-daemonset.yaml"
BIE_FILE = K8S / "bie-accelerator-metrics.yaml"
GATEWAY_FILE = K8S / "cloud-gateway.yaml"
CLUSTER_FILE = K8S / "cloud-gateway-cluster.yaml"  # several gateways on PostgreSQL
GATEWAY_FILES = [GATEWAY_FILE, CLUSTER_FILE]

# Stand-in for the node the pod lands on: what spec.nodeName resolves to.
NODE = "gpu-node-7"
# Stand-ins for what the downward API gives a gateway pod, and for the Secrets an
# operator creates in place of the placeholders: (Secret, key) -> value.
POD_IP = "10.244.3.17"
POD_NAME = "cloud-gateway-6f7d9c5b8-x2k4q"
POD_FIELDS = {"spec.nodeName": NODE, "status.podIP": POD_IP, "metadata.name": POD_NAME}
DSN = "postgresql://gpurelay:s3cret@db.example.internal:5432/gpurelay"
OPERATOR_SECRETS = {
    ("cloud-gateway-database", "dsn"): DSN,
    ("cloud-gateway-peer", "peer.token"): "p" * 43 + "\n",
}

# baetyl-core's nvstats plugin (github.com/baetyl/baetyl, plugin/nvstats/config.go) fetches
# http://<pod IP>:<collectPort>/v1/collect with collectPort defaulting to 30060.
BIE_COLLECT_PORT = 30060
BIE_NAMESPACE = "baetyl-edge-system"
BIE_LABEL = ("baetyl-service-name", "baetyl-accelerator-metrics")

# Kinds without a schema in kubernetes-validate, checked by hand instead. Add a kind here
# only with a shape check (custom_shape_problems).
CUSTOM_KINDS = frozenset(
    {
        ("monitoring.coreos.com/v1", "ServiceMonitor"),
        ("monitoring.coreos.com/v1", "PodMonitor"),
        ("monitoring.coreos.com/v1", "PrometheusRule"),
        ("monitoring.coreos.com/v1alpha1", "ScrapeConfig"),
    }
)

# Fields of the Prometheus Operator's ServiceMonitor (monitoring.coreos.com/v1): a typo
# such as honorLabel would be dropped silently by an API server without schema validation.
SERVICE_MONITOR_SPEC_FIELDS = frozenset(
    {
        "attachMetadata",
        "bodySizeLimit",
        "endpoints",
        "fallbackScrapeProtocol",
        "jobLabel",
        "keepDroppedTargets",
        "labelLimit",
        "labelNameLengthLimit",
        "labelValueLengthLimit",
        "namespaceSelector",
        "nativeHistogramBucketLimit",
        "nativeHistogramMinBucketFactor",
        "podTargetLabels",
        "sampleLimit",
        "scrapeClass",
        "scrapeClassicHistograms",
        "scrapeProtocols",
        "selector",
        "selectorMechanism",
        "targetLabels",
        "targetLimit",
    }
)
SERVICE_MONITOR_ENDPOINT_FIELDS = frozenset(
    {
        "authorization",
        "basicAuth",
        "bearerTokenFile",
        "bearerTokenSecret",
        "enableHttp2",
        "filterRunning",
        "followRedirects",
        "honorLabels",
        "honorTimestamps",
        "interval",
        "metricRelabelings",
        "noProxy",
        "oauth2",
        "params",
        "path",
        "port",
        "proxyConnectHeader",
        "proxyFromEnvironment",
        "proxyUrl",
        "relabelings",
        "scheme",
        "scrapeTimeout",
        "targetPort",
        "tlsConfig",
        "trackTimestampsStaleness",
    }
)
RELABEL_FIELDS = frozenset(
    {"action", "modulus", "regex", "replacement", "separator", "sourceLabels", "targetLabel"}
)

# Private key or certificate material must never be committed, not even as an example.
KEY_MATERIAL = re.compile(
    r"-----BEGIN [A-Z ]*PRIVATE KEY-----"
    r"|\b(?:ssh-ed25519|ssh-rsa|ecdsa-sha2-nistp\d+)(?:-cert-v01@openssh\.com)? AAAA"
)

Doc = dict[str, Any]


# --- loading ---------------------------------------------------------------------------------


def manifest_files() -> list[Path]:
    return sorted([*K8S.glob("*.yaml"), *K8S.glob("*.yml")])


@cache
def _documents(path: Path) -> tuple[Doc, ...]:
    with path.open(encoding="utf-8") as f:
        return tuple(doc for doc in yaml.safe_load_all(f) if doc is not None)


def documents(path: Path) -> tuple[Doc, ...]:
    return _documents(path.resolve())


def find(path: Path, kind: str, name: str | None = None) -> Doc:
    found = [
        d
        for d in documents(path)
        if d.get("kind") == kind and (name is None or d["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"{path.name}: expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def pod_spec(workload: Doc) -> Doc:
    spec: Doc = workload["spec"]["template"]["spec"]
    return spec


def only_container(workload: Doc) -> Doc:
    containers = pod_spec(workload)["containers"]
    assert len(containers) == 1, "one container per pod"
    container: Doc = containers[0]
    return container


def volume(workload: Doc, name: str) -> Doc:
    (found,) = [v for v in pod_spec(workload)["volumes"] if v["name"] == name]
    return found


def mount_at(workload: Doc, mount_path: str) -> tuple[Doc, Doc]:
    """The container's mount at exactly ``mount_path`` and the volume it mounts."""
    mounts = [m for m in only_container(workload)["volumeMounts"] if m["mountPath"] == mount_path]
    assert len(mounts) == 1, f"nothing (or several) mounted at {mount_path}"
    return mounts[0], volume(workload, mounts[0]["name"])


def mount_for(workload: Doc, path: Path) -> tuple[Doc, PurePosixPath]:
    """The mount that holds ``path`` and the path relative to the mount's root."""
    target = PurePosixPath(path)
    best: Doc | None = None
    for m in only_container(workload)["volumeMounts"]:
        root = PurePosixPath(m["mountPath"])
        if (target == root or root in target.parents) and (
            best is None or len(root.parts) > len(PurePosixPath(best["mountPath"]).parts)
        ):
            best = m
    assert best is not None, f"{path} is not on any volume mounted into the container"
    return best, target.relative_to(best["mountPath"])


def port_number(container: Doc, port: int | str) -> int:
    """A port by number or by container port name (as probes and Services refer to it)."""
    if isinstance(port, int):
        return port
    (found,) = [p["containerPort"] for p in container["ports"] if p.get("name") == port]
    return int(found)


_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def pod_env(
    container: Doc,
    fields: Mapping[str, str],
    secrets: Mapping[tuple[str, str], str] | None = None,
) -> dict[str, str]:
    """The container's environment as the kubelet builds it: downward-API fields from
    ``fields``, Secret keys from ``secrets``, and ``$(VAR)`` in a value replaced by a
    variable defined *earlier* in the list (a later or unknown one stays as written, as
    Kubernetes leaves it)."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            value = _VAR_REF.sub(lambda m: env.get(m[1], m[0]), str(item["value"]))
        elif "secretKeyRef" in item["valueFrom"]:
            ref = item["valueFrom"]["secretKeyRef"]
            value = (secrets or {})[(ref["name"], ref["key"])]
        else:
            field_path = item["valueFrom"]["fieldRef"]["fieldPath"]
            value = fields[field_path]
        env[item["name"]] = value
    return env


def service_link_env(path: Path, workload: Doc, *, honour_pod_spec: bool = True) -> dict[str, str]:
    """The variables the kubelet adds for every Service with a cluster IP in the pod's
    namespace (pkg/kubelet/envvars), unless the pod sets enableServiceLinks: false:
    cloud-gateway-http becomes CLOUD_GATEWAY_HTTP_SERVICE_HOST, CLOUD_GATEWAY_HTTP_PORT,
    ... The cluster IP is a stand-in."""
    if honour_pod_spec and pod_spec(workload).get("enableServiceLinks", True) is False:
        return {}
    env: dict[str, str] = {}
    namespace = workload["metadata"]["namespace"]
    for doc in documents(path):
        spec = doc.get("spec", {})
        if doc.get("kind") != "Service" or doc["metadata"].get("namespace") != namespace:
            continue
        if spec.get("clusterIP") == "None":
            continue  # headless: no variables
        name = _env_name(doc["metadata"]["name"])
        ip = "10.96.0.10"
        for i, port in enumerate(spec["ports"]):
            number, proto = str(port["port"]), port.get("protocol", "TCP")
            url = f"{proto.lower()}://{ip}:{number}"
            if i == 0:
                env[f"{name}_SERVICE_HOST"] = ip
                env[f"{name}_SERVICE_PORT"] = number
                env[f"{name}_PORT"] = url
            if port.get("name"):
                env[f"{name}_SERVICE_PORT_{_env_name(port['name'])}"] = number
            prefix = f"{name}_PORT_{number}_{proto}"
            env[prefix] = url
            env[prefix + "_PROTO"] = proto.lower()
            env[prefix + "_PORT"] = number
            env[prefix + "_ADDR"] = ip
    return env


def _env_name(name: str) -> str:
    return name.upper().replace("-", "_")


def config_file(path: Path, workload: Doc, mount_path: str, tmp_path: Path) -> Path:
    """The ConfigMap file mounted at ``mount_path``, written to ``tmp_path``."""
    mount, vol = mount_at(workload, mount_path)
    config_map = find(path, "ConfigMap", vol["configMap"]["name"])
    key = mount.get("subPath") or PurePosixPath(mount_path).name
    out = tmp_path / key
    out.write_text(config_map["data"][key], encoding="utf-8")
    return out


def command_config_path(container: Doc) -> str:
    command = [*container.get("command", []), *container.get("args", [])]
    assert "--config" in command, command
    return str(command[command.index("--config") + 1])


def load_agent(path: Path, tmp_path: Path) -> tuple[Doc, agent_config.AgentConfig, dict[str, str]]:
    """The DaemonSet of ``path`` and the agent configuration its pod would run with."""
    workload = find(path, "DaemonSet")
    container = only_container(workload)
    env = pod_env(container, {"spec.nodeName": NODE})
    toml = config_file(path, workload, command_config_path(container), tmp_path)
    return workload, agent_config.load(toml, env), env


def gateway_env(path: Path, secrets: Mapping[tuple[str, str], str]) -> dict[str, str]:
    """The gateway container's whole environment: the kubelet's Service variables first,
    then the container's own env (which wins on a clash)."""
    workload = find(path, "Deployment")
    return {
        **service_link_env(path, workload),
        **pod_env(only_container(workload), POD_FIELDS, secrets),
    }


def load_gateway(
    path: Path,
    tmp_path: Path,
    secrets: Mapping[tuple[str, str], str] = OPERATOR_SECRETS,
) -> tuple[Doc, gateway_config.GatewayConfig]:
    """The Deployment of ``path`` and the gateway configuration its pod would run with,
    the real Secrets standing in for the placeholders (``secrets``). The loader reads the
    peer token file ([cluster] peer_token_file, a Secret in the pod): the same content is
    given at a temporary path, and the configured path put back in the result."""
    workload = find(path, "Deployment")
    container = only_container(workload)
    env = gateway_env(path, secrets)
    toml = config_file(path, workload, command_config_path(container), tmp_path)
    token_file = tomllib.loads(toml.read_text()).get("cluster", {}).get("peer_token_file")
    if token_file:
        mount, rel = mount_for(workload, Path(token_file))
        secret = volume(workload, mount["name"])["secret"]["secretName"]
        stand_in = tmp_path / "peer.token"
        stand_in.write_text(secrets[(secret, str(rel))], encoding="utf-8")
        env["CLOUD_GATEWAY_CLUSTER_PEER_TOKEN_FILE"] = str(stand_in)
    cfg = gateway_config.load(toml, env)
    if token_file:
        cluster = dataclasses.replace(cfg.cluster, peer_token_file=token_file)
        cfg = dataclasses.replace(cfg, cluster=cluster)
    return workload, cfg


def placeholder_secrets(path: Path) -> dict[tuple[str, str], str]:
    """What the placeholder Secrets of ``path`` hold, as the pod would read it."""
    return {
        (d["metadata"]["name"], key): value
        for d in documents(path)
        if d["kind"] == "Secret"
        for key, value in d.get("stringData", {}).items()
    }


def secret_keys(path: Path, name: str) -> set[str]:
    secret = find(path, "Secret", name)
    return {*secret.get("data", {}), *secret.get("stringData", {})}


def unified_job() -> Doc:
    with (PROMETHEUS / "unified.yml").open(encoding="utf-8") as f:
        (job,) = yaml.safe_load(f)["scrape_configs"]
    return dict(job)


def proxied_job() -> Doc:
    with (PROMETHEUS / "proxied.yml").open(encoding="utf-8") as f:
        (job,) = yaml.safe_load(f)["scrape_configs"]
    return dict(job)


def workloads() -> Iterator[tuple[Path, Doc]]:
    for path in manifest_files():
        for doc in documents(path):
            if doc.get("kind") in {"DaemonSet", "Deployment", "StatefulSet"}:
                yield path, doc


# --- schema ----------------------------------------------------------------------------------


def custom_shape_problems(doc: Doc) -> list[str]:
    problems: list[str] = []
    metadata = doc.get("metadata")
    if not isinstance(metadata, dict) or not metadata.get("name"):
        problems.append("metadata.name is missing")
    spec = doc.get("spec")
    if not isinstance(spec, dict) or not spec:
        return [*problems, "spec must be a non-empty mapping"]
    if doc["kind"] == "PrometheusRule":
        return problems + prometheus_rule_problems(spec)
    if doc["kind"] != "ServiceMonitor":
        return problems
    problems += [f"unknown spec field {k}" for k in sorted(set(spec) - SERVICE_MONITOR_SPEC_FIELDS)]
    if not isinstance(spec.get("selector"), dict):
        problems.append("spec.selector must be a label selector")
    endpoints = spec.get("endpoints")
    if not isinstance(endpoints, list) or not endpoints:
        return [*problems, "spec.endpoints must be a non-empty list"]
    for i, ep in enumerate(endpoints):
        where = f"spec.endpoints[{i}]"
        problems += [
            f"{where}: unknown field {k}" for k in sorted(set(ep) - SERVICE_MONITOR_ENDPOINT_FIELDS)
        ]
        if "port" not in ep and "targetPort" not in ep:
            problems.append(f"{where}: needs port or targetPort")
        for j, rule in enumerate([*ep.get("relabelings", []), *ep.get("metricRelabelings", [])]):
            problems += [
                f"{where} relabeling {j}: unknown field {k}"
                for k in sorted(set(rule) - RELABEL_FIELDS)
            ]
    return problems


# Fields of a PrometheusRule's groups and rules (monitoring.coreos.com/v1 RuleGroup, Rule).
RULE_GROUP_FIELDS = frozenset(
    {"name", "interval", "rules", "limit", "partial_response_strategy", "query_offset", "labels"}
)
RULE_FIELDS = frozenset(
    {"alert", "record", "expr", "for", "keep_firing_for", "labels", "annotations"}
)


def prometheus_rule_problems(spec: Doc) -> list[str]:
    problems = [f"unknown spec field {k}" for k in sorted(set(spec) - {"groups"})]
    groups = spec.get("groups")
    if not isinstance(groups, list) or not groups:
        return [*problems, "spec.groups must be a non-empty list"]
    for i, group in enumerate(groups):
        where = f"spec.groups[{i}]"
        problems += [f"{where}: unknown field {k}" for k in sorted(set(group) - RULE_GROUP_FIELDS)]
        for j, rule in enumerate(group.get("rules") or [None]):
            if not isinstance(rule, dict) or not rule.get("expr"):
                problems.append(f"{where}.rules[{j}]: needs expr")
                continue
            problems += [
                f"{where}.rules[{j}]: unknown field {k}" for k in sorted(set(rule) - RULE_FIELDS)
            ]
            if ("alert" in rule) == ("record" in rule):
                problems.append(f"{where}.rules[{j}]: needs alert or record, not both")
    return problems


def test_the_prometheus_rule_holds_exactly_the_groups_of_alerts_yml() -> None:
    rule = find(K8S / "prometheus-rules.yaml", "PrometheusRule")
    with (PROMETHEUS / "alerts.yml").open(encoding="utf-8") as f:
        shipped = yaml.safe_load(f)["groups"]
    assert rule["spec"]["groups"] == shipped
    assert rule["metadata"]["namespace"] == find(GATEWAY_FILE, "Namespace")["metadata"]["name"]


def test_a_prometheus_rule_with_a_typo_is_refused() -> None:
    doc = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "x"},
        "spec": {"groups": [{"name": "g", "rules": [{"alert": "A", "expr": "1", "fro": "5m"}]}]},
    }
    assert custom_shape_problems(doc) == ["spec.groups[0].rules[0]: unknown field fro"]


def test_the_manifests_are_there() -> None:
    names = {p.name for p in manifest_files()}
    assert {AGENT_FILE.name, BIE_FILE.name, GATEWAY_FILE.name, CLUSTER_FILE.name} <= names


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: p.name)
def test_every_document_validates_against_the_kubernetes_schemas(path: Path) -> None:
    docs = documents(path)
    assert docs, f"{path.name} holds no document"
    for doc in docs:
        what = f"{path.name}: {doc.get('kind')} {doc.get('metadata', {}).get('name')}"
        if (doc.get("apiVersion"), doc.get("kind")) in CUSTOM_KINDS:
            assert custom_shape_problems(doc) == [], what
            continue
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError as exc:
            pytest.fail(f"{what}: {exc.message}; a custom resource? add it to CUSTOM_KINDS")
        except kubernetes_validate.ValidationError as exc:
            at = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{what}: at {at or 'top level'}: {exc.message}")


def test_schema_validation_rejects_an_unknown_field() -> None:
    """Guard: strict mode is what makes a misspelt field (volumeMount) fail above."""
    workload = find(AGENT_FILE, "DaemonSet")
    broken = yaml.safe_load(yaml.safe_dump(workload))
    broken["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: p.name)
def test_no_key_material_is_committed(path: Path) -> None:
    assert not KEY_MATERIAL.search(path.read_text(encoding="utf-8"))


# --- the agent, in both DaemonSets ------------------------------------------------------------


AGENT_DAEMONSETS = [AGENT_FILE, BIE_FILE]


@pytest.mark.parametrize("path", AGENT_DAEMONSETS, ids=lambda p: p.name)
def test_node_name_comes_from_spec_node_name(path: Path, tmp_path: Path) -> None:
    workload, cfg, env = load_agent(path, tmp_path)
    (item,) = [e for e in only_container(workload)["env"] if e["name"] == "KUBE_NODE_NAME"]
    assert item["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert cfg.node_name == "", "a node_name in the TOML would win over KUBE_NODE_NAME"
    assert agent_config.resolve_node_name(cfg.node_name, env) == NODE


@pytest.mark.parametrize("path", AGENT_DAEMONSETS, ids=lambda p: p.name)
def test_runs_on_every_gpu_node_and_sees_every_gpu(path: Path) -> None:
    spec = pod_spec(find(path, "DaemonSet"))
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert any(
        t["key"] == "nvidia.com/gpu" and t["operator"] == "Exists" for t in spec["tolerations"]
    )
    env = pod_env(only_container(find(path, "DaemonSet")), {"spec.nodeName": NODE})
    assert spec.get("runtimeClassName") == "nvidia" or env.get("NVIDIA_VISIBLE_DEVICES") == "all"
    assert env.get("NVIDIA_VISIBLE_DEVICES") == "all"
    assert env.get("NVIDIA_DRIVER_CAPABILITIES") == "utility"
    resources = only_container(find(path, "DaemonSet"))["resources"]
    assert "nvidia.com/gpu" not in {**resources.get("requests", {}), **resources.get("limits", {})}
    # NVML reports GPU processes in the caller's PID namespace (see the manifest).
    assert spec["hostPID"] is True


@pytest.mark.parametrize("path", AGENT_DAEMONSETS, ids=lambda p: p.name)
@pytest.mark.parametrize(
    ("mount_path", "host_path"),
    [
        ("/host/proc", "/proc"),
        ("/var/log/containers", "/var/log/containers"),
        ("/var/log/pods", "/var/log/pods"),
        ("/var/lib/kubelet/pod-resources", "/var/lib/kubelet/pod-resources"),
    ],
)
def test_host_paths_for_attribution_are_mounted_read_only(
    path: Path, mount_path: str, host_path: str
) -> None:
    mount, vol = mount_at(find(path, "DaemonSet"), mount_path)
    assert mount.get("readOnly") is True
    assert vol["hostPath"]["path"] == host_path


@pytest.mark.parametrize("path", AGENT_DAEMONSETS, ids=lambda p: p.name)
def test_attribution_config_points_at_the_host_mounts(path: Path, tmp_path: Path) -> None:
    workload, cfg, _ = load_agent(path, tmp_path)
    a = cfg.attribution
    assert a.proc_root == Path("/host/proc")
    assert a.container_log_dir == Path("/var/log/containers")
    assert a.pod_log_dir == Path("/var/log/pods")
    assert a.runtime_sockets == ()
    for directory in (a.proc_root, a.container_log_dir, a.pod_log_dir):
        mount, rel = mount_for(workload, directory)
        assert rel == PurePosixPath("."), f"{directory} must be a mount of its own"
        assert "hostPath" in volume(workload, mount["name"])


@pytest.mark.parametrize("path", AGENT_DAEMONSETS, ids=lambda p: p.name)
def test_listen_port_probes_and_container_port_agree(path: Path, tmp_path: Path) -> None:
    workload, cfg, _ = load_agent(path, tmp_path)
    container = only_container(workload)
    assert cfg.listen_host == "0.0.0.0", "the pod IP must be served, not loopback"
    (port,) = container["ports"]
    assert port["containerPort"] == cfg.listen_port
    for probe in ("readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/healthz"
        assert port_number(container, get["port"]) == cfg.listen_port


@pytest.mark.parametrize("path", AGENT_DAEMONSETS, ids=lambda p: p.name)
def test_small_resource_requests_and_limits(path: Path) -> None:
    resources = only_container(find(path, "DaemonSet"))["resources"]
    assert resources["requests"]["memory"] == "64Mi"  # ~45 MB RSS measured
    assert resources["limits"]["memory"] == "128Mi"


def test_agent_pushes_to_the_gateway_with_this_nodes_certificate(tmp_path: Path) -> None:
    workload, cfg, env = load_agent(AGENT_FILE, tmp_path)
    gw = cfg.gateway
    assert gw.address
    assert "$(" not in env["EDGE_AGENT_GATEWAY_KEY"], "KUBE_NODE_NAME must be defined before"
    assert gw.key == Path(f"/etc/edge-gpu-relay/certs/{NODE}.key")
    assert gw.certificate_path == Path(f"/etc/edge-gpu-relay/certs/{NODE}.key-cert.pub")
    assert gw.known_hosts is not None
    for file in (gw.key, gw.certificate_path, gw.known_hosts):
        mount, rel = mount_for(workload, file)
        assert mount.get("readOnly") is True
        vol = volume(workload, mount["name"])
        assert vol["secret"]["secretName"] == "edge-agent-node-cert"
        assert vol["secret"]["defaultMode"] == 0o400
        assert len(rel.parts) == 1, f"{file}: a key of the Secret, at the mount's top"


def test_agent_spool_is_a_host_path(tmp_path: Path) -> None:
    """The spool survives pod restarts and upgrades: its directory is a writable hostPath
    at the same path as on a systemd box, and the agent's [spool] points at it."""
    workload, cfg, _ = load_agent(AGENT_FILE, tmp_path)
    mount, vol = mount_at(workload, "/var/lib/edge-gpu-relay")
    assert not mount.get("readOnly")
    assert vol["hostPath"] == {"path": "/var/lib/edge-gpu-relay", "type": "DirectoryOrCreate"}
    assert cfg.gateway.address, "the spool is used only when the agent pushes to a gateway"
    assert cfg.spool.enabled
    spool_mount, rel = mount_for(workload, cfg.spool.path)
    assert spool_mount["mountPath"] == "/var/lib/edge-gpu-relay"
    assert rel == PurePosixPath("spool.sqlite"), "the database (and its WAL) on the hostPath"
    # The root filesystem is read-only: nothing but the hostPath can hold the spool.
    assert only_container(workload)["securityContext"]["readOnlyRootFilesystem"] is True


def test_agent_namespace_allows_what_the_agent_needs() -> None:
    namespace = find(AGENT_FILE, "Namespace")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    for doc in documents(AGENT_FILE):
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == namespace["metadata"]["name"]


# --- BIE --------------------------------------------------------------------------------------


def test_bie_objects_live_in_the_baetyl_edge_system_namespace() -> None:
    for doc in documents(BIE_FILE):
        assert doc["metadata"]["namespace"] == BIE_NAMESPACE, doc["kind"]


def test_bie_label_is_on_the_pod_template_and_in_the_selector() -> None:
    workload = find(BIE_FILE, "DaemonSet")
    key, value = BIE_LABEL
    assert workload["spec"]["selector"]["matchLabels"][key] == value
    assert workload["spec"]["template"]["metadata"]["labels"][key] == value


def test_bie_serves_v1_collect_where_baetyl_core_fetches_it(tmp_path: Path) -> None:
    _, cfg, env = load_agent(BIE_FILE, tmp_path)
    assert env["EDGE_AGENT_LISTEN"] == f"0.0.0.0:{BIE_COLLECT_PORT}"
    assert cfg.listen_port == BIE_COLLECT_PORT
    assert cfg.gateway.address == "", "BIE pulls /v1/collect: no push from this DaemonSet"


# --- the gateway, one or several -------------------------------------------------------------


def test_gateway_is_one_replica_never_two(tmp_path: Path) -> None:
    workload = find(GATEWAY_FILE, "Deployment")
    assert workload["spec"]["replicas"] == 1
    assert workload["spec"]["strategy"] == {"type": "Recreate"}


@pytest.mark.parametrize("path", GATEWAY_FILES, ids=lambda p: p.name)
def test_gateway_services(path: Path, tmp_path: Path) -> None:
    workload, cfg = load_gateway(path, tmp_path)
    container = only_container(workload)
    ssh = find(path, "Service", "cloud-gateway-ssh")["spec"]
    http = find(path, "Service", "cloud-gateway-http")["spec"]
    assert ssh["type"] == "LoadBalancer"
    assert [(p["port"], p["protocol"]) for p in ssh["ports"]] == [(2222, "TCP")]
    assert http["type"] == "ClusterIP"
    assert [(p["name"], p["port"]) for p in http["ports"]] == [("http", 9410)]
    labels = workload["spec"]["template"]["metadata"]["labels"]
    for service, listen in ((ssh, cfg.ssh.listen), (http, cfg.http.listen)):
        assert service["selector"].items() <= labels.items()
        (port,) = service["ports"]
        assert port_number(container, port["targetPort"]) == int(listen.rpartition(":")[2])


@pytest.mark.parametrize("path", GATEWAY_FILES, ids=lambda p: p.name)
def test_gateway_probes(path: Path, tmp_path: Path) -> None:
    workload, cfg = load_gateway(path, tmp_path)
    container = only_container(workload)
    http_port = int(cfg.http.listen.rpartition(":")[2])
    for probe, url_path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = container[probe]["httpGet"]
        assert get["path"] == url_path
        assert port_number(container, get["port"]) == http_port


@pytest.mark.parametrize("path", GATEWAY_FILES, ids=lambda p: p.name)
def test_gateway_config_loads_and_points_at_the_secrets(path: Path, tmp_path: Path) -> None:
    workload, cfg = load_gateway(path, tmp_path)
    assert cfg.ssh.revocation_file is not None
    host_certificate = cfg.ssh.host_key.with_name(cfg.ssh.host_key.name + "-cert.pub")
    expected = {
        cfg.ssh.host_key: "cloud-gateway-host",
        host_certificate: "cloud-gateway-host",
        cfg.ssh.user_ca: "cloud-gateway-ca",
        cfg.ssh.revocation_file: "cloud-gateway-ca",
        **dict.fromkeys(cfg.http.token_files, "cloud-gateway-tokens"),
    }
    if cfg.cluster.clustered:
        expected[Path(cfg.cluster.peer_token_file)] = "cloud-gateway-peer"
    assert Path("/etc/edge-gpu-relay/tokens/operator.token") in cfg.http.token_files
    for file, secret in expected.items():
        mount, rel = mount_for(workload, file)
        assert mount.get("readOnly") is True
        # No subPath: the kubelet then updates the files in place (revocations, renewals).
        assert "subPath" not in mount
        assert volume(workload, mount["name"])["secret"]["secretName"] == secret
        assert str(rel) in secret_keys(path, secret), f"{file} is not in {secret}"


@pytest.mark.parametrize("path", GATEWAY_FILES, ids=lambda p: p.name)
def test_gateway_placeholders_fail_closed(path: Path) -> None:
    names = [d["metadata"]["name"] for d in documents(path) if d["kind"] == "Secret"]
    assert {"cloud-gateway-ca", "cloud-gateway-host", "cloud-gateway-tokens"} <= set(names)
    for name in names:
        secret = find(path, "Secret", name)
        assert secret["metadata"]["labels"]["edge-gpu-relay/placeholder"] == "true"
    data = find(path, "Secret", "cloud-gateway-tokens")["stringData"]
    assert data["operator.token"] == "", "a non-empty placeholder token would be accepted"
    ca = find(path, "Secret", "cloud-gateway-ca")["stringData"]
    assert len(RevocationList.parse(ca["revocations"])) == 0
    assert all(
        not line.strip() or line.lstrip().startswith("#") for line in ca["user_ca.pub"].splitlines()
    ), "the placeholder CA file must hold no key, so that the gateway refuses to start"


@pytest.mark.parametrize("path", GATEWAY_FILES, ids=lambda p: p.name)
def test_gateway_namespace_is_restricted(path: Path) -> None:
    namespace = find(path, "Namespace")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    assert namespace["metadata"]["name"] != find(AGENT_FILE, "Namespace")["metadata"]["name"]
    for doc in documents(path):
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == namespace["metadata"]["name"]
    spec = pod_spec(find(path, "Deployment"))
    assert spec["securityContext"]["runAsNonRoot"] is True


@pytest.mark.parametrize("path", GATEWAY_FILES, ids=lambda p: p.name)
def test_service_variables_would_stop_the_gateway(path: Path) -> None:
    """Why the gateway pods set enableServiceLinks: false. The kubelet's variables for the
    cloud-gateway-* Services start with CLOUD_GATEWAY_, the gateway's override prefix, and
    the loader refuses them as unknown keys (exit 2, a crash loop). The tests above load
    the config with the Service variables the pod really gets (none)."""
    workload = find(path, "Deployment")
    links = service_link_env(path, workload, honour_pod_spec=False)
    assert "CLOUD_GATEWAY_HTTP_SERVICE_HOST" in links
    with pytest.raises(GatewayConfigError, match="unknown environment variable"):
        gateway_config.load(None, links)
    assert pod_spec(workload)["enableServiceLinks"] is False
    assert service_link_env(path, workload) == {}


# --- several gateways (cloud-gateway-cluster.yaml) -------------------------------------------


def test_cluster_file_replaces_the_single_gateway() -> None:
    """Same namespace and names as cloud-gateway.yaml: going from one gateway to several
    is applying the other file (the CLI, Prometheus and dashboards keep their addresses)."""
    for kind in ("Namespace", "ServiceAccount", "Deployment", "ServiceMonitor"):
        single = find(GATEWAY_FILE, kind)["metadata"]["name"]
        assert find(CLUSTER_FILE, kind)["metadata"]["name"] == single
    for kind, name in (
        ("Service", "cloud-gateway-ssh"),
        ("Service", "cloud-gateway-http"),
        ("ConfigMap", "cloud-gateway-config"),
    ):
        find(GATEWAY_FILE, kind, name)
        find(CLUSTER_FILE, kind, name)


def test_cluster_is_several_replicas_rolled_one_at_a_time() -> None:
    spec = find(CLUSTER_FILE, "Deployment")["spec"]
    assert spec["replicas"] >= 3
    assert spec["strategy"]["type"] == "RollingUpdate"
    rolling = spec["strategy"]["rollingUpdate"]
    assert rolling["maxUnavailable"] == 0 and rolling["maxSurge"] == 1
    assert spec["minReadySeconds"] >= 10, "an old pod's agents settle before the next goes"
    budget = find(CLUSTER_FILE, "PodDisruptionBudget")["spec"]
    labels = spec["template"]["metadata"]["labels"]
    assert budget["selector"]["matchLabels"].items() <= labels.items()
    assert budget.get("maxUnavailable") == 1 or budget.get("minAvailable") == spec["replicas"] - 1


def test_cluster_config_from_the_pods_env(tmp_path: Path) -> None:
    """The ConfigMap's TOML with the env as the kubelet expands it: a clustered gateway
    whose id is the pod's name and whose advertised peer address is the pod's IP on the
    port its peer listener binds (and the container declares)."""
    workload, cfg = load_gateway(CLUSTER_FILE, tmp_path)
    container = only_container(workload)
    cluster = cfg.cluster
    assert cluster.clustered
    assert cluster.database == DSN
    assert cluster.resolved_gateway_id() == POD_NAME
    peer_port = port_number(container, "peer")
    assert split_host_port(cluster.advertise, "advertise") == (POD_IP, peer_port)
    assert split_host_port(cluster.peer_listen, "peer_listen") == ("0.0.0.0", peer_port)
    assert peer_port not in {port_number(container, name) for name in ("ssh", "http")}
    assert cluster.ttl_seconds >= 2 * cluster.heartbeat_seconds
    # The DSN comes from the Secret only: its password is in no file.
    (item,) = [e for e in container["env"] if e["name"] == "CLOUD_GATEWAY_CLUSTER_DATABASE"]
    assert item["valueFrom"]["secretKeyRef"] == {"name": "cloud-gateway-database", "key": "dsn"}
    toml = config_file(CLUSTER_FILE, workload, command_config_path(container), tmp_path)
    assert "database" not in tomllib.loads(toml.read_text())["cluster"]


@pytest.mark.parametrize(
    ("placeholder", "message"),
    [
        ("cloud-gateway-database", "cluster.database must be a PostgreSQL URL"),
        ("cloud-gateway-peer", "shorter than 16 characters"),
    ],
)
def test_cluster_placeholders_fail_closed(placeholder: str, message: str, tmp_path: Path) -> None:
    """A placeholder left in place stops every gateway at start with a line naming the key.
    An empty DSN would instead make each replica a lone gateway (each with part of the
    fleet), an empty peer token an unprotected peer listener."""
    secrets = {
        **OPERATOR_SECRETS,
        **{k: v for k, v in placeholder_secrets(CLUSTER_FILE).items() if k[0] == placeholder},
    }
    assert secrets != OPERATOR_SECRETS
    with pytest.raises(GatewayConfigError, match=message):
        load_gateway(CLUSTER_FILE, tmp_path, secrets)


@pytest.mark.parametrize("path", GATEWAY_FILES, ids=lambda p: p.name)
def test_service_monitor_copies_the_node_name_as_unified_yml_does(path: Path) -> None:
    monitor = find(path, "ServiceMonitor")["spec"]
    job = unified_job()
    (endpoint,) = monitor["endpoints"]
    assert endpoint["port"] == "http"
    assert endpoint["path"] == "/metrics"
    assert endpoint["honorLabels"] is job["honor_labels"] is True
    (ours,) = endpoint["metricRelabelings"]
    (theirs,) = job["metric_relabel_configs"]
    assert ours["sourceLabels"] == theirs["source_labels"] == ["Hostname", "hostname", "NodeName"]
    assert ours["regex"] == theirs["regex"] == ";*([^;]+).*"
    assert ours["replacement"] == theirs["replacement"]
    assert ours["targetLabel"] == theirs["target_label"] == "instance"
    assert ours.get("action", "replace") == theirs.get("action", "replace")


@pytest.mark.parametrize("path", GATEWAY_FILES, ids=lambda p: p.name)
def test_service_monitor_selects_the_http_service_only_with_the_same_job_name(path: Path) -> None:
    monitor = find(path, "ServiceMonitor")["spec"]
    wanted = monitor["selector"]["matchLabels"].items()
    selected = [
        d["metadata"]["name"]
        for d in documents(path)
        if d["kind"] == "Service" and wanted <= d["metadata"]["labels"].items()
    ]
    assert selected == ["cloud-gateway-http"]
    http = find(path, "Service", "cloud-gateway-http")
    assert monitor["namespaceSelector"]["matchNames"] == [http["metadata"]["namespace"]]
    assert http["metadata"]["labels"][monitor["jobLabel"]] == unified_job()["job_name"]


def proxied_snippet() -> list[Doc]:
    config_map = find(GATEWAY_FILE, "ConfigMap", "cloud-gateway-prometheus-proxied")
    jobs = yaml.safe_load(config_map["data"]["additional-scrape-configs.yaml"])
    assert isinstance(jobs, list), "additionalScrapeConfigs format: a list of scrape configs"
    return jobs


def test_proxied_snippet_is_proxied_yml_pointed_at_the_service() -> None:
    (ours,) = proxied_snippet()
    theirs = proxied_job()
    for key in ("job_name", "relabel_configs", "metric_relabel_configs"):
        assert ours[key] == theirs[key], key
    http = find(GATEWAY_FILE, "Service", "cloud-gateway-http")
    (port,) = http["spec"]["ports"]
    base = f"http://{http['metadata']['name']}.{http['metadata']['namespace']}.svc:{port['port']}"
    (sd,) = ours["http_sd_configs"]
    assert sd["url"] == base + "/api/v1/sd"
    assert ours["proxy_url"] == base
    # The gateway protects /api/v1/sd and the proxy by default: both need the token.
    assert sd["authorization"]["credentials_file"] == ours["authorization"]["credentials_file"]


def test_proxied_snippet_passes_promtool(promtool: Path, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("x" * 32 + "\n")
    jobs = proxied_snippet()
    for job in jobs:
        job["authorization"]["credentials_file"] = str(token)
        for sd in job["http_sd_configs"]:
            sd["authorization"]["credentials_file"] = str(token)
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({"scrape_configs": jobs}), encoding="utf-8")
    proc = subprocess.run(
        [str(promtool), "check", "config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --- every workload ---------------------------------------------------------------------------


OUR_WORKLOADS = [
    (p, d) for p, d in workloads() if p in {AGENT_FILE, BIE_FILE, GATEWAY_FILE, CLUSTER_FILE}
]


@pytest.mark.parametrize(
    ("path", "workload"),
    OUR_WORKLOADS,
    ids=[f"{p.name}:{d['metadata']['name']}" for p, d in OUR_WORKLOADS],
)
def test_hardened_security_context(path: Path, workload: Doc) -> None:
    spec = pod_spec(workload)
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert spec["automountServiceAccountToken"] is False
    assert spec.get("hostNetwork") is not True
    container = only_container(workload)
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security.get("privileged") is not True
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert container["image"].endswith(":0.1.0"), "pinned tag, not :latest"


IMAGES_SCRIPT = ROOT / "deploy" / "images" / "build.sh"


def _build_script_default(name: str) -> str:
    match = re.search(
        rf"^{name}=\$\{{{name}:-([^}}]+)\}}$|^{name}=(\S+)$", IMAGES_SCRIPT.read_text(), re.M
    )
    assert match, f"{name} not set in {IMAGES_SCRIPT}"
    return match.group(1) or match.group(2)


@pytest.mark.parametrize(
    ("path", "workload"),
    OUR_WORKLOADS,
    ids=[f"{p.name}:{d['metadata']['name']}" for p, d in OUR_WORKLOADS],
)
def test_image_is_the_one_build_script_makes(path: Path, workload: Doc) -> None:
    """deploy/images/build.sh names its archives' images PREFIX/BINARY:VERSION: the name the
    manifest runs (imported with ctr, IfNotPresent finds it), and the gateway's uid is the
    one the pod runs as (fsGroup reads the Secrets)."""
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    container = only_container(workload)
    binary = container["command"][0]
    assert binary in {"cloud-gateway", "edge-agent"}
    prefix = _build_script_default("IMAGE_PREFIX")
    assert container["image"] == f"{prefix}/{binary}:{version}"
    assert container["imagePullPolicy"] == "IfNotPresent"
    if binary == "cloud-gateway":
        uid = int(_build_script_default("GATEWAY_UID"))
        security = pod_spec(workload)["securityContext"]
        assert (security["runAsUser"], security["runAsGroup"], security["fsGroup"]) == (uid,) * 3
