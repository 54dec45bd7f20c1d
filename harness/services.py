"""Our two binaries as child processes on loopback, each configured by a TOML file written
here: the gateway (``python -m cloud_gateway run --config FILE``) and the agent
(``python -m edge_agent run --config FILE``, simulated GPUs)."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from cloud_gateway.cluster.config import ClusterConfig
from cloud_gateway.config import GatewayConfig
from cloud_gateway.config import load as load_gateway_config
from cloud_gateway.registry.config import RegistryConfig
from harness.fleet import Pki, gateway_config
from harness.ports import free_ports
from harness.process import HarnessError, Process, clean_env


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str | Path):
        return json.dumps(str(value))  # a JSON string is a valid TOML basic string
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def gateway_toml(cfg: GatewayConfig) -> str:
    """``cfg`` as the TOML file ``cloud-gateway run --config`` reads (None: left out)."""
    top: list[str] = []
    tables: list[str] = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            tables.append(f"\n[{f.name}]")
            for sub in dataclasses.fields(value):
                item = getattr(value, sub.name)
                if item is not None:
                    tables.append(f"{sub.name} = {_toml_value(item)}")
        elif value is not None:
            top.append(f"{f.name} = {_toml_value(value)}")
    return "\n".join(top + tables) + "\n"


class GatewayProc(Process):
    """The gateway: SSH and HTTP on free loopback ports, the fleet's user CA, the operator
    token ``harness.fleet.TOKEN``; remote write to ``remote_write_url`` (the receiver's base
    URL) when one is given. Its config is ``tmp/gateway.toml``, its log ``tmp/gateway.log``
    (``log_format = "json"``: one JSON object per line).
    ``ssh_host``: the SSH listener's address instead of loopback (an
    :class:`harness.netns.Uplink`'s ``gateway_host``; the PKI must name it); ``registry``:
    keys of its ``[registry]`` section (liveness thresholds); ``cluster``: its ``[cluster]``
    section (a member of several gateways on one PostgreSQL); ``enroll``: keys of its
    ``[enroll]`` section (enrollment and renewal of node certificates)."""

    def __init__(
        self,
        pki: Pki,
        tmp: Path,
        remote_write_url: str = "",
        *,
        log_level: str = "info",
        log_format: str = "text",
        ssh_host: str = "127.0.0.1",
        registry: Mapping[str, Any] | None = None,
        cluster: ClusterConfig | None = None,
        enroll: Mapping[str, Any] | None = None,
    ) -> None:
        self.ssh_port, self.http_port = free_ports(2)
        self.ssh_host = ssh_host
        self.url = f"http://127.0.0.1:{self.http_port}"
        cfg = gateway_config(
            pki, ssh_port=self.ssh_port, http_port=self.http_port, ssh_host=ssh_host
        )
        if registry:
            cfg = dataclasses.replace(cfg, registry=RegistryConfig(**registry))
        if cluster is not None:
            cfg = dataclasses.replace(cfg, cluster=cluster)
        if enroll:
            cfg = dataclasses.replace(cfg, enroll=dataclasses.replace(cfg.enroll, **enroll))
        remote_write = cfg.remote_write
        if remote_write_url:
            remote_write = dataclasses.replace(
                remote_write, url=f"{remote_write_url}/api/v1/write", max_backoff_seconds=1.0
            )
        self.config = dataclasses.replace(
            cfg, log_level=log_level, log_format=log_format, remote_write=remote_write
        )
        path = tmp / "gateway.toml"
        path.write_text(gateway_toml(self.config))
        if load_gateway_config(path, {}) != self.config:
            raise HarnessError(f"{path} does not read back as the config it was written from")
        super().__init__(
            "gateway",
            [sys.executable, "-m", "cloud_gateway", "run", "--config", str(path)],
            tmp / "gateway.log",
            clean_env("CLOUD_GATEWAY_"),
        )

    def ready(self) -> bool:
        return httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=10).text


def _issued(pki: Pki, node: str) -> tuple[Path, Path]:
    creds = pki.node(node)
    assert creds.private_key is not None
    return creds.private_key, creds.certificate


class AgentProc(Process):
    """An agent of ``node`` with two simulated GPUs, collecting every second and pushing to
    ``gateway`` through its spool in ``spool_dir``. ``prefix`` goes before its argv, e.g.
    :attr:`harness.netns.Uplink.prefix` to run it in the edge namespace (its local HTTP,
    ``url`` and :meth:`metric`, is then inside that namespace, out of this one's reach).
    ``address``: HOST:PORT to dial instead of ``gateway``'s (a balancer in front of it);
    ``addresses``: a list of them instead (``[gateway] addresses``, no balancer);
    ``credentials``: its key and certificate files (an enrolled node's) instead of a
    certificate issued here."""

    def __init__(
        self,
        pki: Pki,
        tmp: Path,
        node: str,
        gateway: GatewayProc | None,
        *,
        spool_dir: Path,
        replay_rate: float = 50.0,
        max_in_flight: float = 64,
        prefix: Sequence[str] = (),
        address: str = "",
        addresses: Sequence[str] = (),
        credentials: tuple[Path, Path] | None = None,
    ) -> None:
        key, certificate = credentials or _issued(pki, node)
        if addresses:
            dial = "addresses = [" + ", ".join(f'"{a}"' for a in addresses) + "]"
        else:
            if not address:
                assert gateway is not None, "an agent needs a gateway, an address or addresses"
                address = f"{gateway.ssh_host}:{gateway.ssh_port}"
            dial = f'address = "{address}"'
        (self.port,) = free_ports(1)
        self.url = f"http://127.0.0.1:{self.port}"
        config = tmp / f"agent-{node}.toml"
        config.write_text(
            f"""node_name = "{node}"
listen = "127.0.0.1:{self.port}"
interval_seconds = 1.0
process_interval_seconds = 1.0

[simulate]
gpus = 2
seed = 11
processes_per_gpu = 2

[gateway]
{dial}
known_hosts = "{pki.ca.known_hosts}"
key = "{key}"
certificate = "{certificate}"
backoff_initial_seconds = 0.2
backoff_max_seconds = 1.0
connect_timeout_seconds = 5.0

[spool]
directory = "{spool_dir}"
replay_batches_per_second = {replay_rate}
max_in_flight = {int(max_in_flight)}
"""
        )
        super().__init__(
            f"agent {node}",
            [*prefix, sys.executable, "-m", "edge_agent", "run", "--config", str(config)],
            tmp / f"agent-{node}.log",
            clean_env("EDGE_AGENT_"),
        )

    def metric(self, name: str) -> float:
        """A label-less series of the agent's local /metrics."""
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise ValueError(f"{name} not in the agent's /metrics")
