"""``cloud-gateway gateways``: the cluster's gateways through the operator API (httpx):
id, alive, heartbeat age, nodes owned (``-`` for a dead gateway: its nodes are offline),
time up; ``--json`` for the API's document."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from cloud_gateway.commands.nodes import NodesError, add_connection_options, fetch


def add_gateways_parser(sub: Any) -> None:
    p = sub.add_parser("gateways", help="list the cluster's gateways")
    add_connection_options(p)


def _seconds(value: object) -> str:
    if not isinstance(value, int | float):
        return "-"
    if value < 120:
        return f"{value:.1f}s"
    if value < 7200:
        return f"{value / 60:.0f}m"
    return f"{value / 3600:.1f}h"


def render_table(gateways: list[dict[str, Any]]) -> str:
    header = ("GATEWAY", "ALIVE", "HEARTBEAT AGE", "NODES", "UP", "ADVERTISE")
    rows = [header]
    for g in gateways:
        name = str(g.get("id", "")) + (" (this)" if g.get("this") else "")
        rows.append(
            (
                name,
                "yes" if g.get("alive") else "no",
                _seconds(g.get("heartbeat_age_seconds")),
                str(g.get("nodes", "")) if g.get("alive") else "-",  # a dead one holds none
                _seconds(g.get("up_seconds")),
                str(g.get("advertise") or "-"),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines) + "\n"


def run_gateways(args: argparse.Namespace) -> int:
    try:
        doc = fetch(args, "/api/v1/gateways", "gateways")
    except NodesError as exc:
        print(f"cloud-gateway gateways: {exc}", file=sys.stderr)
        return 1
    if args.json:
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render_table(doc["gateways"]))
    return 0
