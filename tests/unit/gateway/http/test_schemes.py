"""The page and the BIE document read a node on dcgm-exporter 4.9's names as one on 4.8's:
the same figures, whichever scheme the node's agent publishes (gpurelay.naming)."""

from __future__ import annotations

from cloud_gateway.http.bie import current_gpus
from cloud_gateway.http.schemes import latest
from cloud_gateway.http.ui.history import UI_FAMILIES, readings
from cloud_gateway.registry.types import FB_FAMILIES
from gpurelay.model import MIB, GpuInventory, Labels
from gpurelay.naming import with_49_names

GPU: Labels = (("gpu", "0"), ("UUID", "GPU-a"), ("Hostname", "edge-1"))
USED = 30_000 * MIB + 12_345  # bytes: not whole MiB, as a driver reports them
TOTAL = 81_559 * MIB


class Node:
    """A registry holding one node's latest series by family."""

    def __init__(self, series: dict[str, float]) -> None:
        self.series = series

    def latest(self, node: str, family: str) -> list[tuple[Labels, float]]:
        assert node == "edge-1"
        return [(GPU, self.series[family])] if family in self.series else []


ON_48 = Node(
    {
        "DCGM_FI_DEV_GPU_UTIL": 42.0,
        "DCGM_FI_DEV_FB_USED": float(USED // MIB),
        "DCGM_FI_DEV_FB_FREE": float((TOTAL - USED) // MIB),
        "DCGM_FI_DEV_FB_RESERVED": 0.0,
    }
)
ON_49 = Node(
    {
        "DCGM_FI_DEV_GPU_UTIL_RATIO": 0.42,
        "DCGM_FI_DEV_FB_USED_BYTES": float(USED),
        "DCGM_FI_DEV_FB_FREE_BYTES": float(TOTAL - USED),
        "DCGM_FI_DEV_FB_RESERVED_BYTES": 0.0,
        "DCGM_FI_DEV_FB_CAPACITY_BYTES": float(TOTAL),
    }
)


def test_a_49_series_is_read_in_48s_unit() -> None:
    assert latest(ON_49, "edge-1", "DCGM_FI_DEV_GPU_UTIL") == [(GPU, 42.0)]
    assert latest(ON_49, "edge-1", "DCGM_FI_DEV_FB_USED") == [(GPU, USED / MIB)]
    assert latest(ON_49, "edge-1", "DCGM_FI_DEV_FB_TOTAL") == [(GPU, 81_559.0)]
    assert latest(ON_48, "edge-1", "DCGM_FI_DEV_FB_USED") == [(GPU, float(USED // MIB))]
    assert latest(ON_49, "edge-1", "gpurelay_agent_spool_bytes") == []


def test_the_page_shows_the_same_figures_for_either_scheme() -> None:
    old, new = readings(ON_48, "edge-1"), readings(ON_49, "edge-1")
    assert old.keys() == new.keys() == {("0", "")}
    assert old[("0", "")].util == new[("0", "")].util == 42.0
    assert old[("0", "")].used == USED // MIB
    assert new[("0", "")].used == USED / MIB  # bytes: the page rounds for display
    assert new[("0", "")].total == 81_559.0


def test_the_bie_document_gives_exact_bytes_from_a_49_node() -> None:
    gpu = GpuInventory(
        index=0,
        uuid="GPU-a",
        name="H100",
        pci_bus_id="0",
        minor=0,
        memory_total_bytes=TOTAL,
        memory_used_bytes=0,
    )
    (old,) = current_gpus(ON_48, "edge-1", [gpu])  # type: ignore[arg-type]
    (new,) = current_gpus(ON_49, "edge-1", [gpu])  # type: ignore[arg-type]
    assert old.memory_used_bytes == USED // MIB * MIB
    assert new.memory_used_bytes == USED  # 4.9's bytes are exact
    assert old.memory_total_bytes == new.memory_total_bytes == TOTAL


def test_the_registry_tracks_the_49_names_it_reads() -> None:
    assert with_49_names(frozenset({"DCGM_FI_DEV_FB_USED"})) == {
        "DCGM_FI_DEV_FB_USED",
        "DCGM_FI_DEV_FB_USED_BYTES",
    }
    assert {"DCGM_FI_DEV_GPU_UTIL_RATIO", "DCGM_FI_PROF_GR_ENGINE_UTIL_RATIO"} <= UI_FAMILIES
    assert {"DCGM_FI_DEV_FB_USED_BYTES", "DCGM_FI_DEV_FB_FREE_BYTES"} <= FB_FAMILIES
