"""The operator page (/ui) in-process: content, escaping of hostile node strings, the
security headers, authentication as the API's, server-side filter and sort, the node page,
and the bounded ring of recent values behind its charts (with its memory cost)."""

from __future__ import annotations

import base64
import html.parser
import math
import re
import tracemalloc

import bcrypt
import pytest
from aiohttp.test_utils import TestClient, TestServer
from multidict import CIMultiDict

from cloud_gateway.cluster.directory import NodeEntry, NodeFacts
from cloud_gateway.exposition.body import Exposition
from cloud_gateway.http.api import HttpState, make_app
from cloud_gateway.http.ui.history import UI_FAMILIES, RecentValues
from cloud_gateway.http.ui.html import CSP, SCRIPT, STYLE
from cloud_gateway.http.ui.node import sparkline
from cloud_gateway.registry.store import FB_FAMILIES, Registry, StoreConfig
from cloud_gateway.relay.endpoints import EndpointTable
from gpurelay.model import GpuInventory, Labels
from gpurelay.web_config import BasicAuth
from gpurelay.wire import Batch, Declare, Hello, SeriesDecl

T0 = 1_790_000_000.0
TOKEN = "t0ken-for-the-page"
HOSTILE = '"><script>alert(1)</script><img src=x onerror=alert(2)>'
HASH = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(4))


def gpu(index: int, name: str = "NVIDIA H100 80GB HBM3") -> GpuInventory:
    return GpuInventory(
        index=index,
        uuid=f"GPU-{index}",
        name=name,
        pci_bus_id=f"00000000:{index:02X}:00.0",
        minor=index,
        memory_total_bytes=80 * 1024**3,
        memory_used_bytes=0,
    )


def decl(sid: int, name: str, labels: Labels) -> SeriesDecl:
    return SeriesDecl(id=sid, name=name, type="gauge", help=f"help of {name}", labels=labels)


def process_labels(g: int, pid: int, pod: str) -> Labels:
    return (("NamespaceName", "ml"), ("PodName", pod), ("ContainerName", "trainer"),
            ("gpu", str(g)), ("UUID", f"GPU-{g}"), ("GPU_I_ID", ""),
            ("ProcessId", str(pid)), ("ProcessName", "python3"), ("ProcessType", "C"))  # fmt: skip


class Fleet:
    """A registry with nodes as an agent fills it, and the page's HTTP state."""

    def __init__(
        self,
        *,
        basic: bool = True,
        tokens: frozenset[str] = frozenset({TOKEN}),
        registry: Registry | None = None,
    ) -> None:
        self.now = T0
        self.registry = registry or Registry(
            StoreConfig(tracked_families=FB_FAMILIES | UI_FAMILIES)
        )
        self.endpoints = EndpointTable()
        self.state = HttpState(
            registry=self.registry,
            exposition=Exposition(self.registry),
            tokens=tokens,
            clock=lambda: self.now,
            endpoints=self.endpoints,
            basic_auth=BasicAuth({"alice": HASH}) if basic else None,
        )
        self.conns: dict[str, int] = {}
        self.seq = 0

    def add(self, node: str, *, model: str = "NVIDIA H100 80GB HBM3", pod: str = "train-0",
            version: str = "0.9.0") -> None:  # fmt: skip
        hello = Hello(agent_version=version, node=node, interval_seconds=1.0,
                      backend="simulated", gpus=(gpu(0, model), gpu(1, model)))  # fmt: skip
        conn = self.registry.connect(node, remote="10.0.0.1:50000", hello=hello, now=self.now)
        self.conns[node] = conn.conn_id
        series = []
        for g in (0, 1):
            gl = (("gpu", str(g)), ("UUID", f"GPU-{g}"), ("modelName", model))
            series += [
                decl(10 * g + 0, "DCGM_FI_DEV_GPU_UTIL", gl),
                decl(10 * g + 1, "DCGM_FI_DEV_FB_USED", gl),
                decl(10 * g + 2, "DCGM_FI_DEV_FB_FREE", gl),
                decl(10 * g + 3, "DCGM_CUSTOM_PROCESS_MEM_USED", process_labels(g, 100 + g, pod)),
                decl(10 * g + 4, "DCGM_CUSTOM_PROCESS_SM_UTIL", process_labels(g, 100 + g, pod)),
            ]
        series.append(decl(99, "gpurelay_agent_spool_batches", ()))
        declared = self.registry.declare(node, conn.conn_id, Declare(series=tuple(series)))
        assert declared.rejected == ()
        self.batch(node, 40.0)

    def batch(self, node: str, util: float) -> None:
        self.seq += 1
        values = [(99, 7.0)]
        for g in (0, 1):
            values += [(10 * g, util + g), (10 * g + 1, 1024.0 * (g + 1)),
                       (10 * g + 2, 80 * 1024 - 1024.0 * (g + 1)), (10 * g + 3, 512.0),
                       (10 * g + 4, 33.0)]  # fmt: skip
        b = Batch(seq=self.seq, timestamp=self.now, values=tuple(values))
        self.registry.apply(node, self.conns[node], b, now=self.now, size_bytes=100)

    def tick(self) -> None:
        views = self.registry.nodes(self.now)
        self.state.history.sample(self.registry, ((v.name, v.last_batch_time) for v in views))


BASIC = {"Authorization": "Basic " + base64.b64encode(b"alice:s3cret").decode()}


class Tags(html.parser.HTMLParser):
    """Every start tag and its attributes: what markup the page really has."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []
        self._in: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        self._in.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if self._in and self._in[-1] == tag:
            self._in.pop()

    def handle_data(self, data: str) -> None:
        if not self._in or self._in[-1] not in ("script", "style"):
            self.text.append(data)


def parse(body: str) -> Tags:
    tags = Tags()
    tags.feed(body)
    return tags


async def get(
    fleet: Fleet, path: str, headers: dict[str, str] | None = None
) -> tuple[int, CIMultiDict[str], str]:
    async with TestClient(TestServer(make_app(fleet.state))) as client:
        resp = await client.get(path, headers=BASIC if headers is None else headers)
        return resp.status, CIMultiDict(resp.headers), await resp.text()


async def test_the_fleet_page_lists_nodes_with_their_gpus_and_values() -> None:
    fleet = Fleet()
    fleet.add("edge-a")
    fleet.add("edge-b", model="NVIDIA A100-SXM4-40GB", version="0.8.1")
    assert fleet.endpoints.offer(via="edge-a", name="edge-a", port=9400, conn=object()) is None
    status, headers, body = await get(fleet, "/ui")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    rows = {a["data-node"]: a for t, a in parse(body).tags if t == "tr" and "data-node" in a}
    assert set(rows) == {"edge-a", "edge-b"}
    text = " ".join(parse(body).text)
    assert "NVIDIA A100-SXM4-40GB" in text and "0.8.1" in text and "edge-a:9400" in text
    assert "40 % / 41 %" in text  # current utilisation per GPU
    assert "3.0 GiB of 160.0 GiB" in text  # memory used of total, both GPUs
    assert "online" in text and "—" in text  # no certificate expiry known: a dash
    spool = re.search(r'data-v="7\.0">7</td>', body)
    assert spool is not None  # the agent's gpurelay_agent_spool_batches


async def test_security_headers_and_the_csp_allows_exactly_the_inline_script_and_style() -> None:
    fleet = Fleet()
    fleet.add("edge-a")
    for path in ("/ui", "/ui/nodes/edge-a", "/ui/nodes/nobody"):
        status, headers, body = await get(fleet, path)
        assert status in (200, 404)
        assert headers["Content-Security-Policy"] == CSP
        assert headers["Cache-Control"] == "no-store"
        assert headers["X-Content-Type-Options"] == "nosniff"
        scripts = re.findall(r"<script>(.*?)</script>", body, re.S)
        styles = re.findall(r"<style>(.*?)</style>", body, re.S)
        assert scripts == [SCRIPT] and styles == [STYLE]
        for tag, attrs in parse(body).tags:
            assert "style" not in attrs, tag  # style attributes: refused by the CSP
            assert not any(a.startswith("on") for a in attrs), tag
            assert not {"src", "srcset"} & set(attrs), tag  # nothing loaded from anywhere
        # an icon of its own (empty, inline): else a browser asks for /favicon.ico (404)
        icons = [a for tag, a in parse(body).tags if tag == "link" and a.get("rel") == "icon"]
        assert icons == [{"rel": "icon", "href": "data:,"}], icons
    assert "default-src 'none'" in CSP and "unsafe-inline" not in CSP and "http" not in CSP
    assert "img-src 'self' data:;" in CSP  # the empty icon


async def test_hostile_node_strings_are_escaped_everywhere() -> None:
    fleet = Fleet()
    fleet.add("edge-h", model=HOSTILE, pod=HOSTILE, version=HOSTILE)
    fleet.registry.record_error("edge-h", HOSTILE, T0)
    assert fleet.endpoints.offer(via="edge-h", name="edge-h", port=80, conn=object()) is None
    fleet.add(HOSTILE)  # a node name the registry would never get from a certificate
    for path in ("/ui", "/ui?q=script", "/ui/nodes/edge-h", "/ui/nodes/%3Cscript%3E"):
        status, _, body = await get(fleet, path)
        assert status in (200, 404)
        tags = parse(body)
        assert [t for t, _ in tags.tags].count("script") == 1, path
        assert "img" not in [t for t, _ in tags.tags], path
        assert "<script>alert" not in body and "<img" not in body
    _, _, body = await get(fleet, "/ui/nodes/edge-h")
    text = " ".join(parse(body).text)
    assert text.count(HOSTILE) >= 4  # the model, the pod, the version, the error: as text


async def test_without_credentials_the_page_is_refused_with_a_basic_challenge() -> None:
    fleet = Fleet()
    fleet.add("edge-a")
    status, headers, _ = await get(fleet, "/ui", {})
    assert status == 401 and 'Basic realm="edge-gpu-relay"' in headers.getall("WWW-Authenticate")
    wrong = {"Authorization": "Basic " + base64.b64encode(b"alice:nope").decode()}
    assert (await get(fleet, "/ui/nodes/edge-a", wrong))[0] == 401
    assert (await get(fleet, "/ui", {"Authorization": "Bearer nope"}))[0] == 403
    assert (await get(fleet, "/ui", {"Authorization": f"Bearer {TOKEN}"}))[0] == 200
    by_token = {"Authorization": "Basic " + base64.b64encode(f"any:{TOKEN}".encode()).decode()}
    assert (await get(fleet, "/ui", by_token))[0] == 200  # the token as Basic password


async def test_token_only_a_browser_still_gets_a_login_prompt_and_the_token_works() -> None:
    fleet = Fleet(basic=False)
    async with TestClient(TestServer(make_app(fleet.state))) as client:
        resp = await client.get("/ui")
        challenges = resp.headers.getall("WWW-Authenticate")
        assert resp.status == 401 and 'Basic realm="edge-gpu-relay"' in challenges
        api = await client.get("/api/v1/nodes")  # the API's answer is unchanged
        assert api.headers.getall("WWW-Authenticate") == ['Bearer realm="cloud-gateway"']
    token = {"Authorization": "Basic " + base64.b64encode(f"ops:{TOKEN}".encode()).decode()}
    assert (await get(fleet, "/ui", token))[0] == 200
    closed = Fleet(basic=False, tokens=frozenset())
    status, _, body = await get(closed, "/ui", {})
    assert status == 403 and "closed" in body


async def test_filter_and_sort_work_on_the_server_too() -> None:
    fleet = Fleet()
    for name, model in (("edge-b", "NVIDIA A100"), ("edge-a", "NVIDIA H100"), ("gpu-c", "L4")):
        fleet.add(name, model=model)

    async def order(query: str) -> list[str]:
        status, _, body = await get(fleet, "/ui" + query)
        assert status == 200
        return [a["data-node"] or "" for t, a in parse(body).tags if t == "tr" and "data-node" in a]

    assert await order("") == ["edge-a", "edge-b", "gpu-c"]
    assert await order("?q=EDGE") == ["edge-a", "edge-b"]
    assert await order("?q=a100") == ["edge-b"]
    assert await order("?sort=name&order=desc") == ["gpu-c", "edge-b", "edge-a"]
    assert await order("?sort=nonsense&order=sideways") == ["edge-a", "edge-b", "gpu-c"]
    _, _, body = await get(fleet, "/ui?q=%22%3E%3Cb%3E")  # the query goes back escaped
    assert "<b>" not in body and "&quot;&gt;&lt;b&gt;" in body


async def test_the_node_page_shows_gpus_processes_errors_and_charts() -> None:
    fleet = Fleet()
    fleet.add("edge-a", pod="train-7")
    fleet.tick()
    for i in range(1, 6):
        fleet.now += 1
        fleet.batch("edge-a", 40.0 + 10 * i)
        fleet.tick()
    fleet.tick()  # no new batch: no new sample
    fleet.registry.record_error("edge-a", "series 5 refused: too many labels", fleet.now)
    status, _, body = await get(fleet, "/ui/nodes/edge-a")
    assert status == 200
    tags = parse(body).tags
    assert [a["data-gpu"] for t, a in tags if t == "tr" and "data-gpu" in a] == ["0", "1"]
    assert sum(1 for t, a in tags if t == "svg" and "spark" in (a["class"] or "")) == 4
    assert "over 6 samples" in body and "last 6 batches" in body and "90 %" in body
    text = " ".join(parse(body).text)
    assert "train-7" in text and "trainer" in text and "python3" in text and "ml" in text
    assert "too many labels" in text
    fleet.registry.disconnect(
        "edge-a", fleet.conns["edge-a"], now=fleet.now, reason="EOF from agent"
    )
    _, _, body = await get(fleet, "/ui/nodes/edge-a")
    assert "EOF from agent" in body and "offline" in body
    assert "90 %" not in body and "over 6 samples" in body  # no current values; the charts
    _, _, body = await get(fleet, "/ui")
    assert "offline" in body and "90 %" not in body and "GiB" not in body
    status, _, body = await get(fleet, "/ui/nodes/nobody")
    assert status == 404 and "Unknown node" in body


def test_the_ring_is_bounded_ordered_and_forgets_nodes() -> None:
    fleet = Fleet()
    fleet.state.history = RecentValues(capacity=4)
    fleet.add("edge-a")
    for i in range(6):
        fleet.now += 1
        fleet.batch("edge-a", float(i))
        fleet.tick()
    times, gpus = fleet.state.history.of("edge-a")
    assert times == [T0 + 3, T0 + 4, T0 + 5, T0 + 6]
    assert gpus["0"][0] == [2.0, 3.0, 4.0, 5.0] and gpus["1"][0] == [3.0, 4.0, 5.0, 6.0]
    assert gpus["1"][1] == [2048.0] * 4
    fleet.registry.forget("edge-a")
    fleet.tick()
    assert fleet.state.history.of("edge-a") == ([], {})
    with pytest.raises(ValueError, match="capacity"):
        RecentValues(capacity=1)


class _Values:
    def __init__(self, gpus: int) -> None:
        self.rows = [((("gpu", str(g)),), float(g)) for g in range(gpus)]

    def latest(self, node: str, family: str) -> list[tuple[Labels, float]]:
        return self.rows


def test_the_rings_of_1000_nodes_of_8_gpus_cost_under_12_mib() -> None:
    """120 samples of utilisation and memory per GPU: measured 9.0 MiB (tracemalloc)."""
    values = _Values(8)
    history = RecentValues()
    nodes = [f"edge-{i}" for i in range(1000)]
    history.sample(values, ((n, 0.0) for n in nodes))  # the dicts and first arrays
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for t in range(1, 120):
            history.sample(values, ((n, float(t)) for n in nodes))
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert history.nbytes() == 1000 * 120 * (8 + 8 * 2 * 4)
    assert grown < 12 * 2**20, grown


def test_a_gpu_that_appears_later_has_nan_before_and_the_chart_breaks_there() -> None:
    history = RecentValues(capacity=8)

    class Late:
        def __init__(self) -> None:
            self.gpus = 1

        def latest(self, node: str, family: str) -> list[tuple[Labels, float]]:
            return [((("gpu", str(g)),), 50.0) for g in range(self.gpus)]

    late = Late()
    history.sample(late, [("n", 1.0)])
    late.gpus = 2
    history.sample(late, [("n", 2.0)])
    history.sample(late, [("n", 3.0)])
    _, gpus = history.of("n")
    assert math.isnan(gpus["1"][0][0]) and gpus["1"][0][1:] == [50.0, 50.0]
    assert sparkline([1.0], 100, "x") == sparkline([math.nan, 1.0], 100, "x")  # too few: a dash
    assert sparkline([1.0, math.nan, 2.0, 3.0], 100, "x").count("<polyline") == 2


class _Link:
    """What the page reads of a DirectoryLink: its id, whether it is in a cluster, and the
    nodes the directory says are elsewhere."""

    def __init__(self, cluster: bool, entries: list[tuple[NodeEntry, object]]) -> None:
        self.gateway = "gw-1"
        self.cluster = object() if cluster else None
        self.entries = entries

    def elsewhere(self) -> list[tuple[NodeEntry, object]]:
        return self.entries


def _entry(node: str, gateway: str, *, connected: bool) -> NodeEntry:
    facts = NodeFacts(
        agent_version="0.7.0", gpus=(gpu(0, "NVIDIA L4"),), cert_valid_before=int(T0) + 86400
    )
    return NodeEntry(node=node, gateway=gateway, epoch=3, first_seen=T0 - 100,
                     last_seen=T0 - 5, facts=facts, connected=connected,
                     last_disconnect_reason="gateway gw-2 stopped",
                     published=(f"{node}:9400",))  # fmt: skip


async def test_in_a_cluster_the_page_names_each_nodes_gateway() -> None:
    fleet = Fleet()
    fleet.add("edge-here")
    fleet.state.directory = _Link(True, [(_entry("edge-there", "gw-2", connected=True), object())])  # type: ignore[assignment]
    _, _, body = await get(fleet, "/ui")
    tags = parse(body)
    assert any(a.get("data-col") == "gateway" for t, a in tags.tags if t == "a")
    rows = re.findall(r'<tr data-node="([^"]+)".*?</tr>', body)
    assert rows == ["edge-here", "edge-there"]
    there = re.search(r'<tr data-node="edge-there".*?</tr>', body)
    assert there is not None and "gw-2" in there[0] and "NVIDIA L4" in there[0]
    assert "edge-there:9400" in there[0] and "(in 1 d)" in there[0]
    assert "warn" in there[0]  # a certificate expiring within 14 days
    assert "gw-1" in re.search(r'<tr data-node="edge-here".*?</tr>', body)[0]  # type: ignore[index]
    _, _, body = await get(fleet, "/ui/nodes/edge-there")
    assert "Held by gateway gw-2" in body and "NVIDIA L4" in body


async def test_a_single_gateways_inventory_shows_no_gateway_column() -> None:
    fleet = Fleet()
    fleet.add("edge-here")
    fleet.state.directory = _Link(False, [(_entry("edge-before", "gw-1", connected=False), None)])  # type: ignore[assignment]
    _, _, body = await get(fleet, "/ui")
    assert 'data-col="gateway"' not in body and 'data-node="edge-before"' in body
    _, _, body = await get(fleet, "/ui/nodes/edge-before")
    assert "inventory of an earlier run" in body and "gateway gw-2 stopped" in body
