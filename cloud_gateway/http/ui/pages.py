"""The operator page: ``GET /ui`` (the fleet) and ``GET /ui/nodes/{node}`` (one node).

Server-rendered HTML from what the gateway holds: the registry's nodes and latest values
(:data:`cloud_gateway.http.ui.history.UI_FAMILIES`), the endpoint table, certificate expiry,
the directory's nodes on other gateways, and the recent values of
:class:`cloud_gateway.http.ui.history.RecentValues` for the charts. Filter (``?q=``) and sort
(``?sort=COLUMN&order=asc|desc``) work without JavaScript; a small inline script does
both in place as you type or click. The HTML is made by :mod:`cloud_gateway.http.ui.fleet` and
:mod:`cloud_gateway.http.ui.node`
(on :mod:`cloud_gateway.http.ui.html`), which escape every string a
node sent.

Authentication is the API's (``/ui`` is behind the same middleware,
:mod:`cloud_gateway.http.api`); every answer carries a strict Content-Security-Policy
(the inline script and style by their hashes, nothing from elsewhere) and
``Cache-Control: no-store``. ``/ui`` is not in ``/openapi.json``: it is HTML for people.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from typing import TYPE_CHECKING

from aiohttp import web

from cloud_gateway.http.fleet_documents import entry_document
from cloud_gateway.http.ui.fleet import COLUMNS, Row, fleet_html, matches, sort_rows
from cloud_gateway.http.ui.history import (
    PROCESS_MEM,
    PROCESS_SM,
    SPOOL_BATCHES,
    WHOLE,
    Reading,
    gpu_index,
    gpu_order,
    readings,
)
from cloud_gateway.http.ui.html import CSP, message_html
from cloud_gateway.http.ui.node import (
    MAX_INSTANCES,
    MAX_PROCESSES,
    GpuRow,
    InstanceRow,
    NodePage,
    ProcessRow,
    node_html,
)
from cloud_gateway.registry.types import NodeView

if TYPE_CHECKING:
    from cloud_gateway.http.state import HttpState

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


_NOTHING = Reading(util=None, used=None, total=None)
Instances = dict[str, list[tuple[str, Reading]]]  # gpu -> (GPU_I_ID, reading), by id


def _live(state: HttpState, view: NodeView) -> tuple[dict[str, Reading], Instances]:
    """What the node's GPUs show now: the whole GPUs by ``gpu`` label, and the MIG GPU
    instances of each (those whose ``GPU_I_ID`` is a small decimal, as NVML's are).
    Nothing for an offline node: its last values stay in the registry for a while
    (offline_grace), not shown as current."""
    whole: dict[str, Reading] = {}
    instances: Instances = {}
    if view.state == "offline":
        return whole, instances
    for (gpu, gi), reading in readings(state.registry, view.name).items():
        if gi == WHOLE:
            whole[gpu] = reading
        elif gpu_index(gi) is not None:
            instances.setdefault(gpu, []).append((gi, reading))
    for found in instances.values():
        found.sort(key=lambda item: gpu_order(item[0]))
    return whole, instances


def held_row(
    state: HttpState,
    view: NodeView,
    now: float,
    gateway: str | None,
    whole: dict[str, Reading] | None = None,
) -> Row:
    """A node this gateway holds; ``whole``: its GPUs now, as :func:`_live` (read if not
    given). Memory is the whole GPUs' used of their total (the HELLO inventory's where
    none was sent), summed over the GPUs whose both are known: never an instance's."""
    reg = state.registry
    if whole is None:
        whole, _ = _live(state, view)
    inventory = {str(g.index): g.memory_total_bytes / 2**20 for g in view.gpus}
    sized = [
        (r.used, r.total if r.total is not None else inventory.get(gpu) or None)
        for gpu, r in whole.items()
        if r.used is not None
    ]
    memory = [(used, total) for used, total in sized if total is not None]
    order = sorted(whole, key=gpu_order)
    spool = reg.latest(view.name, SPOOL_BATCHES) if view.state != "offline" else []
    expires, _ = state.certificates.of(view.name)
    return Row(
        name=view.name,
        state=view.state,
        gateway=gateway,
        gpu_count=len(view.gpus),
        gpu_models=tuple(sorted({g.name for g in view.gpus})),
        util=tuple(u for g in order if (u := whole[g].util) is not None),
        mem_used=sum(used for used, _ in memory) if memory else None,
        mem_total=sum(total for _, total in memory) if memory else None,
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
    whole, instances = _live(state, view)
    row = held_row(state, view, now, me, whole)
    times, recent = state.history.of(name)
    processes, process_count = _processes(state, name)
    gpus = []
    for g in view.gpus:
        current = whole.get(str(g.index), _NOTHING)
        found = instances.get(str(g.index), [])
        gpus.append(
            GpuRow.of(
                g,
                util=current.util,
                mem_used=current.used,
                mem_total=current.total,
                recent=recent.get(str(g.index), ([], [])),
                instances=[
                    InstanceRow(
                        gpu_instance_id=gi,
                        profile=r.profile,
                        util=r.util,
                        mem_used=r.used,
                        mem_total=r.total,
                    )
                    for gi, r in found[:MAX_INSTANCES]
                ],
                instance_count=len(found),
            )
        )
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
