"""The fleet table of the operator page (``GET /ui``): one :class:`Row` per node, the
server-side filter and sort, and its HTML (:func:`fleet_html`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlencode

from cloud_gateway.http.ui.html import (
    ago,
    clip,
    esc,
    expiry,
    finite,
    first,
    mib,
    node_url,
    num,
    page,
    pct,
    td,
    utc,
)

# A hostile node's row stays small: HELLO allows 256 GPUs of 256-byte names, and its
# series any number of gpu labels.
SHOWN_GPUS: Final = 16  # utilisation values in the cell
SHOWN_MODELS: Final = 4  # distinct GPU models in the cell
SHOWN_ENDPOINTS: Final = 8
MODEL_CUT: Final = 64  # characters of a model or an agent version in the cell
TEXT_MODELS: Final = 32  # models the filter matches
TEXT_CUT: Final = 64


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
        """What the filter matches, lower case; bounded, as it goes into every row's
        ``data-text`` (at most :data:`TEXT_MODELS` models, each text cut to :data:`TEXT_CUT`)."""
        parts = (
            self.name,
            self.state,
            self.gateway or "",
            *(m[:TEXT_CUT] for m in self.gpu_models[:TEXT_MODELS]),
            self.agent_version[:TEXT_CUT],
            *(p[:TEXT_CUT] for p in self.published),
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
    "util": ("Utilisation", lambda r: finite(r.util_mean), True),
    "memory": ("Memory", lambda r: finite(r.mem_used), True),
    "last_seen": ("Last seen", lambda r: r.last_seen, True),
    "agent": ("Agent", lambda r: r.agent_version, False),
    "cert": ("Certificate expires", lambda r: r.cert_expires, True),
    "spool": ("Spool backlog", lambda r: finite(r.spool_batches), True),
    "published": ("Published endpoints", lambda r: len(r.published), True),
}


def sort_rows(rows: list[Row], column: str, *, descending: bool) -> list[Row]:
    """By ``column``, equal values by name either way (a stable sort on a sorted list);
    rows with no value (None, NaN) last, by name."""
    key = COLUMNS[column][1]
    by_name = sorted(rows, key=lambda r: r.name)
    known = [r for r in by_name if key(r) is not None]
    known.sort(key=key, reverse=descending)
    return known + [r for r in by_name if key(r) is None]


def _row_html(r: Row, cluster: bool) -> str:
    util = first([pct(u) for u in r.util], SHOWN_GPUS, " / ") if r.util else "—"
    memory = f"{mib(r.mem_used)} of {mib(r.mem_total)}" if r.mem_used is not None else "—"
    seen = (
        "—"
        if r.last_seen is None
        else f'<span title="{utc(r.last_seen)}">{ago(r.now - r.last_seen)}</span>'
    )
    cert, cert_cls = expiry(r.cert_expires, r.now)
    models = first([clip(m, MODEL_CUT) for m in r.gpu_models], SHOWN_MODELS, ", ")
    gpus = f"{r.gpu_count} \N{MULTIPLICATION SIGN} {models}" if r.gpu_count else "0"
    spool = "—" if finite(r.spool_batches) is None else f"{r.spool_batches:.0f}"
    endpoints = [f"<code>{clip(p)}</code>" for p in r.published]
    published = first(endpoints, SHOWN_ENDPOINTS, "<br>") or "—"
    cells = [
        td(f'<a href="{esc(node_url(r.name))}">{esc(r.name)}</a>', sort=r.name),
        td(esc(r.state), sort=COLUMNS["state"][1](r), cls=esc(r.state)),
        *([td(clip(r.gateway or "—"), sort=r.gateway or "")] if cluster else []),
        td(gpus, sort=r.gpu_count, cls="num"),
        td(util, sort=num(r.util_mean), cls="num"),
        td(memory, sort=num(r.mem_used), cls="num"),
        td(seen, sort=num(r.last_seen)),
        td(clip(r.agent_version or "—", MODEL_CUT), sort=r.agent_version[:TEXT_CUT]),
        td(cert, sort=num(r.cert_expires), cls=cert_cls),
        td(spool, sort=num(r.spool_batches), cls="num"),
        td(published, sort=len(r.published)),
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
