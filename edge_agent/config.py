"""Agent configuration: frozen dataclasses loaded once from TOML and the environment.

Every key can be overridden by an ``EDGE_AGENT_*`` variable named after its path, e.g.
``listen`` -> ``EDGE_AGENT_LISTEN`` and ``[attribution] proc_root`` ->
``EDGE_AGENT_ATTRIBUTION_PROC_ROOT``. Unknown keys and unknown ``EDGE_AGENT_*`` variables
are errors, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from edge_agent.errors import ConfigError
from edge_agent.proxy_connect import proxy_route
from gpurelay.logs import FORMATS as LOG_FORMATS
from gpurelay.model import NODE_LABEL_NAMES
from gpurelay.naming import DEFAULT_NAMING, NAMINGS
from gpurelay.settings import SettingsError, load_settings, split_host_port
from gpurelay.web_config import WebConfig, WebConfigError, load_web_config
from gpurelay.wire.frames import MAX_ACK_DELAY_SECONDS

ENV_PREFIX = "EDGE_AGENT_"
# Variables with this prefix that are not config keys.
_ENV_RESERVED = frozenset({"EDGE_AGENT_CONFIG"})


@dataclass(frozen=True, kw_only=True)
class SimulateConfig:
    gpus: int = 0  # 0 with a profile: the profile's count
    seed: int = 0
    mig: bool = False
    # A machine profile (edge_agent.sim.profiles: h100-sxm, h100-mig, a100-mig, rtx-4090,
    # r470, h100-nocaps): what real NVML answers there, failures included; or a Jetson
    # board (edge_agent.sim.jetson: jetson-orin, jetson-orin-nano, jetson-xavier): a fake
    # L4T tree that the Jetson backend reads.
    profile: str = ""

    @property
    def enabled(self) -> bool:
        return self.gpus > 0 or bool(self.profile)

    @property
    def jetson(self) -> bool:
        """A Jetson board rather than an NVML machine profile."""
        from edge_agent.sim.jetson import BOARDS

        return self.profile in BOARDS

    processes_per_gpu: int = 4
    # Write a fake /proc and kubelet log tree for the simulated processes, so that
    # attribution to pods and containers runs for real (see edge_agent.sim.host).
    fake_host: bool = True
    # Serve the fake host's pods through a real pod-resources gRPC server in its directory:
    # "nvidia" (nvidia.com/gpu, MIG, time-slicing replicas) or "gpushare" (aliyun.com/gpu-mem).
    pod_resources: str = ""


GPU_BACKENDS = ("auto", "nvml", "jetson")


@dataclass(frozen=True, kw_only=True)
class GpuConfig:
    """Where the GPU figures come from (issue 28, docs/jetson.md)."""

    # "nvml": the NVIDIA driver's NVML (data-centre and desktop GPUs); "jetson": the kernel
    # files of an L4T board (its integrated GPU, which DCGM does not support and NVML
    # answers little for); "auto": NVML, unless the host is a Jetson (an L4T release, or a
    # Tegra SoC in the device tree) whose NVML is absent or lists only its integrated GPU:
    # then the Jetson's files (edge_agent.backend).
    backend: str = "auto"
    # The host's root filesystem, under which the Jetson backend reads sys/, proc/, etc/
    # and var/: "/" on the host, the host's / mounted read-only (e.g. /host) in a pod.
    host_root: Path = Path("/")


@dataclass(frozen=True, kw_only=True)
class AttributionConfig:
    proc_root: Path = Path("/proc")
    container_log_dir: Path = Path("/var/log/containers")
    pod_log_dir: Path = Path("/var/log/pods")
    # A path with * is a pattern, expanded at start and once per cache TTL: the per-user
    # sockets of rootless Podman and Docker (asked only about that user's containers).
    runtime_sockets: tuple[Path, ...] = (
        Path("/var/run/docker.sock"),
        Path("/run/podman/podman.sock"),
        Path("/run/user/*/podman/podman.sock"),
        Path("/run/user/*/docker.sock"),
    )
    cache_ttl_seconds: float = 60.0
    api_timeout_seconds: float = 1.0
    # The kubelet's pod-resources API (edge_agent.attribute.pod_resources): pod labels on
    # the device series of allocated GPUs, ACK's allocation metrics. None/"" turns it off.
    pod_resources_socket: Path | None = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
    pod_resources_ttl_seconds: float = 10.0
    pod_resources_timeout_seconds: float = 1.0
    gpu_resource_names: tuple[str, ...] = ()  # besides nvidia.com/gpu and nvidia.com/mig-*
    gpu_memory_resource_names: tuple[str, ...] = ("aliyun.com/gpu-mem",)
    gpu_memory_unit: str = "GiB"  # one unit of those: "GiB" or "MiB" (gpushare --memory-unit)
    old_pod_label_names: bool = False  # pod_name, pod_namespace, container_name


@dataclass(frozen=True, kw_only=True)
class KubernetesConfig:
    """Pod labels and annotations as metric labels (edge_agent.attribute.pod_metadata):
    the keys to copy, at most 16 in all; none (the default) reads nothing."""

    pod_labels: tuple[str, ...] = ()
    pod_annotations: tuple[str, ...] = ()
    # "" in a pod: https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT
    api_server: str = ""
    token_file: Path = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
    ca_file: Path = Path("/var/run/secrets/kubernetes.io/serviceaccount/ca.crt")
    refresh_seconds: float = 30.0
    timeout_seconds: float = 5.0

    @property
    def enabled(self) -> bool:
        return bool(self.pod_labels or self.pod_annotations)


@dataclass(frozen=True, kw_only=True)
class TunnelConfig:
    """Where and how to push. An empty address means: serve locally only, do not push."""

    address: str = ""  # HOST:PORT of the gateway's SSH listener (default port 2222)
    # Several gateways without a balancer (bare metal): HOST[:PORT] each, instead of address.
    # Each agent starts at a place in the list given by its node name and goes round it
    # (edge_agent.dial.Rotation); a failed dial moves on to the next address at once.
    addresses: tuple[str, ...] = ()
    # An HTTP CONNECT proxy to each address (edge_agent.proxy_connect): "" none,
    # "http://[USER:PASSWORD@]HOST:PORT", or "env" for https_proxy / all_proxy. An address
    # that no_proxy / NO_PROXY names is dialled directly.
    proxy: str = ""
    known_hosts: Path | None = None  # "@cert-authority * <host CA>" line(s) or a pinned key
    key: Path | None = None  # the node's private key
    certificate: Path | None = None  # default: <key>-cert.pub
    # Renewal over the tunnel (edge_agent.renew): from 2/3 of the certificate's lifetime on,
    # ask the gateway for a new one for this node; with renew_new_key, for a key made then.
    # The key's and certificate's directory must be writable by the agent.
    renew: bool = True
    renew_new_key: bool = False
    # TCP handshake (a SYN nobody answers: a silent path, retried after a short pause)
    # and then the SSH handshake and login (a slow or refusing gateway: growing backoff).
    dial_timeout_seconds: float = 3.0
    connect_timeout_seconds: float = 10.0
    backoff_initial_seconds: float = 1.0
    backoff_max_seconds: float = 60.0
    # ACKs gathered by the gateway: each batch is acknowledged at most about this late (+ the
    # gateway's 1 s tick), in one ACK_RANGES frame with the others, so the gateway writes one
    # frame every few batches instead of one per batch. Replays are acknowledged at once
    # whatever this says. 0: one ACK frame per batch at once (needed for a gateway older
    # than range ACKs, which refuses the HELLO field). At most 60.
    ack_delay_seconds: float = 3.0
    # Protocol liveness: the gateway sends ACKs or a HEARTBEAT at least every heartbeat
    # period, max(min(interval_seconds, 5 s), ack_delay_seconds); with nothing from it for
    # this long the agent drops the session and dials again. 0: 3 x that period + 5 s
    # (20 s at a 10 s interval, 14 s at 1 s with the default ack delay).
    silence_timeout_seconds: float = 0.0
    # SSH keepalives, the backstop under the protocol's own liveness.
    keepalive_seconds: float = 15.0
    keepalive_count_max: int = 3
    # SSH ciphers in order of preference (the client's order decides). AES-GCM first: with
    # AES instructions (x86, ARMv8 crypto extensions, Jetson) it costs about a fifth of
    # chacha20-poly1305 per packet in asyncssh; put chacha20 first on CPUs without them.
    ciphers: tuple[str, ...] = (
        "aes128-gcm@openssh.com",
        "aes256-gcm@openssh.com",
        "chacha20-poly1305@openssh.com",
    )

    @property
    def host_port(self) -> tuple[str, int]:
        return gateway_host_port(self.address, "gateway.address")

    @property
    def gateways(self) -> tuple[tuple[str, int], ...]:
        """Every gateway address to dial, in the order configured; empty: do not push."""
        if self.addresses:
            return tuple(
                gateway_host_port(a, f"gateway.addresses[{i}]")
                for i, a in enumerate(self.addresses)
            )
        return (self.host_port,) if self.address else ()

    @property
    def certificate_path(self) -> Path | None:
        if self.certificate is not None:
            return self.certificate
        return None if self.key is None else self.key.with_name(self.key.name + "-cert.pub")


DEFAULT_GATEWAY_PORT = 2222


def gateway_host_port(value: str, key: str) -> tuple[str, int]:
    """``HOST[:PORT]`` of a gateway (port 2222 unless given); a SettingsError naming ``key``."""
    value = value.strip()
    if not value or value.startswith(":"):
        raise SettingsError(f"{key} {value!r} must look like HOST[:PORT]")
    address = value if ":" in value else f"{value}:{DEFAULT_GATEWAY_PORT}"
    host, port = split_host_port(address, key)
    if not 1 <= port <= 65535:
        raise SettingsError(f"{key} {value!r}: the port must be 1..65535")
    return host, port


@dataclass(frozen=True, kw_only=True)
class SpoolConfig:
    """The durable spool (edge_agent.spool): every collection is committed here before it
    is sent and leaves when the gateway acknowledged it. Used only when a gateway is set."""

    enabled: bool = True
    directory: Path = Path("/var/lib/edge-gpu-relay")  # systemd StateDirectory
    max_bytes: int = 256 * 1024 * 1024
    max_age_seconds: float = 24 * 3600
    # After a reconnect: backlog batches sent per second, interleaved with live ones.
    replay_batches_per_second: float = 50.0
    max_in_flight: int = 64  # batches sent and not yet acknowledged, at most

    @property
    def path(self) -> Path:
        return self.directory / "spool.sqlite"


@dataclass(frozen=True, kw_only=True)
class PublishConfig:
    """One endpoint the gateway may reach through this agent's tunnel, as NODE:PORT.

    ``node`` empty means this node; another name publishes a sibling machine of the edge
    LAN under its own node name (this agent is then the gateway node of its domain).
    """

    name: str  # what it is, e.g. "node_exporter"
    port: int  # the port Prometheus asks for: NODE:PORT
    host: str = "127.0.0.1"  # where the agent connects on the edge side
    target_port: int = 0  # default: the same as port
    node: str = ""

    @property
    def target(self) -> int:
        return self.target_port or self.port


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    node_name: str = ""
    # The label naming the node on device series and gpurelay_agent_info: "Hostname"
    # (dcgm-exporter up to 4.8) or "hostname" (its next release, PR #655). ACK series
    # carry NodeName, and device series NodeName as well. Behind a gateway, the gateway's
    # [registry] node_label decides what it publishes.
    node_label: str = "Hostname"
    domain: str = ""  # network domain reported to the gateway (default: the node name)
    listen: str = "127.0.0.1:9400"
    interval_seconds: float = 10.0
    process_interval_seconds: float = 10.0
    # How long one cycle waits for a GPU's NVML calls (at most interval_seconds): a GPU
    # whose call hangs is left out (gpurelay_agent_degraded{part="nvml_calls"}), the others
    # are published, and the liveness probe does not see a stuck agent.
    nvml_deadline_seconds: float = 5.0
    counters_file: Path | None = None
    # dcgm-exporter's naming scheme (gpurelay.naming, docs/migration.md): "4.9" (DCGM 4.7
    # names and units) or "4.8" (the default). It chooses the built-in counters when no
    # counters_file is set, and the driver label's name when the file lists none; a
    # counters file's own names are published as they are.
    dcgm_naming: str = DEFAULT_NAMING
    # The windows of DCGM_EXP_XID_ERRORS_COUNT and DCGM_EXP_CLOCK_EVENTS_COUNT (when the
    # counters file lists them), as dcgm-exporter's --xid-count-window-size and
    # --clock-events-count-window-size: milliseconds, 5 minutes by default.
    xid_count_window_ms: int = 300_000
    clock_events_count_window_ms: int = 300_000
    log_level: str = "info"
    log_format: str = "text"  # or "json": one JSON object per line (gpurelay.logs)
    simulate: SimulateConfig = field(default_factory=SimulateConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)
    attribution: AttributionConfig = field(default_factory=AttributionConfig)
    kubernetes: KubernetesConfig = field(default_factory=KubernetesConfig)
    gateway: TunnelConfig = field(default_factory=TunnelConfig)
    spool: SpoolConfig = field(default_factory=SpoolConfig)
    # Endpoints reachable through the tunnel. The agent's own exporter is always offered
    # (as NODE:<listen port>) unless publish_agent is false; nothing else is reachable.
    publish_agent: bool = True
    publish: tuple[PublishConfig, ...] = ()
    # TLS and basic auth on the listener: the Prometheus web-config file node_exporter
    # takes as --web.config.file (gpurelay.web_config). Off by default (loopback).
    web_config_file: Path | None = None

    def web_config(self) -> WebConfig | None:
        """The parsed file (ConfigError naming web_config_file), or None."""
        if self.web_config_file is None:
            return None
        try:
            return load_web_config(self.web_config_file, key="web_config_file")
        except WebConfigError as exc:
            raise ConfigError(str(exc)) from exc

    @property
    def listen_host(self) -> str:
        return split_host_port(self.listen)[0]

    @property
    def listen_port(self) -> int:
        return split_host_port(self.listen)[1]


# The liveness period: with nothing from the gateway for 3 such periods + 5 s the agent
# drops the session (``silence_timeout``); the interval, at most this, at least the ACK delay.
LIVENESS_SECONDS = 5.0
# The agent asks to hear from the gateway at least this often (below the wire's
# MAX_HEARTBEAT_SECONDS, the most any agent may ask for), and at least twice per silence
# timeout: at a 10 s interval a heartbeat every 10 s, so a link whose ACKs come once per
# batch carries no heartbeat at all (issue 26: one per batch at 5 s, ~40 % of an idle
# gateway's CPU), while the session is still dropped after the same 20 s of silence.
HEARTBEAT_ASK_SECONDS = 10.0


def liveness_seconds(interval: float, ack_delay: float = 0.0) -> float:
    """The period the silence timeout is made of: the interval, at most
    :data:`LIVENESS_SECONDS`, never less than the ACK delay (the gateway may hold ACKs that
    long)."""
    return max(min(interval, LIVENESS_SECONDS), ack_delay)


def heartbeat_seconds(interval: float, ack_delay: float = 0.0, silence: float = 0.0) -> float:
    """How often the agent asks to hear from the gateway (HELLO ``heartbeat_seconds``): the
    interval, at most :data:`HEARTBEAT_ASK_SECONDS` and half the ``silence`` timeout (when
    given), never more often than ACKs are due, or HEARTBEATs would stand in for the ACK
    frames that the delay saves."""
    most = min(interval, HEARTBEAT_ASK_SECONDS)
    if silence > 0:
        most = min(most, silence / 2)
    return max(most, ack_delay)


def silence_timeout(cfg: TunnelConfig, interval: float) -> float:
    """Seconds with nothing from the gateway after which the agent drops the session."""
    beat = liveness_seconds(interval, cfg.ack_delay_seconds)
    return cfg.silence_timeout_seconds or 3 * beat + 5.0


def resolve_node_name(configured: str, environ: Mapping[str, str]) -> str:
    """Config, else ``KUBE_NODE_NAME``, else ``NODE_NAME``, else the hostname."""
    for candidate in (configured, environ.get("KUBE_NODE_NAME", ""), environ.get("NODE_NAME", "")):
        if candidate.strip():
            return candidate.strip()
    return socket.gethostname()


def load(path: Path | None = None, environ: Mapping[str, str] | None = None) -> AgentConfig:
    """Load the TOML file (optional), apply ``EDGE_AGENT_*`` overrides, validate."""
    env = os.environ if environ is None else environ
    try:
        cfg = load_settings(AgentConfig, path, env, prefix=ENV_PREFIX, reserved=_ENV_RESERVED)
        _validate(cfg)  # split_host_port raises SettingsError too
        proxy_route(cfg.gateway.proxy, env)  # a bad proxy URL (here or in env) fails now
    except SettingsError as exc:
        raise ConfigError(str(exc)) from exc
    return cfg


SIMULATED_POD_RESOURCES = ("", "nvidia", "gpushare")
GPU_MEMORY_UNITS_MIB = {"GiB": 1024, "MiB": 1}


def _validate_pod_resources(cfg: AgentConfig) -> None:
    a = cfg.attribution
    if a.gpu_memory_unit not in GPU_MEMORY_UNITS_MIB:
        raise ConfigError(
            f"attribution.gpu_memory_unit must be GiB or MiB, not {a.gpu_memory_unit!r}"
        )
    if not (a.pod_resources_ttl_seconds > 0 and a.pod_resources_timeout_seconds > 0):
        raise ConfigError(
            "attribution.pod_resources_ttl_seconds and pod_resources_timeout_seconds must be > 0"
        )
    if cfg.simulate.pod_resources not in SIMULATED_POD_RESOURCES:
        raise ConfigError(
            "simulate.pod_resources must be empty, nvidia or gpushare, "
            f"not {cfg.simulate.pod_resources!r}"
        )


def _validate_kubernetes(k: KubernetesConfig) -> None:
    from edge_agent.attribute.pod_metadata import MAX_KEYS

    keys = (*k.pod_labels, *k.pod_annotations)
    if len(keys) > MAX_KEYS:
        raise ConfigError(
            f"kubernetes.pod_labels and pod_annotations list {len(keys)} keys; at most "
            f"{MAX_KEYS} (each is a label on every series of the pod's GPUs)"
        )
    if any(not key or len(key) > 317 for key in keys):  # a Kubernetes key: 253 + "/" + 63
        raise ConfigError("kubernetes.pod_labels and pod_annotations: a key is empty or too long")
    if not (k.refresh_seconds > 0 and k.timeout_seconds > 0):
        raise ConfigError("kubernetes.refresh_seconds and timeout_seconds must be > 0")


def _validate_profile(name: str) -> None:
    # imported here: the profiles name pynvml's codes, and loading a config (the installer
    # checks the one it writes) must not need pynvml
    from edge_agent.sim.jetson import BOARDS
    from edge_agent.sim.profiles import PROFILES

    if name not in PROFILES and name not in BOARDS:
        raise ConfigError(
            f"simulate.profile {name!r} is not a machine profile or a Jetson board "
            f"(known: {', '.join(sorted([*PROFILES, *BOARDS]))})"
        )


def validate(cfg: AgentConfig) -> AgentConfig:
    """``cfg`` checked as :func:`load` checks a file's (for one changed by the command line)."""
    try:
        _validate(cfg)
    except SettingsError as exc:
        raise ConfigError(str(exc)) from exc
    return cfg


def _validate_simulated_jetson(sim: SimulateConfig) -> None:
    if sim.gpus > 1:
        raise ConfigError(
            f"simulate: a Jetson ({sim.profile}) has one integrated GPU, not {sim.gpus}"
        )
    if sim.mig or sim.pod_resources:
        raise ConfigError(
            f"simulate: a Jetson ({sim.profile}) has no MIG and no device-plugin allocation "
            "to simulate (simulate.mig, simulate.pod_resources are for NVML profiles)"
        )


def _validate(cfg: AgentConfig) -> None:
    split_host_port(cfg.listen)
    cfg.web_config()  # a bad file is an error at load, not at the first scrape
    if cfg.interval_seconds <= 0 or cfg.process_interval_seconds <= 0:
        raise ConfigError("interval_seconds and process_interval_seconds must be > 0")
    if cfg.nvml_deadline_seconds <= 0:
        raise ConfigError("nvml_deadline_seconds must be > 0")
    for name in ("xid_count_window_ms", "clock_events_count_window_ms"):
        if not 1_000 <= getattr(cfg, name) <= 7 * 86_400_000:
            raise ConfigError(f"{name} must be between 1000 (1 s) and 604800000 (a week)")
    if cfg.simulate.gpus < 0 or cfg.simulate.gpus > 64:
        raise ConfigError("simulate.gpus must be between 0 and 64")
    if cfg.simulate.profile:
        _validate_profile(cfg.simulate.profile)
    if cfg.simulate.jetson:
        _validate_simulated_jetson(cfg.simulate)
    if cfg.gpu.backend not in GPU_BACKENDS:
        raise ConfigError(
            f"gpu.backend must be one of {', '.join(GPU_BACKENDS)}, not {cfg.gpu.backend!r}"
        )
    _validate_pod_resources(cfg)
    _validate_kubernetes(cfg.kubernetes)
    if cfg.dcgm_naming not in NAMINGS:
        raise ConfigError(
            f"dcgm_naming must be one of {', '.join(repr(n) for n in NAMINGS)}, "
            f"not {cfg.dcgm_naming!r}"
        )
    if cfg.node_label not in NODE_LABEL_NAMES:
        raise ConfigError(
            f"node_label must be one of {', '.join(NODE_LABEL_NAMES)}, not {cfg.node_label!r}"
        )
    if cfg.log_level.lower() not in {"debug", "info", "warning", "error"}:
        raise ConfigError("log_level must be one of debug, info, warning, error")
    if cfg.log_format not in LOG_FORMATS:
        raise ConfigError(f"log_format must be text or json, not {cfg.log_format!r}")
    sp = cfg.spool
    if sp.max_bytes <= 0 or sp.max_age_seconds <= 0:
        raise ConfigError("spool.max_bytes and spool.max_age_seconds must be > 0")
    if sp.replay_batches_per_second <= 0 or sp.max_in_flight < 1:
        raise ConfigError("spool.replay_batches_per_second must be > 0, spool.max_in_flight >= 1")
    seen: set[tuple[str, int]] = set()
    for entry in cfg.publish:
        if not (1 <= entry.port <= 65535 and 0 <= entry.target_port <= 65535):
            raise ConfigError(f"publish {entry.name!r}: ports must be 1..65535")
        key = (entry.node, entry.port)
        if key in seen:
            raise ConfigError(f"publish: {entry.node or 'this node'}:{entry.port} is listed twice")
        seen.add(key)
    gw = cfg.gateway
    for name in ("dial_timeout_seconds", "connect_timeout_seconds", "keepalive_seconds"):
        if not getattr(gw, name) > 0:
            raise ConfigError(f"gateway.{name} must be > 0, not {getattr(gw, name)}")
    if not gw.silence_timeout_seconds >= 0 or gw.keepalive_count_max < 1:
        raise ConfigError(
            "gateway.silence_timeout_seconds must be >= 0 (0: automatic), "
            "gateway.keepalive_count_max >= 1"
        )
    if not 0 <= gw.ack_delay_seconds <= MAX_ACK_DELAY_SECONDS:
        raise ConfigError(
            f"gateway.ack_delay_seconds must be in 0..{MAX_ACK_DELAY_SECONDS:g} "
            f"(0: an ACK per batch at once), not {gw.ack_delay_seconds}"
        )
    beat = liveness_seconds(cfg.interval_seconds, gw.ack_delay_seconds)
    if gw.silence_timeout_seconds and gw.silence_timeout_seconds <= beat:
        raise ConfigError(
            f"gateway.silence_timeout_seconds ({gw.silence_timeout_seconds:g}) must be more "
            f"than the heartbeat period ({beat:g}s = max(min(interval_seconds, "
            f"{LIVENESS_SECONDS:g}s), ack_delay_seconds)): the gateway is heard from "
            "about that often"
        )
    _validate_gateway_addresses(gw)


def _validate_gateway_addresses(gw: TunnelConfig) -> None:
    if gw.address and gw.addresses:
        raise ConfigError(
            "gateway.address and gateway.addresses are both set: use address for one gateway "
            "(or a balancer in front of several), addresses for a list of gateways to go "
            "round, not both"
        )
    gateways = gw.gateways  # each address parsed: a SettingsError names the bad one
    seen: set[tuple[str, int]] = set()
    for i, hp in enumerate(gateways):
        if hp in seen:
            raise ConfigError(
                f"gateway.addresses[{i}] {gw.addresses[i]!r}: {hp[0]}:{hp[1]} is listed twice"
            )
        seen.add(hp)
    if gateways:
        key = "gateway.addresses" if gw.addresses else "gateway.address"
        missing = [
            n
            for n, v in (("gateway.key", gw.key), ("gateway.known_hosts", gw.known_hosts))
            if v is None
        ]
        if missing:
            raise ConfigError(f"{key} is set, so {' and '.join(missing)} must be too")
