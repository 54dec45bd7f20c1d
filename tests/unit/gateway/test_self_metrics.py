"""The gateway's histograms (prometheus-client): observed where the work happens, rendered
after the fleet's blocks in both formats, and clean for promtool and OpenMetrics parsers."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as parse_openmetrics,
)
from prometheus_client.parser import text_string_to_metric_families

from cloud_gateway.exposition.body import Exposition
from cloud_gateway.ingest.session import Ingest
from cloud_gateway.registry.store import Registry
from cloud_gateway.self_metrics import SelfMetrics
from gpurelay.wire import Batch, Declare, Hello, SeriesDecl
from tests.promtool_support import unexpected_findings

T0 = 1_790_000_000.0


def fed_ingest() -> tuple[Ingest, SelfMetrics]:
    metrics = SelfMetrics()
    ingest = Ingest(Registry(), clock=lambda: T0, self_metrics=metrics)
    session = ingest.open_session("n", "10.0.0.1:1", lambda reason: None)
    session.handle(Hello(agent_version="0", node="n"))
    decl = SeriesDecl(id=0, name="DCGM_FI_DEV_GPU_UTIL", type="gauge", help="h", labels=())
    session.handle(Declare(series=(decl,)))
    for seq in (1, 2, 3):
        session.handle(Batch(seq=seq, timestamp=T0 + seq, values=((0, float(seq)),)))
    return ingest, metrics


def test_every_batch_is_timed() -> None:
    _, metrics = fed_ingest()
    count = metrics.registry.get_sample_value(
        "gpurelay_gateway_frame_apply_seconds_count", {"frame": "batch"}
    )
    assert count == 3
    total = metrics.registry.get_sample_value(
        "gpurelay_gateway_frame_apply_seconds_sum", {"frame": "batch"}
    )
    assert total is not None and total > 0


def test_proxy_answers_are_timed_by_status() -> None:
    metrics = SelfMetrics()
    metrics.observe_proxy(200, 0.03)
    metrics.observe_proxy(503, 0.001)
    get = metrics.registry.get_sample_value
    assert get("gpurelay_gateway_proxy_request_seconds_count", {"code": "200"}) == 1
    assert get("gpurelay_gateway_proxy_request_seconds_bucket", {"code": "200", "le": "0.025"}) == 0
    assert get("gpurelay_gateway_proxy_request_seconds_bucket", {"code": "200", "le": "0.05"}) == 1


def test_histograms_follow_the_fleet_in_both_formats(promtool: Path) -> None:
    ingest, metrics = fed_ingest()
    exposition = Exposition(ingest.registry)
    exposition.set_extra([], histograms=metrics)
    text = exposition.body(openmetrics=False, gzip=False).decode()
    assert text.index("DCGM_FI_DEV_GPU_UTIL") < text.index("gpurelay_gateway_frame_apply")
    names = {f.name for f in text_string_to_metric_families(text)}
    assert "gpurelay_gateway_frame_apply_seconds" in names
    assert "_created" not in text
    om = exposition.body(openmetrics=True, gzip=False).decode()
    assert om.endswith("# EOF\n") and om.count("# EOF") == 1
    kinds = {f.name: f.type for f in parse_openmetrics(om)}
    assert kinds["gpurelay_gateway_frame_apply_seconds"] == "histogram"
    assert unexpected_findings(promtool, text.encode()) == []


def test_a_node_cannot_add_histogram_series_with_odd_statuses() -> None:
    metrics = SelfMetrics()
    for code in range(600, 900):  # what a hostile endpoint may answer
        metrics.observe_proxy(code, 0.01)
    get = metrics.registry.get_sample_value
    assert get("gpurelay_gateway_proxy_request_seconds_count", {"code": "other"}) == 300
    codes = {
        s.labels["code"]
        for fam in metrics.registry.collect()
        for s in fam.samples
        if "code" in s.labels
    }
    assert codes == {"other"}
