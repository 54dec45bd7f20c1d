"""The operator page's HTML: plain strings, every node-sent text through :func:`esc`.

No template engine and no asset: one inline ``<style>`` and one inline ``<script>``, both
allowed by their SHA-256 in :data:`CSP` (a hash, not a nonce: they never change, so the
header is a constant). The script filters and sorts the fleet table in place; without it
the filter form and the column links do the same on the server (``?q=``, ``?sort=``).
Charts are inline SVG polylines (no style attributes: the CSP forbids them).
"""

from __future__ import annotations

import base64
import hashlib
import html
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import quote, urlencode

from gpurelay.model import GpuInventory

WARN_SECONDS: Final = 14 * 86400  # certificate expiry shown as a warning within this

STYLE: Final = """
body{font:14px/1.4 system-ui,sans-serif;margin:1rem 2rem;color:#1d232a;background:#fafbfc}
h1{font-size:1.4rem;margin:.2rem 0 .8rem}h2{font-size:1.1rem;margin:1.4rem 0 .4rem}
table{border-collapse:collapse;background:#fff;min-width:40rem}
th,td{border:1px solid #d5dbe1;padding:.25rem .5rem;text-align:left;vertical-align:top}
th{background:#eef1f4;white-space:nowrap}th a{color:inherit;text-decoration:none}
th[aria-sort=ascending] a::after{content:" \\25B2"}
th[aria-sort=descending] a::after{content:" \\25BC"}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.online{color:#116b2f;font-weight:600}.stale{color:#9a6700;font-weight:600}
.offline{color:#a40e26;font-weight:600}.warn{color:#9a6700}.bad{color:#a40e26;font-weight:600}
.muted{color:#6a737d}form{margin:.5rem 0}input[type=search]{width:20rem;padding:.2rem}
svg.spark{display:block}svg.spark polyline{fill:none;stroke:#0969da;stroke-width:1.5}
svg.spark.mem polyline{stroke:#8250df}dl{display:grid;grid-template-columns:max-content auto;
gap:.2rem 1rem}dt{font-weight:600}dd{margin:0}code{font-size:.9em}
"""

SCRIPT: Final = """
(function () {
  var table = document.getElementById("fleet");
  if (!table) return;
  var body = table.tBodies[0], box = document.getElementById("q");
  var shown = document.getElementById("shown");
  function filter() {
    var want = box.value.trim().toLowerCase(), n = 0;
    for (var i = 0; i < body.rows.length; i++) {
      var row = body.rows[i], hit = !want || row.dataset.text.indexOf(want) >= 0;
      row.hidden = !hit;
      if (hit) n++;
    }
    shown.textContent = n;
  }
  box.addEventListener("input", filter);
  var heads = table.tHead.rows[0].cells;
  function value(row, col) {
    var v = row.cells[col].dataset.v;
    return v === undefined ? row.cells[col].textContent : v;
  }
  function sortBy(col, desc) {
    var rows = Array.prototype.slice.call(body.rows), numeric = heads[col].dataset.num === "1";
    rows.sort(function (a, b) {
      var x = value(a, col), y = value(b, col);
      if (x === "" || y === "") return (x === "") - (y === "");
      var c = numeric ? parseFloat(x) - parseFloat(y) : x.localeCompare(y);
      return desc ? -c : c;
    });
    rows.forEach(function (r) { body.appendChild(r); });
    for (var i = 0; i < heads.length; i++) heads[i].removeAttribute("aria-sort");
    heads[col].setAttribute("aria-sort", desc ? "descending" : "ascending");
  }
  Array.prototype.forEach.call(heads, function (th, col) {
    var link = th.querySelector("a");
    if (!link) return;
    link.addEventListener("click", function (e) {
      e.preventDefault();
      sortBy(col, th.getAttribute("aria-sort") === "ascending");
    });
  });
})();
"""


def _sha256(text: str) -> str:
    return "sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()


CSP: Final = (
    f"default-src 'none'; script-src '{_sha256(SCRIPT)}'; style-src '{_sha256(STYLE)}'; "
    "img-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
)


def esc(value: object) -> str:
    return html.escape(str(value), quote=True)


def node_url(name: str) -> str:
    return "/ui/nodes/" + quote(name, safe="")


@dataclass(frozen=True, slots=True, kw_only=True)
class Row:
    """One node of the fleet table."""

    name: str
    state: str
    gateway: str | None  # the owner, in a cluster
    gpu_count: int
    gpu_models: tuple[str, ...]
    util: tuple[float, ...]  # per GPU, %
    mem_used: float | None  # MiB, all GPUs
    mem_total: float | None
    last_seen: float | None
    agent_version: str
    cert_expires: float | None
    spool_batches: float | None
    published: tuple[str, ...]
    now: float
    held: bool = True  # False: another gateway holds it (no live values here)

    @property
    def util_mean(self) -> float | None:
        return sum(self.util) / len(self.util) if self.util else None

    def text(self) -> str:
        """What the filter matches, lower case."""
        parts = (
            self.name,
            self.state,
            self.gateway or "",
            *self.gpu_models,
            self.agent_version,
            *self.published,
        )
        return " ".join(parts).lower()


def matches(row: Row, query: str) -> bool:
    want = query.strip().lower()
    return not want or want in row.text()


_STATE_ORDER = {"online": 0, "stale": 1, "offline": 2}
COLUMNS: Final[dict[str, tuple[str, Callable[[Row], Any], bool]]] = {
    # key: (title, sort key (None: no value, sorted last), numeric)
    "name": ("Node", lambda r: r.name, False),
    "state": ("State", lambda r: _STATE_ORDER.get(r.state, 3), True),
    "gateway": ("Gateway", lambda r: r.gateway, False),
    "gpus": ("GPUs", lambda r: r.gpu_count, True),
    "util": ("Utilisation", lambda r: r.util_mean, True),
    "memory": ("Memory", lambda r: r.mem_used, True),
    "last_seen": ("Last seen", lambda r: r.last_seen, True),
    "agent": ("Agent", lambda r: r.agent_version, False),
    "cert": ("Certificate expires", lambda r: r.cert_expires, True),
    "spool": ("Spool backlog", lambda r: r.spool_batches, True),
    "published": ("Published endpoints", lambda r: len(r.published), True),
}


def sort_rows(rows: list[Row], column: str, *, descending: bool) -> list[Row]:
    key = COLUMNS[column][1]
    known = [r for r in rows if key(r) is not None]
    unknown = [r for r in rows if key(r) is None]
    known.sort(key=lambda r: (key(r), r.name), reverse=descending)
    return known + sorted(unknown, key=lambda r: r.name)


# --- formatting --------------------------------------------------------------------


def ago(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} ago"
    return f"{seconds:.0f} s ago"


def utc(when: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(when))


def mib(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "—"
    return f"{value / 1024:.1f} GiB" if value >= 1024 else f"{value:.0f} MiB"


def pct(value: float | None) -> str:
    return "—" if value is None or not math.isfinite(value) else f"{value:.0f} %"


def expiry(expires: float | None, now: float) -> tuple[str, str]:
    """(text, CSS class) of a certificate's expiry."""
    if expires is None:
        return "—", "muted"
    left = expires - now
    day = time.strftime("%Y-%m-%d", time.gmtime(expires))
    if left <= 0:
        return f"{day} (expired)", "bad"
    days = left / 86400
    text = f"{day} (in {days:.0f} d)" if days >= 1 else f"{day} (in {left / 3600:.0f} h)"
    return text, "warn" if left < WARN_SECONDS else ""


def _num(value: float | None) -> str:
    return "" if value is None else repr(float(value))


def _td(text: str, *, sort: object = None, cls: str = "") -> str:
    v = "" if sort is None else f' data-v="{esc(sort)}"'
    c = f' class="{cls}"' if cls else ""
    return f"<td{c}{v}>{text}</td>"


def page(title: str, body: str) -> str:
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        f'<meta name="referrer" content="no-referrer"><title>{esc(title)}</title>'
        f"<style>{STYLE}</style></head><body>{body}<script>{SCRIPT}</script></body></html>"
    )


def message_html(title: str, text: str) -> str:
    return page(title, f'<h1>{esc(title)}</h1><p>{esc(text)}</p><p><a href="/ui">Fleet</a></p>')


# --- the fleet -----------------------------------------------------------------------


def _row_html(r: Row, cluster: bool) -> str:
    util = " / ".join(pct(u) for u in r.util) if r.util else "—"
    memory = f"{mib(r.mem_used)} of {mib(r.mem_total)}" if r.mem_used is not None else "—"
    seen = (
        "—"
        if r.last_seen is None
        else f'<span title="{utc(r.last_seen)}">{ago(r.now - r.last_seen)}</span>'
    )
    cert, cert_cls = expiry(r.cert_expires, r.now)
    models = ", ".join(esc(m) for m in r.gpu_models)
    gpus = f"{r.gpu_count} \N{MULTIPLICATION SIGN} {models}" if r.gpu_count else "0"
    spool = "—" if r.spool_batches is None else f"{r.spool_batches:.0f}"
    published = "<br>".join(f"<code>{esc(p)}</code>" for p in r.published) or "—"
    cells = [
        _td(f'<a href="{esc(node_url(r.name))}">{esc(r.name)}</a>', sort=r.name),
        _td(esc(r.state), sort=COLUMNS["state"][1](r), cls=esc(r.state)),
        *([_td(esc(r.gateway or "—"), sort=r.gateway or "")] if cluster else []),
        _td(gpus, sort=r.gpu_count, cls="num"),
        _td(util, sort=_num(r.util_mean), cls="num"),
        _td(memory, sort=_num(r.mem_used), cls="num"),
        _td(seen, sort=_num(r.last_seen)),
        _td(esc(r.agent_version or "—"), sort=r.agent_version),
        _td(cert, sort=_num(r.cert_expires), cls=cert_cls),
        _td(spool, sort=_num(r.spool_batches), cls="num"),
        _td(published, sort=len(r.published)),
    ]
    return f'<tr data-node="{esc(r.name)}" data-text="{esc(r.text())}">{"".join(cells)}</tr>'


def fleet_html(
    rows: Sequence[Row],
    *,
    total: int,
    query: str,
    sort: str,
    descending: bool,
    cluster: bool,
    now: float,
) -> str:
    heads = []
    for key, (title, _, numeric) in COLUMNS.items():
        if key == "gateway" and not cluster:
            continue
        order = "desc" if key == sort and not descending else "asc"
        href = "?" + urlencode(
            {"q": query, "sort": key, "order": order} if query else {"sort": key, "order": order}
        )
        aria = ""
        if key == sort:
            aria = f' aria-sort="{"descending" if descending else "ascending"}"'
        num = ' data-num="1"' if numeric else ""
        heads.append(f'<th{aria}{num}><a href="{esc(href)}" data-col="{key}">{title}</a></th>')
    body = "".join(_row_html(r, cluster) for r in rows)
    online = sum(1 for r in rows if r.state == "online")
    return page(
        "Fleet · edge-gpu-relay",
        "<h1>Fleet</h1>"
        f'<p><span id="shown">{len(rows)}</span> of {total} nodes shown, {online} online · '
        f"{esc(utc(now))}</p>"
        '<form method="get" action="/ui" role="search">'
        f'<input type="search" id="q" name="q" value="{esc(query)}" '
        'placeholder="Filter: name, state, GPU model, agent, endpoint" autocomplete="off">'
        f'<input type="hidden" name="sort" value="{esc(sort)}">'
        f'<input type="hidden" name="order" value="{"desc" if descending else "asc"}">'
        " <button>Filter</button></form>"
        f'<table id="fleet"><thead><tr>{"".join(heads)}</tr></thead><tbody>{body}</tbody></table>',
    )


# --- one node ------------------------------------------------------------------------


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
        rows = [
            GpuRow(
                index=str(g.index),
                model=g.name,
                uuid=g.uuid,
                pci_bus_id=g.pci_bus_id,
                healthy=g.healthy,
                util=None,
                mem_used=None,
                mem_total=g.memory_total_bytes / 2**20 or None,
            )
            for g in gpus
        ]
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
        ("Agent", esc(r.agent_version or "—")),
        ("Backend", esc(p.backend or "—")),
        ("Address", esc(p.remote or "—")),
        ("Interval", f"{p.interval_seconds:g} s"),
        ("Certificate expires", f'<span class="{cert_cls}">{cert}</span>'),
        ("Spool backlog", "—" if r.spool_batches is None else f"{r.spool_batches:.0f} batches"),
        ("Published endpoints", ", ".join(f"<code>{esc(e)}</code>" for e in r.published) or "—"),
        ("Last disconnect", esc(p.last_disconnect_reason or "—")),
    ]
    return "<dl>" + "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in items) + "</dl>"


def _gpus(p: NodePage) -> str:
    rows = []
    for g in p.gpus:
        health = "" if g.healthy else ' <span class="bad">unhealthy</span>'
        rows.append(
            f'<tr data-gpu="{esc(g.index)}"><td>{esc(g.index)}</td><td>{esc(g.model)}{health}</td>'
            f"<td><code>{esc(g.uuid)}</code><br><code>{esc(g.pci_bus_id)}</code></td>"
            f'<td class="num">{pct(g.util)}</td>'
            f'<td class="num">{mib(g.mem_used)} of {mib(g.mem_total)}</td>'
            f"<td>{sparkline(g.recent_util, 100.0, 'utilisation %')}</td>"
            f"<td>{sparkline(g.recent_mem, g.mem_total, 'memory used MiB', 'mem')}</td></tr>"
        )
    return (
        '<table id="gpus"><thead><tr><th>GPU</th><th>Model</th><th>UUID / PCI</th>'
        "<th>Utilisation</th><th>Memory</th><th>Utilisation, recent</th>"
        f"<th>Memory, recent</th></tr></thead><tbody>{''.join(rows)}</tbody></table>"
    )


def _processes(p: NodePage) -> str:
    if not p.processes:
        return '<p class="muted">No GPU processes reported.</p>'
    rows = "".join(
        f"<tr><td>{esc(q.gpu)}</td><td>{esc(q.pid)}</td><td>{esc(q.name)}</td>"
        f"<td>{esc(q.kind)}</td><td>{esc(q.namespace or '—')}</td><td>{esc(q.pod or '—')}</td>"
        f'<td>{esc(q.container or "—")}</td><td class="num">{mib(q.mem_mib)}</td>'
        f'<td class="num">{pct(q.sm_util)}</td></tr>'
        for q in p.processes
    )
    return (
        '<table id="processes"><thead><tr><th>GPU</th><th>PID</th><th>Process</th><th>Type</th>'
        "<th>Namespace</th><th>Pod</th><th>Container</th><th>Memory</th><th>SM</th></tr>"
        f"</thead><tbody>{rows}</tbody></table>"
    )


def _errors(p: NodePage) -> str:
    if not p.errors:
        return '<p class="muted">None.</p>'
    rows = "".join(f"<tr><td>{utc(t)}</td><td>{esc(m)}</td></tr>" for t, m in p.errors)
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
