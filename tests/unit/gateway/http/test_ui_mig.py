"""The operator page on a MIG GPU: each figure is one device's, whatever order its series
come in.

On a MIG GPU the whole GPU's series (no ``GPU_I_ID``) sit beside each GPU instance's, all
with the same ``gpu`` label. The registry keeps a node's series in a set, so which of them
comes first changes from run to run: :class:`Ordered` hands them out parents first or
instances first, and every figure must be the same either way. The whole GPU's row and
the fleet row show the whole GPU's used of total; each instance has its own row with its
own; utilisation is ``DCGM_FI_DEV_GPU_UTIL``, else ``DCGM_FI_PROF_GR_ENGINE_ACTIVE`` (a
ratio) as percent, of the same device. Expected texts are made from the input table."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import pytest

from cloud_gateway.http.ui.history import UI_FAMILIES, per_gpu
from cloud_gateway.http.ui.node import MAX_INSTANCES
from cloud_gateway.registry.store import FB_FAMILIES, Registry, StoreConfig
from gpurelay.model import Labels
from gpurelay.wire import Batch, Declare, Hello, SeriesDecl
from tests.unit.gateway.http.test_ui import Fleet, decl, get, gpu

H100 = "NVIDIA H100 80GB HBM3"
UTIL, ACTIVE = "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_PROF_GR_ENGINE_ACTIVE"
USED, FREE = "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE"
RESERVED, TOTAL = "DCGM_FI_DEV_FB_RESERVED", "DCGM_FI_DEV_FB_TOTAL"


@dataclass(frozen=True, slots=True, kw_only=True)
class Device:
    """One GPU or MIG GPU instance and what it publishes (MiB; utilisation in %, activity
    a ratio; None: not published)."""

    gpu: str
    gi: str = ""  # GPU_I_ID, "" for the whole GPU
    profile: str = ""
    used: float
    free: float
    reserved: float
    util: float | None = None
    active: float | None = None

    @property
    def total(self) -> float:
        return self.used + self.free + self.reserved  # NVML: total = reserved + free + used

    @property
    def shown_util(self) -> float | None:
        return (
            self.util
            if self.util is not None
            else None
            if self.active is None
            else 100 * self.active
        )

    def labels(self) -> Labels:
        base = (("gpu", self.gpu), ("UUID", f"GPU-{self.gpu}"), ("modelName", H100))
        if not self.gi:
            return base
        return (*base, ("GPU_I_PROFILE", self.profile), ("GPU_I_ID", self.gi))


# The demo's node (`edge-agent once --simulate 2 --simulate-mig`): GPU 0 in MIG mode with
# three GPU instances (no GPU_UTIL there: NVML has none for a MIG GPU), GPU 1 whole.
WHOLE_0 = Device(gpu="0", used=52822, free=28169, reserved=568, active=0.62)
INSTANCES_0 = (
    Device(gpu="0", gi="1", profile="3g.40gb", used=30348, free=10100, reserved=0, active=0.91),
    Device(gpu="0", gi="5", profile="2g.20gb", used=14097, free=5999, reserved=0, active=0.47),
    Device(gpu="0", gi="13", profile="1g.10gb", used=8377, free=1479, reserved=0, active=0.18),
)
WHOLE_1 = Device(gpu="1", used=57016, free=23975, reserved=568, util=55.0, active=0.53)


class Ordered(Registry):
    """The real registry, with a family's live series handed out instances first or
    parents first (it keeps them in a set: either happens)."""

    def __init__(self, *, instances_first: bool) -> None:
        super().__init__(StoreConfig(tracked_families=FB_FAMILIES | UI_FAMILIES))
        self.instances_first = instances_first

    def latest(self, node: str, family: str) -> list[tuple[Labels, float]]:
        def parent_last(row: tuple[Labels, float]) -> bool:
            instance = bool(dict(row[0]).get("GPU_I_ID"))
            return instance != self.instances_first

        return sorted(super().latest(node, family), key=parent_last)


def publish(fleet: Fleet, node: str, devices: list[Device], families: tuple[str, ...]) -> None:
    """Connect ``node`` (two H100 80GB, GPU 0 in MIG mode) and send one batch of each
    device's ``families``, declared in the order of ``devices``."""
    inventory = (gpu(0, H100), gpu(1, H100))
    hello = Hello(agent_version="0.9.0", node=node, interval_seconds=1.0,
                  backend="simulated", gpus=inventory)  # fmt: skip
    conn = fleet.registry.connect(node, remote="10.0.0.1:50000", hello=hello, now=fleet.now)
    fleet.conns[node] = conn.conn_id
    series: list[SeriesDecl] = []
    values: list[tuple[int, float]] = []
    for d in devices:
        published = {USED: d.used, FREE: d.free, RESERVED: d.reserved, TOTAL: d.total,
                     UTIL: d.util, ACTIVE: d.active}  # fmt: skip
        for family in families:
            value = published[family]
            if value is not None:
                series.append(decl(len(series), family, d.labels()))
                values.append((len(values), value))
    assert fleet.registry.declare(node, conn.conn_id, Declare(series=tuple(series))).rejected == ()
    fleet.seq += 1
    batch = Batch(seq=fleet.seq, timestamp=fleet.now, values=tuple(values))
    fleet.registry.apply(node, conn.conn_id, batch, now=fleet.now, size_bytes=100)
    fleet.tick()


def gib(mib: float) -> str:
    return f"{mib / 1024:.1f} GiB"


def pct(value: float | None) -> str:
    return "—" if value is None else f"{value:.0f} %"


def cells(body: str, row_attr: str) -> list[str]:
    """The cells' inner HTML of the one row with ``row_attr`` (``data-…="…"``)."""
    rows = re.findall(rf"<tr [^>]*{re.escape(row_attr)}[^>]*>(.*?)</tr>", body, re.S)
    assert len(rows) == 1, (row_attr, rows)
    return re.findall(r"<td[^>]*>(.*?)</td>", rows[0], re.S)


ORDERS = pytest.mark.parametrize("instances_first", [True, False], ids=["instances", "parents"])
COUNTERS = pytest.mark.parametrize(
    "memory",
    [(USED, FREE, RESERVED), (USED, FREE, TOTAL)],
    ids=["used+free+reserved", "FB_TOTAL"],
)


@ORDERS
@COUNTERS
async def test_a_mig_gpu_shows_the_whole_gpus_figures_and_each_instance_its_own(
    instances_first: bool, memory: tuple[str, ...]
) -> None:
    fleet = Fleet(registry=Ordered(instances_first=instances_first))
    devices = (
        [*INSTANCES_0, WHOLE_0, WHOLE_1] if instances_first else [WHOLE_0, *INSTANCES_0, WHOLE_1]
    )
    publish(fleet, "edge-mig", devices, (*memory, UTIL, ACTIVE))
    _, _, body = await get(fleet, "/ui/nodes/edge-mig")
    for whole in (WHOLE_0, WHOLE_1):
        row = cells(body, f'data-gpu="{whole.gpu}"')
        assert row[3:5] == [pct(whole.shown_util), f"{gib(whole.used)} of {gib(whole.total)}"]
    for inst in INSTANCES_0:
        row = cells(body, f'data-instance="{inst.gpu}/{inst.gi}"')
        assert inst.profile in row[1] and f"GPU instance {inst.gi}" in row[0]
        assert row[3:5] == [pct(inst.shown_util), f"{gib(inst.used)} of {gib(inst.total)}"]
    _, recent = fleet.state.history.of("edge-mig")
    for whole in (WHOLE_0, WHOLE_1):  # the charts: the whole GPU's too
        utils, charted = recent[whole.gpu]
        assert len(utils) == 1 and utils[0] == pytest.approx(whole.shown_util)
        assert charted == [whole.used]

    _, _, body = await get(fleet, "/ui")
    row = cells(body, 'data-node="edge-mig"')
    wholes = (WHOLE_0, WHOLE_1)
    assert row[3] == " / ".join(pct(w.shown_util) for w in wholes)
    used, total = sum(w.used for w in wholes), sum(w.total for w in wholes)
    assert row[4] == f"{gib(used)} of {gib(total)}"  # two H100 80GB: ~160 GiB, not 115


@ORDERS
async def test_without_the_whole_gpus_activity_its_utilisation_is_not_made_up(
    instances_first: bool,
) -> None:
    """Only the instances' GR_ENGINE_ACTIVE: each instance shows its own, and the GPU "—"
    (the whole GPU's share would need the GPU's slice count, which no series carries)."""
    fleet = Fleet(registry=Ordered(instances_first=instances_first))
    quiet_0 = dataclasses.replace(WHOLE_0, util=None, active=None)
    quiet_1 = dataclasses.replace(WHOLE_1, util=None, active=None)
    devices = (
        [*INSTANCES_0, quiet_0, quiet_1] if instances_first else [quiet_0, *INSTANCES_0, quiet_1]
    )
    publish(fleet, "edge-mig", devices, (USED, FREE, RESERVED, UTIL, ACTIVE))
    _, _, body = await get(fleet, "/ui/nodes/edge-mig")
    assert cells(body, 'data-gpu="0"')[3] == "—"
    for inst in INSTANCES_0:
        assert cells(body, f'data-instance="0/{inst.gi}"')[3] == pct(inst.shown_util)
    _, _, body = await get(fleet, "/ui")
    assert cells(body, 'data-node="edge-mig"')[3] == "—"


def test_per_gpu_takes_the_whole_gpus_series_in_either_order() -> None:
    rows = [(d.labels(), d.used) for d in (WHOLE_0, *INSTANCES_0, WHOLE_1)]
    want = {WHOLE_0.gpu: WHOLE_0.used, WHOLE_1.gpu: WHOLE_1.used}
    assert per_gpu(rows) == per_gpu(reversed(rows)) == want
    empty = (("GPU_I_PROFILE", ""), ("GPU_I_ID", ""))  # an empty GPU_I_ID: the whole GPU
    assert per_gpu([((*WHOLE_1.labels(), *empty), 1.0)]) == {"1": 1.0}


async def test_a_node_sending_hundreds_of_gpu_instances_gets_a_bounded_page() -> None:
    """The first MAX_INSTANCES instances by id, then how many more; an id NVML cannot give
    (not a small decimal) is no instance, and a long profile is cut."""
    fleet = Fleet()
    profile = "1g.10gb" + "x" * 2000
    many = [Device(gpu="0", gi=str(i), profile=profile, used=1.0, free=1.0, reserved=0.0)
            for i in range(200)]  # fmt: skip
    odd = [dataclasses.replace(many[0], gi=gi) for gi in ("²", "-1", "01", "9" * 2048)]
    publish(fleet, "edge-h", [WHOLE_0, *odd, *many], (USED, FREE, RESERVED))
    status, _, body = await get(fleet, "/ui/nodes/edge-h")
    assert status == 200
    shown = re.findall(r'data-instance="0/([^"]*)"', body)
    assert shown == [str(i) for i in range(MAX_INSTANCES)]
    assert f"+{len(many) - MAX_INSTANCES} more GPU instances" in body
    assert cells(body, 'data-gpu="0"')[4] == f"{gib(WHOLE_0.used)} of {gib(WHOLE_0.total)}"
    assert "x" * 100 not in body and len(body) < 20_000, len(body)
