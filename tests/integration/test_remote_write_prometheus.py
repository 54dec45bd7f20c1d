"""The remote write client against a real Prometheus remote-write receiver.

A real ``prometheus`` binary (Debian package ``prometheus``) on loopback, started with
``--web.enable-remote-write-receiver`` and ``storage.tsdb.out_of_order_time_window: 1h``,
receives a backlog with its original timestamps from 30 minutes ago, *after* newer samples
of the same series were written, as a replay after an outage would. Every sample must be
stored with its exact timestamp and value.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from cloud_gateway.remote_write.client import RemoteWriter
from cloud_gateway.remote_write.config import RemoteWriteConfig
from cloud_gateway.remote_write.prompb import Series
from harness.prometheus import running_receiver

CONFIG = """\
global:
  scrape_interval: 1m
storage:
  tsdb:
    out_of_order_time_window: 1h
"""


@pytest.fixture
def prometheus(prometheus_bin: Path, tmp_path: Path) -> Iterator[str]:
    """Base URL of a running Prometheus remote-write receiver."""
    with running_receiver(prometheus_bin, tmp_path, CONFIG) as receiver:
        yield receiver.url


def _query_raw(base: str, metric: str, at_ms: int) -> dict[str, list[tuple[int, float]]]:
    """Every raw sample of ``metric`` in the 40 minutes before ``at_ms``, by ``gpu`` label."""
    resp = httpx.get(
        f"{base}/api/v1/query",
        params={"query": f"{metric}[40m]", "time": f"{at_ms / 1000:.3f}"},
        timeout=10,
    )
    resp.raise_for_status()
    body = resp.json()
    assert body["status"] == "success", body
    assert body["data"]["resultType"] == "matrix"
    return {
        item["metric"]["gpu"]: [(round(float(t) * 1000), float(v)) for t, v in item["values"]]
        for item in body["data"]["result"]
    }


async def test_backlog_with_original_timestamps_is_stored_exactly(prometheus: str) -> None:
    now_ms = int(time.time() * 1000)
    rng = random.Random(7)
    metric = "gpurelay_test_util"

    def labels(gpu: str) -> tuple[tuple[str, str], ...]:
        return (("gpu", gpu), ("__name__", metric), ("node", "edge-1"))

    # Live samples of the last minute reach Prometheus first ...
    live = {
        g: [(now_ms - 60_000 + i * 10_000, rng.uniform(0, 100)) for i in range(6)] for g in "01"
    }
    # ... then the replayed backlog: 30 minutes ago, older than everything already stored.
    start = now_ms - 30 * 60_000
    backlog = {g: [(start + i * 5_000 + 7, rng.uniform(0, 100)) for i in range(120)] for g in "01"}
    for samples in backlog.values():
        rng.shuffle(samples)  # the writer sorts them; Prometheus must see timestamp order

    cfg = RemoteWriteConfig(
        url=f"{prometheus}/api/v1/write",
        max_samples_per_send=50,
        timeout_seconds=10,
    )
    async with RemoteWriter(cfg) as writer:
        await writer.send([(labels(g), s) for g, s in live.items()])
        backlog_series: list[Series] = [(labels(g), s) for g, s in backlog.items()]
        await writer.send(backlog_series)
        assert writer.stats.sent_samples == 2 * (6 + 120)
        assert writer.stats.failed_samples == 0
        assert writer.stats.rejected_requests == 0
        assert writer.stats.pending_samples == 0

    stored = _query_raw(prometheus, metric, now_ms + 1_000)
    assert sorted(stored) == ["0", "1"]
    for gpu in "01":
        expected = sorted(backlog[gpu] + live[gpu])
        assert len(stored[gpu]) == len(expected) == 126
        assert stored[gpu] == expected
