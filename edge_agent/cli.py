"""``edge-agent run|once|enroll``: argument parsing and one-line errors instead of tracebacks."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from edge_agent import __version__
from edge_agent.config import AgentConfig, SimulateConfig, load, resolve_node_name, validate
from edge_agent.errors import AgentError, ConfigError
from gpurelay import logs
from gpurelay.bie import collect_document
from gpurelay.exposition import render_text
from gpurelay.model import Snapshot
from gpurelay.naming import NAMINGS


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="edge-agent", description="edge-gpu-relay edge agent")
    p.add_argument("--version", action="version", version=f"edge-agent {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", type=Path, help="TOML config file")
    common.add_argument(
        "--simulate",
        metavar="N|PROFILE[:N]",
        help="simulated GPUs: N of the default machine (h100-sxm), or a machine profile "
        "(h100-sxm, h100-mig, a100-mig, rtx-4090, r470, h100-nocaps: docs/simulator.md) "
        "with its own GPU count or N, or a Jetson board (jetson-orin, jetson-orin-nano, "
        "jetson-xavier: docs/jetson.md)",
    )
    common.add_argument("--simulate-seed", type=int, metavar="SEED")
    common.add_argument("--simulate-mig", action="store_true", help="GPU 0 in MIG mode")
    common.add_argument(
        "--simulate-pod-resources",
        choices=("nvidia", "gpushare"),
        help="serve the simulated pods' GPUs over a pod-resources socket, as NVIDIA's device "
        "plugin or ACK GPU sharing allocates them",
    )
    common.add_argument(
        "--node-name", help="node name (default: config, KUBE_NODE_NAME, NODE_NAME, hostname)"
    )
    common.add_argument("--counters", type=Path, help="dcgm-exporter counters CSV")
    common.add_argument(
        "--dcgm-naming",
        choices=NAMINGS,
        help="dcgm-exporter's names: 4.8 (default) or 4.9 (DCGM 4.7 names and units) for the "
        "built-in counters and the driver label (docs/migration.md)",
    )
    run = sub.add_parser("run", parents=[common], help="collect and serve until stopped")
    run.add_argument("--listen", help="HOST:PORT for /metrics (default 127.0.0.1:9400)")
    run.add_argument("--interval", type=float, metavar="SECONDS", help="device collection interval")
    run.add_argument(
        "--process-interval",
        type=float,
        metavar="SECONDS",
        help="process list and attribution interval (default: config, 10 s); not changed "
        "by --interval",
    )
    once = sub.add_parser("once", parents=[common], help="print one collection and exit")
    once.add_argument("--format", choices=("prometheus", "json", "bie"), default="prometheus")
    enroll = sub.add_parser(
        "enroll",
        help="get this node's certificate from a gateway with a one-time enrollment token",
        description="Make the node key here (or reuse the configured one), prove the token "
        "made by `cloud-gateway certs enroll-token NODE` to the gateway, and write the "
        "certificate it signs (and known_hosts, if absent) where [gateway] in --config says.",
    )
    enroll.add_argument(
        "--config",
        type=Path,
        help="TOML config file, whose [gateway] key and known_hosts say where the files go "
        "(default: /etc/edge-gpu-relay/agent.toml if it exists)",
    )
    enroll.add_argument(
        "--gateway", metavar="HOST:PORT", help="the gateway's SSH port (default: the config's)"
    )
    enroll.add_argument("--token-file", type=Path, required=True, metavar="FILE")
    enroll.add_argument(
        "--host-ca-fingerprint",
        metavar="SHA256:...",
        help="the gateways' host CA, as `certs enroll-token` printed it; needed when the "
        "configured known_hosts file does not exist yet (it is then written)",
    )
    enroll.add_argument(
        "--node-name", help="node name (default: config, KUBE_NODE_NAME, NODE_NAME, hostname)"
    )
    return p


def _simulate(sim: SimulateConfig, value: str) -> SimulateConfig:
    """``--simulate``: ``N``, ``PROFILE`` or ``PROFILE:N``."""
    from edge_agent.sim.jetson import BOARDS
    from edge_agent.sim.profiles import PROFILES  # pynvml: not for --version or a config

    name, _, count = value.rpartition(":") if ":" in value else ("", "", value)
    if not count.isdigit():
        name, count = value, ""
    if name and name not in PROFILES and name not in BOARDS:
        known = ", ".join(sorted([*PROFILES, *BOARDS]))
        raise ConfigError(
            f"--simulate {value}: no machine profile or Jetson board {name!r} (known: {known})"
        )
    if count and int(count) < 1:
        raise ConfigError("--simulate needs at least 1 GPU")
    return dataclasses.replace(sim, gpus=int(count or 0), profile=name or sim.profile)


def _config(args: argparse.Namespace) -> AgentConfig:
    cfg = load(args.config)
    sim = cfg.simulate
    if args.simulate is not None:
        sim = _simulate(sim, args.simulate)
    if args.simulate_seed is not None:
        sim = dataclasses.replace(sim, seed=args.simulate_seed)
    if args.simulate_pod_resources:
        sim = dataclasses.replace(sim, pod_resources=args.simulate_pod_resources)
    if args.simulate_mig:
        sim = dataclasses.replace(sim, mig=True)
    changes: dict[str, Any] = {"simulate": sim}
    if args.node_name:
        changes["node_name"] = args.node_name
    if args.counters:
        changes["counters_file"] = args.counters
    if args.dcgm_naming:
        changes["dcgm_naming"] = args.dcgm_naming
    if getattr(args, "listen", None):
        changes["listen"] = args.listen
    if getattr(args, "interval", None):
        changes["interval_seconds"] = args.interval
    if getattr(args, "process_interval", None):
        changes["process_interval_seconds"] = args.process_interval
    return validate(dataclasses.replace(cfg, **changes))


def snapshot_json(snapshot: Snapshot) -> dict[str, Any]:
    return {
        "node": snapshot.node,
        "timestamp": snapshot.timestamp,
        "gpus": [dataclasses.asdict(g) for g in snapshot.gpus],
        "families": [dataclasses.asdict(f) for f in snapshot.families],
        "samples": [
            {"name": s.name, "labels": dict(s.labels), "value": s.value} for s in snapshot.samples
        ],
    }


def _once(cfg: AgentConfig, fmt: str) -> None:
    from edge_agent.backend import open_backend
    from edge_agent.pipeline import build_pipeline

    pipeline = build_pipeline(open_backend(cfg))
    try:
        snapshot = pipeline.collection.collect()
    finally:
        pipeline.close()
    if fmt == "prometheus":
        sys.stdout.write(render_text(snapshot).decode())
    elif fmt == "json":
        json.dump(snapshot_json(snapshot), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        json.dump(collect_document(snapshot.node, snapshot.gpus), sys.stdout, indent=2)
        sys.stdout.write("\n")


def _enroll(args: argparse.Namespace) -> None:
    from edge_agent.enroll import DEFAULT_CONFIG, enroll, gateway_address

    config = args.config
    if config is None and DEFAULT_CONFIG.is_file():  # the installed agent's
        config = DEFAULT_CONFIG
    cfg = load(config)
    node = resolve_node_name(args.node_name or cfg.node_name, os.environ)
    _log_setup(cfg, node)
    # A command a person runs: its result, not asyncssh's account of each connection step.
    logging.getLogger("asyncssh").setLevel(logging.WARNING)
    done = asyncio.run(
        enroll(
            cfg.gateway,
            node=node,
            gateway=gateway_address(cfg.gateway, args.gateway),
            token_file=args.token_file,
            fingerprint=args.host_ca_fingerprint,
        )
    )
    print(done.report())


def _log_setup(cfg: AgentConfig, node: str) -> None:
    """Every line names the node: a prefix in text, a field in JSON."""
    logs.setup(
        cfg.log_level, prefix=f"node={node}", log_format=cfg.log_format, fields={"node": node}
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "enroll":
            _enroll(args)
            return 0
        cfg = _config(args)
        node = resolve_node_name(cfg.node_name, os.environ)
        _log_setup(cfg, node)
        if args.command == "once":
            _once(cfg, args.format)
        else:
            from edge_agent.app import serve

            asyncio.run(serve(cfg, reload=lambda: _config(args)))
    except AgentError as exc:
        print(f"edge-agent: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
