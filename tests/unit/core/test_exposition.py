from __future__ import annotations

import math

import pytest

from gpurelay.exposition import (
    format_value,
    render_openmetrics,
    render_text,
    wants_gzip,
    wants_openmetrics,
)
from gpurelay.model import Family, Sample, Snapshot


def _snapshot() -> Snapshot:
    return Snapshot(
        node="n1",
        timestamp=0.0,
        families=(
            Family(name="DCGM_FI_DEV_GPU_UTIL", type="gauge", help="util (%)"),
            Family(name="DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", type="counter", help="mJ"),
            Family(name="gpurelay_agent_collections_total", type="counter", help="cycles\nsecond"),
        ),
        samples=(
            Sample("DCGM_FI_DEV_GPU_UTIL", (("gpu", "0"),), 12.0),
            Sample("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", (("gpu", "0"),), 1e6),
            Sample("DCGM_FI_DEV_GPU_UTIL", (("gpu", "1"), ("x", 'a"b\\c\nd')), 0.5),
            Sample("gpurelay_agent_collections_total", (), 3.0),
        ),
    )


def test_text_is_family_major_with_escaping() -> None:
    body = render_text(_snapshot()).decode()
    assert body == (
        "# HELP DCGM_FI_DEV_GPU_UTIL util (%)\n"
        "# TYPE DCGM_FI_DEV_GPU_UTIL gauge\n"
        'DCGM_FI_DEV_GPU_UTIL{gpu="0"} 12\n'
        'DCGM_FI_DEV_GPU_UTIL{gpu="1",x="a\\"b\\\\c\\nd"} 0.5\n'
        "# HELP DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION mJ\n"
        "# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter\n"
        'DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{gpu="0"} 1000000\n'
        "# HELP gpurelay_agent_collections_total cycles\\nsecond\n"
        "# TYPE gpurelay_agent_collections_total counter\n"
        "gpurelay_agent_collections_total 3\n"
    )


def test_openmetrics_keeps_dcgm_names() -> None:
    body = render_openmetrics(_snapshot()).decode()
    assert "# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION unknown\n" in body
    assert 'DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{gpu="0"} 1000000\n' in body
    assert "# TYPE gpurelay_agent_collections counter\n" in body
    assert "gpurelay_agent_collections_total 3\n" in body
    assert body.endswith("# EOF\n")


def test_openmetrics_parses_with_prometheus_client() -> None:
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    fams = {
        f.name: f for f in text_string_to_metric_families(render_openmetrics(_snapshot()).decode())
    }
    assert fams["gpurelay_agent_collections"].type == "counter"
    assert fams["DCGM_FI_DEV_GPU_UTIL"].samples[1].labels["x"] == 'a"b\\c\nd'


def test_negotiation_and_values() -> None:
    assert wants_openmetrics("application/openmetrics-text;version=1.0.0,text/plain;q=0.5")
    assert not wants_openmetrics("text/plain;version=0.0.4;q=1,*/*;q=0.1")
    assert not wants_openmetrics("")
    assert format_value(3.0) == "3"
    assert format_value(0.25) == "0.25"
    assert format_value(math.nan) == "NaN"
    assert format_value(-math.inf) == "-Inf"
    assert format_value(1e20) == "1e+20"


@pytest.mark.parametrize(
    ("accept_encoding", "takes"),
    [
        ("gzip", True),
        ("gzip, deflate, br", True),  # Prometheus, browsers
        ("deflate, GZIP;q=0.5", True),
        ("*", True),
        ("", False),
        ("identity", False),
        ("gzip;q=0", False),  # gzip refused: the substring test sent it anyway
        ("x-gzip", False),
        ("br;q=1, gzip;q=0.0", False),
        ("gzip;q=bogus", False),
    ],
)
def test_gzip_is_negotiated_by_token_and_quality(accept_encoding: str, takes: bool) -> None:
    """One rule for both binaries (issue 25, item 5): the gateway's /metrics and the agent's
    used ``"gzip" in header``."""
    assert wants_gzip(accept_encoding) is takes
