"""``cloud-gateway run|nodes|gateways|certs|signer``: argument parsing and one-line errors."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from cloud_gateway import __version__
from cloud_gateway.commands.certs import add_certs_parser, run_certs
from cloud_gateway.commands.gateways import add_gateways_parser, run_gateways
from cloud_gateway.commands.nodes import add_nodes_parser, run_nodes
from cloud_gateway.errors import GatewayConfigError, GatewayError
from cloud_gateway.trust.signer_socket import add_signer_parser, run_signer
from gpurelay import logs


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cloud-gateway", description="edge-gpu-relay cloud gateway")
    p.add_argument("--version", action="version", version=f"cloud-gateway {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the gateway (SSH :2222, HTTP :9410)")
    run.add_argument("--config", type=Path, help="TOML config file")
    add_nodes_parser(sub)
    add_gateways_parser(sub)
    add_certs_parser(sub)
    add_signer_parser(sub)
    return p


def _run(args: argparse.Namespace) -> int:
    from cloud_gateway.app import serve
    from cloud_gateway.config import load

    cfg = load(args.config)
    logs.setup(
        cfg.log_level,
        log_format=cfg.log_format,
        fields={"gateway": cfg.cluster.resolved_gateway_id()},
    )
    asyncio.run(serve(cfg))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "nodes":
            return run_nodes(args)
        if args.command == "gateways":
            return run_gateways(args)
        if args.command == "signer":
            return run_signer(args)
        return run_certs(args)
    except GatewayError as exc:
        print(f"cloud-gateway: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, GatewayConfigError) else 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
