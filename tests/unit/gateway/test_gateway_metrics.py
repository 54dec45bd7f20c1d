"""The gateway's own metrics: remote write families only while remote write is on; label
values from fixed sets only."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cloud_gateway.exposition.body import Exposition
from cloud_gateway.http.api import ENDPOINTS, HttpState, make_app
from cloud_gateway.http.api import families as http_families
from cloud_gateway.ingest.session import Ingest, IngestStats
from cloud_gateway.listener import ConnectionStats
from cloud_gateway.metrics import FamilySamples, catalogue, one
from cloud_gateway.registry.store import Registry
from cloud_gateway.registry.types import state_families
from cloud_gateway.relay.endpoints import EndpointTable
from cloud_gateway.relay.relay import Relay
from cloud_gateway.remote_write.client import RemoteWriteStats
from cloud_gateway.remote_write.forwarder import (
    ForwardStats,
    delivery_families,
    remote_write_families,
)
from cloud_gateway.ssh.logins import AUTH_REASONS, CertificatePolicy
from cloud_gateway.ssh.server import SshServer
from gpurelay.wire import Limits
from tests.promtool_support import unexpected_findings


def own_families(
    *,
    ingest: IngestStats | None = None,
    http_requests: dict[str, int] | None = None,
    protocol_errors: dict[str, int] | None = None,
    auth_failures: dict[str, int] | None = None,
    proxy_requests: dict[int, int] | None = None,
    remote_write: RemoteWriteStats | None = None,
    forwarding: ForwardStats | None = None,
) -> list[FamilySamples]:
    """The gateway's own families as app.py lists them, each from its stage, over stages
    holding these counts."""
    registry = Registry()
    ssh = SshServer(
        host_keys=[],
        policy=CertificatePolicy(trusted_cas=[], failures=Counter(auth_failures or {})),
        sessions=Ingest(registry),
        limits=Limits(),
    )
    ssh.protocol_errors.update(protocol_errors or {})
    http = HttpState(
        registry=registry,
        exposition=Exposition(registry),
        tokens=frozenset(),
        requests=dict(http_requests or {}),
    )
    relay = Relay(registry, EndpointTable(), requests=Counter(proxy_requests or {}))
    families = [
        *state_families({}),
        *ssh.families(),
        *(ingest or IngestStats()).families(),
        *http.exposition.families(),
        *http_families(http, ConnectionStats()),
        *relay.families(),
    ]
    if remote_write is not None:
        families += delivery_families(forwarding or ForwardStats())
        families += remote_write_families(remote_write)
    return families


def body(remote_write: RemoteWriteStats | None, forwarding: ForwardStats | None = None) -> str:
    exposition = Exposition(Registry())
    exposition.set_extra(
        own_families(
            ingest=IngestStats(batches=5, replays=7, duplicates=2),
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
    exposition = Exposition(Registry())
    exposition.set_extra(own_families(**stats))
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


def test_the_catalogue_and_the_stages_name_the_same_families() -> None:
    """Every gpurelay_gateway_* family is a line of cloud_gateway/data/gateway_families.csv
    (its TYPE and HELP) and is reported by the code of one stage (no dead line, no family
    a stage makes up: family() would raise KeyError at the first scrape)."""
    root = Path(__file__).resolve().parents[3] / "cloud_gateway"
    in_code: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        if path.name == "self_metrics.py":
            continue  # histograms, prometheus-client's (their HELP is there)
        for name in re.findall(r'"(gpurelay_gateway_[a-z0-9_]*[a-z0-9])"', path.read_text()):
            in_code.setdefault(name, set()).add(path.relative_to(root).as_posix())
    listed = set(catalogue())
    assert sorted(listed - set(in_code)) == [], "listed, reported by no stage"
    assert sorted(set(in_code) - listed) == [], "reported, not in the catalogue"
    assert len(listed) == 56  # 50, and OTLP's six


def test_a_family_missing_from_the_catalogue_is_a_bug_not_a_silent_gap() -> None:
    with pytest.raises(KeyError):
        one("gpurelay_gateway_made_up_total", 1)
