"""The committed pod-resources stubs are what ``make protos`` generates from api.proto."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.protos import GENERATED, ROOT, generate


def test_committed_stubs_match_a_fresh_generation(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the test extra) is not installed")
    stale = [
        str(rel)
        for rel, fresh in zip(GENERATED, generate(tmp_path), strict=True)
        if fresh.read_bytes() != (ROOT / rel).read_bytes()
    ]
    assert not stale, f"stale, run make protos: {', '.join(stale)}"


def test_the_proto_keeps_the_upstream_wire_names() -> None:
    """Package, service and method names are the RPC path the kubelet serves."""
    from edge_agent.podresources import api_pb2

    service = api_pb2.DESCRIPTOR.services_by_name["PodResourcesLister"]
    assert service.full_name == "v1.PodResourcesLister"
    assert [m.name for m in service.methods] == ["List", "GetAllocatableResources", "Get"]
    fields = {
        f.name: f.number
        for f in api_pb2.DESCRIPTOR.message_types_by_name["ContainerDevices"].fields
    }
    assert fields == {"resource_name": 1, "device_ids": 2, "topology": 3}
