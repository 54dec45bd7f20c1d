"""The operator page: ``GET /ui`` (the fleet) and ``GET /ui/nodes/{node}`` (one node).

Server-rendered HTML from what the gateway holds: the registry's nodes and latest values
(:data:`cloud_gateway.ui_history.UI_FAMILIES`), the endpoint table, certificate expiry,
the directory's nodes on other gateways, and the recent values of
:class:`cloud_gateway.ui_history.RecentValues` for the charts. Filter (``?q=``) and sort
(``?sort=COLUMN&order=asc|desc``) work without JavaScript; a small inline script does
both in place as you type or click. The HTML is made by :mod:`cloud_gateway.ui_fleet` and
:mod:`cloud_gateway.ui_node` (on :mod:`cloud_gateway.ui_html`), which escape every string a
node sent.

Authentication is the API's (``/ui`` is behind the same middleware,
:mod:`cloud_gateway.http_api`); every answer carries a strict Content-Security-Policy
(the inline script and style by their hashes, nothing from elsewhere) and
``Cache-Control: no-store``. ``/ui`` is not in ``/openapi.json``: it is HTML for people.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from typing import TYPE_CHECKING

from aiohttp import web

from cloud_gateway.fleet_documents import entry_document
from cloud_gateway.registry_types import NodeView
from cloud_gateway.ui_fleet import COLUMNS, Row, fleet_html, matches, sort_rows
from cloud_gateway.ui_history import (
    FB_FREE,
    FB_RESERVED,
    FB_USED,
    PROCESS_MEM,
    PROCESS_SM,
    SPOOL_BATCHES,
    UTIL,
    gpu_order,
    per_gpu,
)
from cloud_gateway.ui_html import CSP, message_html
from cloud_gateway.ui_node import MAX_PROCESSES, GpuRow, NodePage, ProcessRow, node_html

if TYPE_CHECKING:
    from cloud_gateway.http_state import HttpState

HEADERS = {
    "Content-Security-Policy": CSP,
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}


def html_response(text: str, status: int = 200) -> web.Response:
    return web.Response(
        text=text, status=status, content_type="text/html", charset="utf-8", headers=HEADERS
    )


def _gpu_memory(state: HttpState, node: str) -> tuple[dict[str, float], dict[str, float]]:
    """(gpu -> MiB used, gpu -> MiB total) from the framebuffer families."""
    reg = state.registry
    used = per_gpu(reg.latest(node, FB_USED))
    free = per_gpu(reg.latest(node, FB_FREE))
    reserved = per_gpu(reg.latest(node, FB_RESERVED))
    total = {g: used[g] + free[g] + reserved.get(g, 0.0) for g in used if g in free}
    return used, total


def held_row(state: HttpState, view: NodeView, now: float, gateway: str | None) -> Row:
    """An offline node's last values stay in the registry for a while (offline_grace):
    not shown as current, and its spool grows on the agent meanwhile."""
    reg = state.registry
    live = view.state != "offline"
    used, total = _gpu_memory(state, view.name) if live else ({}, {})
    util = per_gpu(reg.latest(view.name, UTIL)) if live else {}
    spool = reg.latest(view.name, SPOOL_BATCHES) if live else []
    expires, _ = state.certificates.of(view.name)
    return Row(
        name=view.name,
        state=view.state,
        gateway=gateway,
        gpu_count=len(view.gpus),
        gpu_models=tuple(sorted({g.name for g in view.gpus})),
        util=tuple(util[g] for g in sorted(util, key=gpu_order)),
        mem_used=sum(used.values()) if used else None,
        mem_total=sum(total.values()) if total else None,
        last_seen=view.last_seen,
        agent_version=view.agent_version,
        cert_expires=expires,
        spool_batches=spool[0][1] if spool else None,
        published=tuple(e.target for e in state.endpoints.published_via(view.name)),
        now=now,
    )


def fleet_rows(state: HttpState, now: float) -> list[Row]:
    """Every node this gateway holds, then those the directory says others hold (or, a
    single gateway's inventory, that it held in an earlier run: no owner shown)."""
    link = state.directory
    me = link.gateway if link is not None and link.cluster is not None else None
    rows = [held_row(state, v, now, me) for v in state.registry.nodes(now)]
    for entry, owner in link.elsewhere() if link is not None else ():
        doc = entry_document(entry, owner, now)
        rows.append(
            Row(
                name=entry.node,
                state=doc["state"],
                gateway=(doc["gateway"] or None) if me is not None else None,
                gpu_count=doc["gpu_count"],
                gpu_models=tuple(doc["gpu_models"]),
                util=(),
                mem_used=None,
                mem_total=None,
                last_seen=entry.last_seen,
                agent_version=doc["agent_version"],
                cert_expires=doc["certificate_expires"],
                spool_batches=None,
                published=tuple(entry.published),
                now=now,
                held=False,
            )
        )
    return rows


def fleet_page(state: HttpState, request: web.Request) -> web.Response:
    now = state.clock()
    query = request.query.get("q", "")[:200]
    sort = request.query.get("sort", "name")
    if sort not in COLUMNS:
        sort = "name"
    descending = request.query.get("order") == "desc"
    rows = fleet_rows(state, now)
    total = len(rows)
    shown = sort_rows([r for r in rows if matches(r, query)], sort, descending=descending)
    cluster = any(r.gateway for r in rows)
    return html_response(
        fleet_html(
            shown,
            total=total,
            query=query,
            sort=sort,
            descending=descending,
            cluster=cluster,
            now=now,
        )
    )


def _processes(state: HttpState, node: str) -> tuple[list[ProcessRow], int]:
    """The :data:`MAX_PROCESSES` that use the most memory (NaN last), by GPU; and how many
    the node reports."""
    sm = {_process_key(labels): value for labels, value in state.registry.latest(node, PROCESS_SM)}
    rows = []
    for labels, mem in state.registry.latest(node, PROCESS_MEM):
        d = dict(labels)
        rows.append(
            ProcessRow(
                gpu=d.get("gpu", ""),
                pid=d.get("ProcessId", ""),
                name=d.get("ProcessName", ""),
                kind=d.get("ProcessType", ""),
                namespace=d.get("NamespaceName", ""),
                pod=d.get("PodName", ""),
                container=d.get("ContainerName", "") or d.get("container_name", ""),
                mem_mib=mem,
                sm_util=sm.get(_process_key(labels)),
            )
        )
    total = len(rows)
    if total > MAX_PROCESSES:
        rows = heapq.nsmallest(MAX_PROCESSES, rows, key=_most_memory)
    rows.sort(key=lambda p: (gpu_order(p.gpu), _most_memory(p)))
    return rows, total


def _most_memory(p: ProcessRow) -> tuple[float, str]:
    return (-p.mem_mib if math.isfinite(p.mem_mib) else math.inf), p.pid


def _process_key(labels: tuple[tuple[str, str], ...]) -> tuple[str, str, str]:
    d = dict(labels)
    return d.get("gpu", ""), d.get("GPU_I_ID", ""), d.get("ProcessId", "")


def node_page(state: HttpState, request: web.Request) -> web.Response:
    name = request.match_info["node"]
    now = state.clock()
    link = state.directory
    view = state.registry.node(name, now=now)
    if view is None:
        for entry, owner in link.elsewhere() if link is not None else ():
            if entry.node == name:
                doc = entry_document(entry, owner, now)
                if link is not None and link.cluster is None:
                    doc["gateway"] = ""  # a single gateway's inventory: its own
                return html_response(node_html(NodePage.elsewhere(doc, entry.facts.gpus, now)))
        return html_response(message_html("Unknown node", f"No node named {name[:200]!r}."), 404)
    me = link.gateway if link is not None and link.cluster is not None else None
    row = held_row(state, view, now, me)
    live = view.state != "offline"
    used, total = _gpu_memory(state, name) if live else ({}, {})
    util = per_gpu(state.registry.latest(name, UTIL)) if live else {}
    times, recent = state.history.of(name)
    processes, process_count = _processes(state, name)
    gpus = [
        GpuRow.of(
            g,
            util=util.get(str(g.index)),
            mem_used=used.get(str(g.index)),
            mem_total=total.get(str(g.index)),
            recent=recent.get(str(g.index), ([], [])),
        )
        for g in view.gpus
    ]
    page = NodePage(
        row=row,
        backend=view.backend,
        remote=view.remote,
        connected_since=view.connected_since,
        interval_seconds=view.interval_seconds,
        gpus=gpus,
        processes=processes,
        process_count=process_count,
        errors=[dataclasses.astuple(e) for e in reversed(view.recent_errors)],
        last_disconnect_reason=view.last_disconnect_reason,
        samples=len(times),
    )
    return html_response(node_html(page))
