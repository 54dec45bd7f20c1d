from __future__ import annotations

import json

from gpurelay.bie import collect_document
from gpurelay.model import GpuInventory


def _gpu(i: int, used: int, total: int) -> GpuInventory:
    return GpuInventory(
        index=i,
        uuid=f"GPU-{i}",
        name="x",
        pci_bus_id="b",
        minor=i,
        memory_total_bytes=total,
        memory_used_bytes=used,
    )


def test_matches_the_bie_demo_document_field_by_field() -> None:
    # The exact document of the BIE demo app (seeds/bie-custom-accelerator-metrics.zh.txt).
    doc = collect_document("docker-desktop", [_gpu(0, 100, 1000), _gpu(1, 101, 1001)])
    assert doc == {
        "docker-desktop": {
            "deviceNum": 2,
            "devices": [
                {"percent": 0.1, "totalMemory": 1000, "usedMemory": 100},
                {"percent": 0.1008991008991009, "totalMemory": 1001, "usedMemory": 101},
            ],
            "percent": 0.10044977511244378,
            "totalMemory": 2001,
            "usedMemory": 201,
        }
    }
    node = doc["docker-desktop"]
    assert list(node) == ["deviceNum", "devices", "usedMemory", "totalMemory", "percent"]
    assert all(isinstance(node[k], int) for k in ("deviceNum", "usedMemory", "totalMemory"))
    assert isinstance(node["percent"], float)
    json.dumps(doc)  # serialisable


def test_no_gpu_and_zero_total() -> None:
    assert collect_document("n", []) == {
        "n": {"deviceNum": 0, "devices": [], "usedMemory": 0, "totalMemory": 0, "percent": 0.0}
    }
    # a GPU whose memory is not known (total 0: lost at connect, a Jetson without nvmap's
    # figures) is left out rather than shown with 0 used
    assert collect_document("n", [_gpu(0, 0, 0)])["n"]["deviceNum"] == 0
