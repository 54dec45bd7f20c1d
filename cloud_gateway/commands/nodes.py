"""``cloud-gateway nodes``: list nodes through the operator API (httpx).

Readable errors for the things that go wrong in practice: the gateway is not reachable,
the token is missing or wrong, the URL is not a gateway.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

DEFAULT_URL = "http://127.0.0.1:9410"
COLUMNS: tuple[str, ...] = (
    "NODE", "STATE", "DOMAIN", "GPUS", "LAST SEEN", "AGENT", "EXPIRES", "PUBLISHED",
)  # fmt: skip


def add_nodes_parser(sub: Any) -> None:
    p = sub.add_parser("nodes", help="list the nodes the gateway knows")
    add_connection_options(p)
    p.add_argument("--state", choices=("online", "stale", "offline"), help="only this state")
    p.add_argument("--domain", help="only nodes of this network domain")


def add_connection_options(p: argparse.ArgumentParser) -> None:
    """--gateway, --token, --token-file, --json, --timeout (every API command's)."""
    p.add_argument(
        "--gateway",
        default=os.environ.get("CLOUD_GATEWAY_URL", DEFAULT_URL),
        help=f"gateway HTTP URL (default $CLOUD_GATEWAY_URL or {DEFAULT_URL})",
    )
    p.add_argument(
        "--token",
        default=os.environ.get("CLOUD_GATEWAY_TOKEN", ""),
        help="bearer token (default $CLOUD_GATEWAY_TOKEN)",
    )
    p.add_argument("--token-file", type=Path, help="read the bearer token from this file")
    p.add_argument("--json", action="store_true", help="print the API's JSON")
    p.add_argument("--timeout", type=float, default=10.0)


class NodesError(Exception):
    pass


def fetch_nodes(args: argparse.Namespace) -> dict[str, Any]:
    params = {k: v for k, v in (("state", args.state), ("domain", args.domain)) if v}
    return fetch(args, "/api/v1/nodes", "nodes", params)


def fetch(
    args: argparse.Namespace, path: str, key: str, params: dict[str, str] | None = None
) -> dict[str, Any]:
    """The API's JSON document at ``path`` (which must hold ``key``), or NodesError."""
    token = args.token
    if args.token_file is not None:
        try:
            token = args.token_file.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise NodesError(
                f"token file {args.token_file} cannot be read: {exc.strerror}"
            ) from exc
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    url = args.gateway.rstrip("/") + path
    try:
        response = httpx.get(url, headers=headers, params=params, timeout=args.timeout)
    except httpx.TransportError as exc:
        raise NodesError(f"cannot reach the gateway at {args.gateway}: {exc}") from exc
    if response.status_code in (401, 403):
        hint = (
            "no token given (--token, --token-file or $CLOUD_GATEWAY_TOKEN)"
            if not token
            else "the token was not accepted"
        )
        raise NodesError(f"gateway said {response.status_code}: {_body(response)}; {hint}")
    if response.status_code != 200:
        raise NodesError(f"gateway said {response.status_code}: {_body(response)}")
    try:
        doc: dict[str, Any] = response.json()
        doc[key]
    except (ValueError, KeyError, TypeError) as exc:
        raise NodesError(f"{url} did not answer like an edge-gpu-relay gateway") from exc
    return doc


def _body(response: httpx.Response) -> str:
    try:
        return str(response.json().get("error", response.text)).strip()
    except ValueError:
        return response.text.strip()[:200]


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"


def _expires(when: object, now: float) -> str:
    """``2026-12-01 (6d)``: the certificate's expiry date (UTC) and the days left; ``-``
    when the gateway knows none (no expiry, or not seen)."""
    if not isinstance(when, int | float) or isinstance(when, bool):
        return "-"
    date = datetime.fromtimestamp(when, UTC).strftime("%Y-%m-%d")
    left = when - now
    if left <= 0:
        return f"{date} (expired)"
    days, hours = int(left // 86400), int(left // 3600)
    return f"{date} ({days}d)" if days else f"{date} ({hours}h)"


def _gateway(node: dict[str, Any]) -> str:
    """The gateway that holds ``node`` (several gateways), ``(dead)`` when it stopped
    heartbeating; ``-`` when none does."""
    gateway = str(node.get("gateway") or "")
    if not gateway:
        return "-"
    return f"{gateway} (dead)" if node.get("gateway_alive") is False else gateway


def render_table(nodes: list[dict[str, Any]], now: float) -> str:
    """The node table; with several gateways (the API names each node's gateway), a
    GATEWAY column after STATE."""
    clustered = any("gateway" in n for n in nodes)
    header = (*COLUMNS[:2], "GATEWAY", *COLUMNS[2:]) if clustered else COLUMNS
    rows = [header]
    for n in nodes:
        last = n.get("last_seen")
        row = (
            str(n.get("name", "")),
            str(n.get("state", "")),
            str(n.get("domain", "")),
            str(n.get("gpu_count", 0)),
            _age(now - last if isinstance(last, int | float) else None),
            str(n.get("agent_version", "")),
            _expires(n.get("certificate_expires"), now),
            ",".join(n.get("published", [])) or "-",
        )
        rows.append((*row[:2], _gateway(n), *row[2:]) if clustered else row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines) + "\n"


def run_nodes(args: argparse.Namespace) -> int:
    try:
        doc = fetch_nodes(args)
    except NodesError as exc:
        print(f"cloud-gateway nodes: {exc}", file=sys.stderr)
        return 1
    if args.json:
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
    elif not doc["nodes"]:
        print("no nodes" + (f" in state {args.state}" if args.state else ""))
    else:
        sys.stdout.write(render_table(doc["nodes"], doc.get("now", time.time())))
    return 0
