"""The gateway's own metrics: remote write families only while remote write is on."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from cloud_gateway.exposition import Exposition
from cloud_gateway.forwarding import ForwardStats
from cloud_gateway.gateway_metrics import gateway_families
from cloud_gateway.ingest import IngestStats
from cloud_gateway.registry import Registry
from cloud_gateway.remote_write import RemoteWriteStats
from tests.promtool_support import unexpected_findings


def body(remote_write: RemoteWriteStats | None, forwarding: ForwardStats | None = None) -> str:
    exposition = Exposition(Registry())
    exposition.set_extra(
        gateway_families(
            states={},
            auth_failures={},
            protocol_errors={},
            ingest=IngestStats(batches=5, replays=7, duplicates=2),
            channels=1,
            bodies_built=0,
            http_requests={},
            remote_write=remote_write,
            forwarding=forwarding,
        )
    )
    return exposition.body(openmetrics=False, gzip=False).decode()


def values(text: str) -> dict[str, float]:
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_without_remote_write_there_are_no_remote_write_families() -> None:
    v = values(body(None))
    assert v["gpurelay_gateway_replayed_batches_total"] == 7
    assert v["gpurelay_gateway_duplicate_batches_total"] == 2
    assert not [name for name in v if name.startswith("gpurelay_gateway_remote_write_")]


def test_remote_write_families(promtool: Path) -> None:
    rw = RemoteWriteStats(
        pending_samples=10,
        sent_samples=1000,
        failed_samples=20,
        sent_requests=4,
        retried_requests=3,
        rejected_requests=1,
        last_latency_seconds=0.25,
        latency_seconds_sum=1.5,
        latency_seconds_count=6,
    )
    text = body(rw, ForwardStats(queued=9, delivered=40, dropped=1))
    v = values(text)
    rw_names = "gpurelay_gateway_remote_write_"
    assert {k.removeprefix(rw_names): x for k, x in v.items() if k.startswith(rw_names)} == {
        "queued_batches": 9,
        "pending_samples": 10,
        "sent_samples_total": 1000,
        "failed_samples_total": 20,
        "sent_requests_total": 4,
        "retried_requests_total": 3,
        "rejected_requests_total": 1,
        "dropped_batches_total": 1,
        "request_duration_seconds_total": 1.5,
        "responses_total": 6,
        "last_request_duration_seconds": 0.25,
    }
    assert unexpected_findings(promtool, text.encode()) == []
