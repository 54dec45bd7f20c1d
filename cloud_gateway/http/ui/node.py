"""A node's page of the operator page (``GET /ui/nodes/{node}``): its facts, its GPUs with
small charts of their recent values (inline SVG polylines, no style attributes: the CSP
forbids them), under a MIG GPU a row per GPU instance with its own figures (no charts),
its GPU processes and its recent errors."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from cloud_gateway.http.ui.fleet import Row
from cloud_gateway.http.ui.html import ago, clip, esc, expiry, finite, first, mib, page, pct, utc
from gpurelay.model import GpuInventory

MAX_PROCESSES: Final = 200  # rows of the process table: those using the most memory
MAX_INSTANCES: Final = 8  # MIG GPU-instance rows per GPU (A100 and H100 have at most 7)
PROFILE_CUT: Final = 32  # characters of a GPU_I_PROFILE shown ("1g.10gb+me": 10)
SHOWN_ENDPOINTS: Final = 64
ERROR_CUT: Final = 300  # characters of an error message shown (the rest in its title)


@dataclass(frozen=True, slots=True, kw_only=True)
class InstanceRow:
    """A MIG GPU instance of a GPU, with its own figures."""

    gpu_instance_id: str
    profile: str
    util: float | None
    mem_used: float | None
    mem_total: float | None


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuRow:
    index: str
    model: str
    uuid: str
    pci_bus_id: str
    healthy: bool
    util: float | None
    mem_used: float | None
    mem_total: float | None
    recent_util: list[float] = field(default_factory=list)
    recent_mem: list[float] = field(default_factory=list)
    instances: list[InstanceRow] = field(default_factory=list)  # at most MAX_INSTANCES
    instance_count: int = 0  # how many the node reports

    @classmethod
    def of(
        cls,
        g: GpuInventory,
        *,
        util: float | None = None,
        mem_used: float | None = None,
        mem_total: float | None = None,
        recent: tuple[list[float], list[float]] = ([], []),
        instances: Sequence[InstanceRow] = (),
        instance_count: int = 0,
    ) -> GpuRow:
        """A GPU of the node's HELLO inventory, with what is known of it now (the memory
        total from the inventory unless a live value is given) and its MIG instances."""
        return cls(
            index=str(g.index),
            model=g.name,
            uuid=g.uuid,
            pci_bus_id=g.pci_bus_id,
            healthy=g.healthy,
            util=util,
            mem_used=mem_used,
            mem_total=mem_total if mem_total is not None else g.memory_total_bytes / 2**20 or None,
            recent_util=recent[0],
            recent_mem=recent[1],
            instances=list(instances),
            instance_count=instance_count,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ProcessRow:
    gpu: str
    pid: str
    name: str
    kind: str
    namespace: str
    pod: str
    container: str
    mem_mib: float
    sm_util: float | None


@dataclass(frozen=True, slots=True, kw_only=True)
class NodePage:
    row: Row
    backend: str
    remote: str
    connected_since: float | None
    interval_seconds: float
    gpus: list[GpuRow]
    processes: list[ProcessRow]
    errors: list[tuple[float, str]]
    last_disconnect_reason: str
    samples: int
    process_count: int = 0  # how many the node reports (``processes``: the largest)

    @classmethod
    def elsewhere(
        cls, doc: Mapping[str, Any], gpus: Sequence[GpuInventory], now: float
    ) -> NodePage:
        """A node another gateway holds: what the directory says, no live values."""
        row = Row(
            name=doc["name"],
            state=doc["state"],
            gateway=doc["gateway"] or None,
            gpu_count=doc["gpu_count"],
            gpu_models=tuple(doc["gpu_models"]),
            util=(),
            mem_used=None,
            mem_total=None,
            last_seen=doc["last_seen"],
            agent_version=doc["agent_version"],
            cert_expires=doc["certificate_expires"],
            spool_batches=None,
            published=(),
            now=now,
            held=False,
        )
        rows = [GpuRow.of(g) for g in gpus]
        return cls(
            row=row,
            backend=doc["backend"],
            remote=doc["remote"],
            connected_since=None,
            interval_seconds=doc["interval_seconds"],
            gpus=rows,
            processes=[],
            errors=[],
            last_disconnect_reason=doc["last_disconnect_reason"] or "",
            samples=0,
        )


SPARK_W, SPARK_H = 120, 28


def sparkline(values: Sequence[float], top: float | None, what: str, cls: str = "") -> str:
    """An inline SVG polyline of ``values`` (oldest first) from 0 to ``top`` (None: their
    maximum); a NaN breaks the line. "—" with fewer than two values."""
    finite = [v for v in values if math.isfinite(v)]
    if len(values) < 2 or len(finite) < 2:
        return '<span class="muted">—</span>'
    high = top if top and top > 0 else max(*finite, 1.0)
    step = SPARK_W / (len(values) - 1)
    lines: list[list[str]] = [[]]
    for i, v in enumerate(values):
        if not math.isfinite(v):
            if lines[-1]:
                lines.append([])
            continue
        y = SPARK_H - 1 - (SPARK_H - 2) * min(max(v / high, 0.0), 1.0)
        lines[-1].append(f"{i * step:.1f},{y:.1f}")
    polylines = "".join(f'<polyline points="{" ".join(p)}"/>' for p in lines if p)
    label = (
        f"{what}: last {finite[-1]:.0f}, min {min(finite):.0f}, max {max(finite):.0f} "
        f"over {len(values)} samples"
    )
    return (
        f'<svg class="spark {cls}" width="{SPARK_W}" height="{SPARK_H}" '
        f'viewBox="0 0 {SPARK_W} {SPARK_H}" role="img" aria-label="{esc(label)}">'
        f"<title>{esc(label)}</title>{polylines}</svg>"
    )


def _summary(p: NodePage) -> str:
    r = p.row
    cert, cert_cls = expiry(r.cert_expires, r.now)
    items = [
        ("State", f'<span class="{esc(r.state)}">{esc(r.state)}</span>'),
        *([("Gateway", esc(r.gateway))] if r.gateway else []),
        (
            "Last seen",
            "—" if r.last_seen is None else f"{ago(r.now - r.last_seen)} ({utc(r.last_seen)})",
        ),
        ("Connected since", "—" if p.connected_since is None else utc(p.connected_since)),
        ("Agent", clip(r.agent_version or "—")),
        ("Backend", clip(p.backend or "—")),
        ("Address", clip(p.remote or "—")),
        ("Interval", f"{p.interval_seconds:g} s"),
        ("Certificate expires", f'<span class="{cert_cls}">{cert}</span>'),
        (
            "Spool backlog",
            "—" if finite(r.spool_batches) is None else f"{r.spool_batches:.0f} batches",
        ),
        (
            "Published endpoints",
            first([f"<code>{clip(e)}</code>" for e in r.published], SHOWN_ENDPOINTS, ", ") or "—",
        ),
        ("Last disconnect", clip(p.last_disconnect_reason or "—", ERROR_CUT)),
    ]
    return "<dl>" + "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in items) + "</dl>"


def _gpus(p: NodePage) -> str:
    rows = []
    for g in p.gpus:
        health = "" if g.healthy else ' <span class="bad">unhealthy</span>'
        rows.append(
            f'<tr data-gpu="{esc(g.index)}"><td>{esc(g.index)}</td><td>{clip(g.model)}{health}</td>'
            f"<td><code>{clip(g.uuid)}</code><br><code>{clip(g.pci_bus_id)}</code></td>"
            f'<td class="num">{pct(g.util)}</td>'
            f'<td class="num">{mib(g.mem_used)} of {mib(g.mem_total)}</td>'
            f"<td>{sparkline(g.recent_util, 100.0, 'utilisation %')}</td>"
            f"<td>{sparkline(g.recent_mem, g.mem_total, 'memory used MiB', 'mem')}</td></tr>"
        )
        rows += [_instance(g, i) for i in g.instances]
        if g.instance_count > len(g.instances):
            more = g.instance_count - len(g.instances)
            rows.append(f'<tr><td colspan="7" class="muted">+{more} more GPU instances</td></tr>')
    return (
        '<table id="gpus"><thead><tr><th>GPU</th><th>Model</th><th>UUID / PCI</th>'
        "<th>Utilisation</th><th>Memory</th><th>Utilisation, recent</th>"
        f"<th>Memory, recent</th></tr></thead><tbody>{''.join(rows)}</tbody></table>"
    )


def _instance(g: GpuRow, i: InstanceRow) -> str:
    profile = i.profile[:PROFILE_CUT] + (
        "\N{HORIZONTAL ELLIPSIS}" if len(i.profile) > PROFILE_CUT else ""
    )
    return (
        f'<tr class="mig" data-instance="{esc(g.index)}/{esc(i.gpu_instance_id)}">'
        f"<td>{esc(g.index)} · GPU instance {esc(i.gpu_instance_id)}</td>"
        f"<td>MIG {esc(profile or '—')}</td><td></td>"
        f'<td class="num">{pct(i.util)}</td>'
        f'<td class="num">{mib(i.mem_used)} of {mib(i.mem_total)}</td><td></td><td></td></tr>'
    )


def _processes(p: NodePage) -> str:
    if not p.processes:
        return '<p class="muted">No GPU processes reported.</p>'
    rows = "".join(
        f"<tr><td>{clip(q.gpu)}</td><td>{clip(q.pid)}</td><td>{clip(q.name)}</td>"
        f"<td>{clip(q.kind)}</td><td>{clip(q.namespace or '—')}</td><td>{clip(q.pod or '—')}</td>"
        f'<td>{clip(q.container or "—")}</td><td class="num">{mib(q.mem_mib)}</td>'
        f'<td class="num">{pct(q.sm_util)}</td></tr>'
        for q in p.processes
    )
    more = ""
    if p.process_count > len(p.processes):
        more = (
            f'<p class="muted">Showing the {len(p.processes)} of {p.process_count:,} processes '
            "that use the most GPU memory.</p>"
        )
    return (
        f'{more}<table id="processes"><thead><tr><th>GPU</th><th>PID</th><th>Process</th>'
        "<th>Type</th><th>Namespace</th><th>Pod</th><th>Container</th><th>Memory</th><th>SM</th></tr>"
        f"</thead><tbody>{rows}</tbody></table>"
    )


def _errors(p: NodePage) -> str:
    if not p.errors:
        return '<p class="muted">None.</p>'
    rows = "".join(f"<tr><td>{utc(t)}</td><td>{clip(m, ERROR_CUT)}</td></tr>" for t, m in p.errors)
    return (
        '<table id="errors"><thead><tr><th>Time</th><th>Error</th></tr></thead>'
        f"<tbody>{rows}</tbody></table>"
    )


def node_html(p: NodePage) -> str:
    r = p.row
    where = ""
    if not r.held and r.gateway:
        where = (
            f'<p class="warn">Held by gateway {esc(r.gateway)}: live values, processes '
            "and charts are on that gateway's page.</p>"
        )
    elif not r.held:
        where = (
            '<p class="warn">Known from this gateway\'s inventory of an earlier run: no '
            "live values until it connects again.</p>"
        )
    recent = f"last {p.samples} batches" if p.samples else "no batches yet"
    return page(
        f"{r.name} · edge-gpu-relay",
        f'<p><a href="/ui">← Fleet</a></p><h1>{esc(r.name)}</h1>{where}{_summary(p)}'
        f'<h2>GPUs</h2><p class="muted">Charts: {recent} seen by this gateway.</p>{_gpus(p)}'
        f"<h2>Processes</h2>{_processes(p)}<h2>Recent errors</h2>{_errors(p)}",
    )
