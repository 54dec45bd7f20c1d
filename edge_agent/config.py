"""Agent configuration: frozen dataclasses loaded once from TOML and the environment.

Every key can be overridden by an ``EDGE_AGENT_*`` variable named after its path, e.g.
``listen`` -> ``EDGE_AGENT_LISTEN`` and ``[attribution] proc_root`` ->
``EDGE_AGENT_ATTRIBUTION_PROC_ROOT``. Unknown keys and unknown ``EDGE_AGENT_*`` variables
are errors, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge_agent.errors import ConfigError

ENV_PREFIX = "EDGE_AGENT_"
# Variables with this prefix that are not config keys.
_ENV_RESERVED = frozenset({"EDGE_AGENT_CONFIG"})


@dataclass(frozen=True, kw_only=True)
class SimulateConfig:
    gpus: int = 0
    seed: int = 0
    mig: bool = False
    processes_per_gpu: int = 4
    # Write a fake /proc and kubelet log tree for the simulated processes, so that
    # attribution to pods and containers runs for real (see edge_agent.simhost).
    fake_host: bool = True


@dataclass(frozen=True, kw_only=True)
class AttributionConfig:
    proc_root: Path = Path("/proc")
    container_log_dir: Path = Path("/var/log/containers")
    pod_log_dir: Path = Path("/var/log/pods")
    runtime_sockets: tuple[Path, ...] = (
        Path("/var/run/docker.sock"),
        Path("/run/podman/podman.sock"),
    )
    cache_ttl_seconds: float = 60.0
    api_timeout_seconds: float = 1.0


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    node_name: str = ""
    listen: str = "127.0.0.1:9400"
    interval_seconds: float = 10.0
    process_interval_seconds: float = 10.0
    counters_file: Path | None = None
    log_level: str = "info"
    simulate: SimulateConfig = field(default_factory=SimulateConfig)
    attribution: AttributionConfig = field(default_factory=AttributionConfig)

    @property
    def listen_host(self) -> str:
        return split_host_port(self.listen)[0]

    @property
    def listen_port(self) -> int:
        return split_host_port(self.listen)[1]


def split_host_port(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"listen address {value!r} must look like HOST:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


def resolve_node_name(configured: str, environ: Mapping[str, str]) -> str:
    """Config, else ``KUBE_NODE_NAME``, else ``NODE_NAME``, else the hostname."""
    for candidate in (configured, environ.get("KUBE_NODE_NAME", ""), environ.get("NODE_NAME", "")):
        if candidate.strip():
            return candidate.strip()
    return socket.gethostname()


def load(path: Path | None = None, environ: Mapping[str, str] | None = None) -> AgentConfig:
    """Load the TOML file (optional), apply ``EDGE_AGENT_*`` overrides, validate."""
    env = os.environ if environ is None else environ
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise ConfigError(f"config file {path} does not exist") from exc
        except OSError as exc:
            raise ConfigError(f"config file {path} cannot be read: {exc.strerror}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    _apply_env(AgentConfig, data, env)
    cfg: AgentConfig = _build(AgentConfig, data, "")
    _validate(cfg)
    return cfg


def _validate(cfg: AgentConfig) -> None:
    split_host_port(cfg.listen)
    if cfg.interval_seconds <= 0 or cfg.process_interval_seconds <= 0:
        raise ConfigError("interval_seconds and process_interval_seconds must be > 0")
    if cfg.simulate.gpus < 0 or cfg.simulate.gpus > 64:
        raise ConfigError("simulate.gpus must be between 0 and 64")
    if cfg.log_level.lower() not in {"debug", "info", "warning", "error"}:
        raise ConfigError("log_level must be one of debug, info, warning, error")


def _env_paths(cls: type, prefix: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    out: dict[str, tuple[str, ...]] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = (*prefix, f.name)
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            out.update(_env_paths(hint, path))  # type: ignore[arg-type]
        else:
            out[ENV_PREFIX + "_".join(path).upper()] = path
    return out


def _apply_env(cls: type, data: dict[str, Any], env: Mapping[str, str]) -> None:
    known = _env_paths(cls, ())
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX) or name in _ENV_RESERVED:
            continue
        path = known.get(name)
        if path is None:
            raise ConfigError(f"unknown environment variable {name} (known: {', '.join(known)})")
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = _EnvString(raw)


class _EnvString(str):
    """A value that came from the environment: converted from text to the field's type."""


def _build(cls: type, data: Mapping[str, Any], where: str) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where or 'config'} must be a table")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"unknown key(s) in {where or 'config'}: {', '.join(unknown)}")
    kwargs = {}
    for name, value in data.items():
        key = f"{where}.{name}" if where else name
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, key)  # type: ignore[arg-type]
        else:
            kwargs[name] = _convert(hint, value, key)
    return cls(**kwargs)


def _convert(hint: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value in ("", None):
            return None
        return _convert(args[0], value, key)
    from_env = isinstance(value, _EnvString)
    if origin is tuple:
        (item,) = {a for a in typing.get_args(hint) if a is not Ellipsis}
        items = [v for v in value.split(",") if v.strip()] if from_env else value
        if not isinstance(items, list | tuple):
            raise ConfigError(f"{key} must be a list")
        return tuple(_convert(item, v.strip() if from_env else v, key) for v in items)
    try:
        if hint is bool:
            if from_env:
                return _parse_bool(value, key)
            if not isinstance(value, bool):
                raise TypeError
            return value
        if hint is int and not from_env and isinstance(value, bool):
            raise TypeError
        if hint in (int, float) and not from_env and not isinstance(value, int | float):
            raise TypeError
        if hint is str and not isinstance(value, str):
            raise TypeError
        return hint(value)
    except (TypeError, ValueError) as exc:
        name = getattr(hint, "__name__", str(hint))
        raise ConfigError(f"{key} must be of type {name}, got {value!r}") from exc


def _parse_bool(value: str, key: str) -> bool:
    lowered = value.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off", ""}:
        return False
    raise ConfigError(f"{key} must be a boolean (true/false), got {value!r}")
