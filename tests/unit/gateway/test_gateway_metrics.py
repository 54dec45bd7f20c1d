"""The gateway's own metrics: remote write families only while remote write is on; label
values from fixed sets only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from cloud_gateway.exposition.body import Exposition
from cloud_gateway.gateway_metrics import AUTH_REASONS, gateway_families
from cloud_gateway.http.api import ENDPOINTS, HttpState, make_app
from cloud_gateway.ingest.session import IngestStats
from cloud_gateway.registry.store import Registry
from cloud_gateway.remote_write.client import RemoteWriteStats
from cloud_gateway.remote_write.forwarder import ForwardStats
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


def labelled(**stats: Any) -> dict[str, dict[str, float]]:
    """family -> {label value -> value} of the gateway's one-label families."""
    args: dict[str, Any] = {
        "states": {},
        "auth_failures": {},
        "protocol_errors": {},
        "ingest": IngestStats(),
        "channels": 0,
        "bodies_built": 0,
        "http_requests": {},
    }
    exposition = Exposition(Registry())
    exposition.set_extra(gateway_families(**(args | stats)))
    text = exposition.body(openmetrics=False, gzip=False).decode()
    found: dict[str, dict[str, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if len(s.labels) == 1:
                found.setdefault(fam.name, {})[next(iter(s.labels.values()))] = s.value
    return found


def test_label_values_come_from_fixed_sets_whatever_was_counted() -> None:
    """Client paths, free-text reasons, unknown codes: folded into `other`, never a label."""
    ingest = IngestStats()
    for i in range(500):  # free text (a registry before refusal codes): other
        ingest.rejected_series[f"metric name gpurelay_gateway_x{i} is reserved"] += 1
    ingest.rejected_series["same_series"] += 2  # a code passes as it is
    v = labelled(
        ingest=ingest,
        http_requests={"/metrics": 3, "/api/v1/nodes/{node}": 1} | {f"/x{i}": 1 for i in range(50)},
        protocol_errors={"malformed": 1} | {f"code{i}": 1 for i in range(20)},
        auth_failures={"expired": 1, "made-up": 4},
        proxy_requests={200: 5, 599: 1, 299: 2},
    )
    assert v["gpurelay_gateway_rejected_series"] == {"same_series": 2, "other": 500}
    assert v["gpurelay_gateway_http_requests"] == {
        "/metrics": 3,
        "/api/v1/nodes/{node}": 1,
        "other": 50,
    }
    assert v["gpurelay_gateway_protocol_errors"] == {"malformed": 1, "other": 20}
    assert v["gpurelay_gateway_auth_failures"]["other"] == 4
    assert set(v["gpurelay_gateway_auth_failures"]) == {*AUTH_REASONS, "other"}
    assert v["gpurelay_gateway_proxy_requests"] == {"200": 5, "other": 3}
    assert v["gpurelay_gateway_http_connections_closed"] == {
        "header_timeout": 0,
        "evicted": 0,
        "refused": 0,
        "bad_request": 0,
    }


def test_every_route_is_an_endpoint_label_value() -> None:
    app = make_app(
        HttpState(registry=Registry(), exposition=Exposition(Registry()), tokens=frozenset())
    )
    templates = {r.canonical for r in app.router.resources()}
    assert templates | {"proxy", "other"} == set(ENDPOINTS)
