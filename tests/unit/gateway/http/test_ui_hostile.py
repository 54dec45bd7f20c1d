"""The operator page against a hostile or merely huge node, through the real registry:
GPU labels that ``int()`` refuses or that no GPU has, thousands of processes and GPU
labels, label values at the wire's 2,048-byte limit, NaN values. None of it may break the
gateway's tick, the node's page or the page of any other node; what is shown is bounded."""

from __future__ import annotations

import math
import re

from cloud_gateway.http.ui.history import CAPACITY, MAX_GPU_INDEX, gpu_index, gpu_order
from cloud_gateway.http.ui.node import MAX_PROCESSES
from gpurelay.model import Labels
from gpurelay.wire import Batch, Declare, Hello
from tests.unit.gateway.http.test_ui import Fleet, decl, get, gpu, parse, process_labels

UTIL, FB_USED, FB_FREE = "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE"
PMEM, PSM = "DCGM_CUSTOM_PROCESS_MEM_USED", "DCGM_CUSTOM_PROCESS_SM_UTIL"
# str.isdigit() is True for all but the last three; int() refuses "²" (ValueError), takes
# "٣" as 3, and a 2,048-digit label is the wire's longest value.
ODD_GPUS = ("²", "٣", "9" * 2048, "007", "-1", " 1", "GPU-x")


class Hostile:
    """A node that declares whatever series it likes and sends one value for each."""

    def __init__(self, fleet: Fleet, node: str, *, gpus: int = 2, model: str = "NVIDIA L4"):
        self.fleet, self.node = fleet, node
        inventory = tuple(gpu(i, model) for i in range(gpus))
        hello = Hello(agent_version="6.6.6", node=node, interval_seconds=1.0, gpus=inventory)
        conn = fleet.registry.connect(node, remote="10.6.6.6:666", hello=hello, now=fleet.now)
        fleet.conns[node] = self.conn = conn.conn_id
        self.values: list[tuple[int, float]] = []

    def declare(self, series: list[tuple[str, Labels, float]]) -> None:
        first = len(self.values)
        for start in range(0, len(series), 2000):  # several DECLAREs: one frame is 4 MiB
            chunk = series[start : start + 2000]
            decls = [decl(first + start + i, n, labels) for i, (n, labels, _) in enumerate(chunk)]
            done = self.fleet.registry.declare(self.node, self.conn, Declare(series=tuple(decls)))
            assert done.rejected == ()
        self.values += [(first + i, v) for i, (_, _, v) in enumerate(series)]

    def batch(self) -> None:
        self.fleet.seq += 1
        b = Batch(seq=self.fleet.seq, timestamp=self.fleet.now, values=tuple(self.values))
        self.fleet.registry.apply(self.node, self.conn, b, now=self.fleet.now, size_bytes=100)


def gpu_series(label: str, util: float = 50.0) -> list[tuple[str, Labels, float]]:
    gl = (("gpu", label),)
    proc = process_labels(0, 7, "p")
    proc = proc[:3] + gl + proc[4:]  # its gpu label is this one
    return [(UTIL, gl, util), (FB_USED, gl, 1024.0), (FB_FREE, gl, 1024.0),
            (PMEM, proc, 64.0), (PSM, proc, 5.0)]  # fmt: skip


async def test_gpu_labels_int_refuses_break_neither_the_tick_nor_any_page() -> None:
    fleet = Fleet()
    fleet.add("edge-a")
    bad = Hostile(fleet, "edge-h")
    bad.declare([s for label in ("0", "1", *ODD_GPUS) for s in gpu_series(label)])
    for _ in range(3):
        fleet.now += 1
        bad.batch()
        fleet.batch("edge-a", 60.0)
        fleet.tick()
    for path in ("/ui", "/ui?sort=util", "/ui/nodes/edge-h", "/ui/nodes/edge-a"):
        status, _, body = await get(fleet, path)
        assert status == 200, (path, body[-300:])
    _, _, body = await get(fleet, "/ui/nodes/edge-h")
    assert [a["data-gpu"] for t, a in parse(body).tags if t == "tr" and "data-gpu" in a] == [
        "0",
        "1",
    ]
    assert "over 3 samples" in body  # the charts of its real GPUs
    _times, recent = fleet.state.history.of("edge-h")
    assert list(recent) == ["0", "1"]  # no ring for a label no GPU index can be


def test_gpu_labels_are_ordered_as_ascii_decimal_numbers_only() -> None:
    assert (
        gpu_index("0") == 0 and gpu_index("12") == 12 and gpu_index(str(MAX_GPU_INDEX)) is not None
    )
    for label in (*ODD_GPUS, "", str(MAX_GPU_INDEX + 1), "1e3", "+1", "1_0"):
        assert gpu_index(label) is None, label
    labels = ["10", "²", "2", "9" * 2048, "", "b", "a", "0", "٣"]
    assert sorted(labels, key=gpu_order) == ["0", "2", "10", "", "9" * 2048, "a", "b", "²", "٣"]


def test_thousands_of_gpu_labels_cannot_grow_a_nodes_ring_past_the_real_gpus() -> None:
    fleet = Fleet()
    bad = Hostile(fleet, "edge-h")
    bad.declare([(UTIL, (("gpu", str(i)),), 1.0) for i in range(5000)])
    for _ in range(3):
        fleet.now += 1
        bad.batch()
        fleet.tick()
    _, recent = fleet.state.history.of("edge-h")
    assert len(recent) == MAX_GPU_INDEX + 1
    per_gpu = 2 * 4 * CAPACITY  # float32 utilisation and memory
    assert fleet.state.history.nbytes() <= 8 * CAPACITY + (MAX_GPU_INDEX + 1) * per_gpu


async def test_ten_thousand_processes_show_the_largest_and_say_how_many_more() -> None:
    fleet = Fleet()
    fleet.add("edge-a")
    bad = Hostile(fleet, "edge-h")
    procs = []
    for pid in range(10_000):
        labels = process_labels(pid % 2, pid, f"pod-{pid}")
        procs += [(PMEM, labels, float(pid)), (PSM, labels, 1.0)]
    procs.append((PMEM, process_labels(0, 99_999, "nan-pod"), math.nan))
    bad.declare(procs)
    bad.batch()
    fleet.tick()
    status, _, body = await get(fleet, "/ui/nodes/edge-h")
    assert status == 200
    table = re.search(r'<table id="processes">.*?</table>', body, re.S)
    assert table is not None and table[0].count("<tr>") == MAX_PROCESSES + 1  # + the head
    assert "pod-9999" in table[0] and "pod-0<" not in table[0] and "nan-pod" not in table[0]
    assert f"{MAX_PROCESSES} of 10,001 processes" in body
    assert len(body) < 200_000, len(body)
    status, _, _ = await get(fleet, "/ui/nodes/edge-a")
    assert status == 200


async def test_long_label_values_are_cut_with_an_ellipsis_and_kept_whole_in_a_title() -> None:
    fleet = Fleet()
    long = "p" * 2040 + "<end>"
    fleet.add("edge-h", pod=long)
    fleet.registry.record_error("edge-h", "e" * 3000, fleet.now)
    _, _, body = await get(fleet, "/ui/nodes/edge-h")
    cells = [t for t in parse(body).text if t.startswith("ppp")]
    assert cells and all(len(c) <= 81 and c.endswith("…") for c in cells)
    assert 'title="' + "p" * 2040 + '&lt;end&gt;"' in body
    assert "e" * 3000 not in body and "e" * 500 in body


async def test_many_models_and_endpoints_make_a_bounded_fleet_row() -> None:
    fleet = Fleet()
    offers = [fleet.endpoints.offer(via="edge-a", name="edge-a", port=1000 + i, conn=object())
              for i in range(300)]  # fmt: skip
    assert offers.count(None) == 64  # ssh.max_endpoints_per_node
    hello = Hello(agent_version="v" * 256, node="edge-a", interval_seconds=1.0,
                  gpus=tuple(gpu(i, f"{i:03d}" + "m" * 250) for i in range(256)))  # fmt: skip
    fleet.registry.connect("edge-a", remote="10.0.0.1:1", hello=hello, now=fleet.now)
    status, _, body = await get(fleet, "/ui")
    assert status == 200
    row = re.search(r'<tr data-node="edge-a".*?</tr>', body, re.S)
    assert row is not None and len(row[0]) < 10_000, len(row[0])
    assert "+252 more" in row[0] and "+56 more" in row[0]  # models; endpoints past 8
    _, _, body = await get(fleet, "/ui?q=031mmm")  # the filter sees more than is shown
    assert 'data-node="edge-a"' in body
    _, _, body = await get(fleet, "/ui?q=a:1063")
    assert 'data-node="edge-a"' in body


async def test_nan_and_missing_values_sort_last_either_way_and_ties_by_name() -> None:
    fleet = Fleet()
    for name in ("edge-c", "edge-a", "edge-b"):
        fleet.add(name)
    nan = Hostile(fleet, "edge-nan")
    nan.declare([(UTIL, (("gpu", "0"),), math.nan), (FB_USED, (("gpu", "0"),), math.inf),
                 (FB_FREE, (("gpu", "0"),), 1.0),
                 ("gpurelay_agent_spool_batches", (), math.nan)])  # fmt: skip
    nan.batch()
    Hostile(fleet, "edge-none")  # no values at all

    async def order(query: str) -> list[str]:
        status, _, body = await get(fleet, "/ui" + query)
        assert status == 200
        return re.findall(r'<tr data-node="([^"]+)"', body)

    for column in ("util", "memory", "spool"):
        up = await order(f"?sort={column}&order=asc")
        down = await order(f"?sort={column}&order=desc")
        assert up[:3] == down[:3] == ["edge-a", "edge-b", "edge-c"], column  # equal values
        assert up[3:] == down[3:] == ["edge-nan", "edge-none"], column
    _, _, body = await get(fleet, "/ui")
    row = re.search(r'<tr data-node="edge-nan".*?</tr>', body, re.S)
    assert row is not None and "nan" not in row[0].replace("edge-nan", "")
    assert "inf" not in row[0]
