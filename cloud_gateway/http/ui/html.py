"""The operator page's shared HTML: the inline style and script, the CSP that allows
exactly them, escaping, formatting of values and the page around a body.

No template engine and no asset: one inline ``<style>`` and one inline ``<script>``, both
allowed by their SHA-256 in :data:`CSP` (a hash, not a nonce: they never change, so the
header is a constant). The script filters and sorts the fleet table in place; without it
the filter form and the column links do the same on the server (``?q=``, ``?sort=``).
Every node-sent text goes through :func:`esc`. The fleet table is
:mod:`cloud_gateway.http.ui.fleet`, a node's page :mod:`cloud_gateway.http.ui.node`.
"""

from __future__ import annotations

import base64
import hashlib
import html
import math
import time
from collections.abc import Sequence
from typing import Final
from urllib.parse import quote

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
    "img-src 'self' data:; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
)


def esc(value: object) -> str:
    return html.escape(str(value), quote=True)


CLIP: Final = 80  # characters of a node-sent text shown in a cell
TITLE_MAX: Final = 2048  # ... and in its title: the wire's longest label value


def clip(value: object, limit: int = CLIP) -> str:
    """``value`` escaped, cut to ``limit`` characters with an ellipsis; then the whole (up
    to :data:`TITLE_MAX`) is its title, shown on hover."""
    text = str(value)
    if len(text) <= limit:
        return esc(text)
    cut = esc(text[: limit - 1]) + "\N{HORIZONTAL ELLIPSIS}"
    return f'<span title="{esc(text[:TITLE_MAX])}">{cut}</span>'


def first(items: Sequence[str], limit: int, sep: str) -> str:
    """At most ``limit`` of ``items`` (already HTML), then how many more."""
    shown = sep.join(items[:limit])
    return shown + (f"{sep}+{len(items) - limit} more" if len(items) > limit else "")


def finite(value: float | None) -> float | None:
    """None for a missing, NaN or infinite value (sorted and shown as missing)."""
    return value if value is not None and math.isfinite(value) else None


def node_url(name: str) -> str:
    return "/ui/nodes/" + quote(name, safe="")


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


def num(value: float | None) -> str:
    value = finite(value)
    return "" if value is None else repr(float(value))


def td(text: str, *, sort: object = None, cls: str = "") -> str:
    v = "" if sort is None else f' data-v="{esc(sort)}"'
    c = f' class="{cls}"' if cls else ""
    return f"<td{c}{v}>{text}</td>"


def page(title: str, body: str) -> str:
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        f'<meta name="referrer" content="no-referrer"><title>{esc(title)}</title>'
        # no icon: else the browser asks for /favicon.ico, a 404 in its console
        '<link rel="icon" href="data:,">'
        f"<style>{STYLE}</style></head><body>{body}<script>{SCRIPT}</script></body></html>"
    )


def message_html(title: str, text: str) -> str:
    return page(title, f'<h1>{esc(title)}</h1><p>{esc(text)}</p><p><a href="/ui">Fleet</a></p>')
