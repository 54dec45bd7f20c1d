"""Frozen-dataclass settings from TOML plus environment overrides (agent and gateway).

Every field can be overridden by ``<PREFIX><PATH>``: ``listen`` -> ``EDGE_AGENT_LISTEN``,
``[attribution] proc_root`` -> ``EDGE_AGENT_ATTRIBUTION_PROC_ROOT``; lists are
comma-separated. Unknown keys and unknown prefixed variables are errors, so a typo never
silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from gpurelay.compat import tomllib

T = TypeVar("T")


class SettingsError(Exception):
    """A configuration file or variable is invalid; the message names the key."""


def load_settings(
    cls: type[T],
    path: Path | None,
    environ: Mapping[str, str],
    *,
    prefix: str,
    reserved: frozenset[str] = frozenset(),
) -> T:
    """Read the TOML file (optional), apply ``prefix``-ed variables, build ``cls``."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise SettingsError(f"config file {path} does not exist") from exc
        except OSError as exc:
            raise SettingsError(f"config file {path} cannot be read: {exc.strerror}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise SettingsError(f"config file {path} is not valid TOML: {exc}") from exc
    _apply_env(cls, data, environ, prefix, reserved)
    result: T = _build(cls, data, "")
    return result


def _env_paths(cls: type, path_prefix: tuple[str, ...], prefix: str) -> dict[str, tuple[str, ...]]:
    out: dict[str, tuple[str, ...]] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = (*path_prefix, f.name)
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            out.update(_env_paths(hint, path, prefix))  # type: ignore[arg-type]
        else:
            out[prefix + "_".join(path).upper()] = path
    return out


def _apply_env(
    cls: type, data: dict[str, Any], env: Mapping[str, str], prefix: str, reserved: frozenset[str]
) -> None:
    known = _env_paths(cls, (), prefix)
    for name, raw in env.items():
        if not name.startswith(prefix) or name in reserved:
            continue
        path = known.get(name)
        if path is None:
            raise SettingsError(f"unknown environment variable {name} (known: {', '.join(known)})")
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = _EnvString(raw)


class _EnvString(str):
    """A value that came from the environment: converted from text to the field's type."""


def _build(cls: type, data: Mapping[str, Any], where: str) -> Any:
    if not isinstance(data, Mapping):
        raise SettingsError(f"{where or 'config'} must be a table")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise SettingsError(f"unknown key(s) in {where or 'config'}: {', '.join(unknown)}")
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
        if dataclasses.is_dataclass(item):  # an array of tables: [[publish]]
            if from_env or not isinstance(value, list):
                raise SettingsError(f"{key} must be an array of tables ([[{key}]] in TOML)")
            return tuple(_build(item, v, f"{key}[{i}]") for i, v in enumerate(value))  # type: ignore[arg-type]
        items = [v for v in value.split(",") if v.strip()] if from_env else value
        if not isinstance(items, list | tuple):
            raise SettingsError(f"{key} must be a list")
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
        raise SettingsError(f"{key} must be of type {name}, got {value!r}") from exc


def _parse_bool(value: str, key: str) -> bool:
    lowered = value.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off", ""}:
        return False
    raise SettingsError(f"{key} must be a boolean (true/false), got {value!r}")


def split_host_port(value: str, what: str = "listen address") -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too; an empty host means every address) as a pair;
    :class:`SettingsError` naming ``what`` otherwise."""
    host, sep, port = value.rpartition(":")
    shown = repr(value) if len(value) <= 80 else f"{value[:60]!r}... ({len(value)} characters)"
    if not sep:
        raise SettingsError(f"{what} {shown} must look like HOST:PORT")
    # ASCII digits only: str.isdigit also takes '²', and int() refuses 5,000 digits
    if not (port.isascii() and port.isdigit() and len(port) <= 5) or int(port) > 65535:
        raise SettingsError(
            f"{what} {shown} must look like HOST:PORT, the port 1..65535 in ASCII digits "
            "(0: any free port)"
        )
    return host.strip("[]") or "0.0.0.0", int(port)
