"""A real Prometheus as remote-write receiver, and the check that its TSDB holds every
collection of every series of a node."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import httpx

from harness.ports import free_ports
from harness.process import Process
from harness.waiting import wait_until

RECEIVER_CONFIG = """\
global:
  scrape_interval: 1h
storage:
  tsdb:
    out_of_order_time_window: 2h
"""


class PrometheusProcess(Process):
    """A real Prometheus (Debian package ``prometheus``) on a free loopback port, with
    ``config`` the text of its prometheus.yml or a file to use as it is. Proxy variables
    are left out of its environment: scrapes go where the config says, nowhere else."""

    def __init__(
        self, binary: Path, tmp: Path, config: str | Path, flags: Sequence[str] = ()
    ) -> None:
        if isinstance(config, str):
            (tmp / "prometheus.yml").write_text(config)
            config = tmp / "prometheus.yml"
        (self.port,) = free_ports(1)
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__(
            "prometheus",
            [
                str(binary),
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                *flags,
            ],
            tmp / "prometheus.log",
            env={k: v for k, v in os.environ.items() if "proxy" not in k.lower()},
        )

    def ready(self) -> bool:
        self.check_alive()
        return httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200


class Receiver(PrometheusProcess):
    """Prometheus with --web.enable-remote-write-receiver and (by default) an out-of-order
    window."""

    def __init__(self, binary: Path, tmp: Path, config: str | Path = RECEIVER_CONFIG) -> None:
        super().__init__(binary, tmp, config, ("--web.enable-remote-write-receiver",))

    def raw(self, selector: str, *, window_s: int, at: float) -> dict[str, list[tuple[int, float]]]:
        """Every raw sample of the matching series in the ``window_s`` before ``at``."""
        resp = httpx.get(
            f"{self.url}/api/v1/query",
            params={"query": f"{selector}[{window_s}s]", "time": f"{at:.3f}"},
            timeout=30,
        )
        resp.raise_for_status()
        body = resp.json()
        assert body["status"] == "success", body
        out: dict[str, list[tuple[int, float]]] = {}
        for item in body["data"]["result"]:
            key = json.dumps(item["metric"], sort_keys=True)
            out[key] = [(round(float(t) * 1000), float(v)) for t, v in item["values"]]
        return out


@contextlib.contextmanager
def running_prometheus(binary: Path, config: Path, tmp: Path) -> Iterator[tuple[str, Path]]:
    """A started Prometheus (not yet known to be ready); yields its URL and log file; always
    stopped afterwards."""
    prometheus = PrometheusProcess(binary, tmp, config, ("--log.level=info",))
    prometheus.start()
    try:
        yield prometheus.url, prometheus.log
    finally:
        prometheus.stop()


@contextlib.contextmanager
def running_receiver(
    binary: Path, tmp: Path, config: str | Path = RECEIVER_CONFIG
) -> Iterator[Receiver]:
    """A started, ready :class:`Receiver`; killed afterwards."""
    receiver = Receiver(binary, tmp, config)
    receiver.start()
    try:
        wait_until(receiver.ready, 60, "prometheus ready")
        yield receiver
    finally:
        if receiver.running():
            receiver.kill9()


@dataclass
class Completeness:
    collections: list[tuple[int, float]]  # (ts_ms, gpurelay_agent_collections_total)
    series: int = 0
    expected: int = 0
    found: int = 0
    missing: list[str] = field(default_factory=list)
    strays: list[str] = field(default_factory=list)  # samples at no collection time

    def between(self, start: float, end: float) -> int:
        return sum(1 for t, _ in self.collections if start * 1000 <= t <= end * 1000)

    def summary(self) -> str:
        return (
            f"{self.series} series, {len(self.collections)} collections: "
            f"expected {self.expected} samples, found {self.found}, "
            f"missing {len(self.missing)}, stray {len(self.strays)}"
        )


# Fields computed from two NVML samples one interval apart (GPM profiling, NVLink rates):
# an agent's first collection after it starts cannot have them.
TWO_SAMPLE_PREFIXES: Final = ("DCGM_FI_PROF_", "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL")


# Labels that carry a state, not an identity (dcgm-exporter's health series): the series
# of one figure changes with its state (a watch's error code, the XIDs seen), so its
# samples are checked together, as one figure's, whatever that label said at each one.
STATE_LABELS = frozenset({"health_error_code", "xid"})
# Series that exist only while their state holds (a clock-event reason seen in the window):
# no collection owes them a sample.
WHILE_SEEN = ("DCGM_EXP_CLOCK_EVENTS_COUNT",)


def _by_figure(data: dict[str, list[tuple[int, float]]]) -> dict[str, list[tuple[int, float]]]:
    """``data`` by figure: the series' labels less :data:`STATE_LABELS`, their samples
    merged in time order (one per collection, whichever state it showed)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for key, samples in data.items():
        labels = json.loads(key)
        if labels["__name__"] in WHILE_SEEN:
            continue
        figure = json.dumps(
            {k: v for k, v in labels.items() if k not in STATE_LABELS}, sort_keys=True
        )
        out.setdefault(figure, []).extend(samples)
    return {k: sorted(v) for k, v in out.items()}


def completeness(receiver: Receiver, node: str, *, window_s: int, at: float) -> Completeness:
    """Every series of ``node`` must have a sample at every collection between its first and
    last sample (a two-sample rate: except an agent's first collection after it started);
    the collection counter must count up by one from sample to sample (a restart of the
    agent starts it again at 1)."""
    data = receiver.raw(f'{{Hostname="{node}"}}', window_s=window_s, at=at)
    data.update(receiver.raw(f'{{NodeName="{node}"}}', window_s=window_s, at=at))
    counter = [
        samples
        for key, samples in data.items()
        if json.loads(key)["__name__"] == "gpurelay_agent_collections_total"
    ]
    assert len(counter) == 1, f"expected one collections counter, got {len(counter)}"
    ticks = counter[0]
    result = Completeness(collections=ticks)
    for (_, prev), (t, value) in itertools.pairwise(ticks):
        if value != prev + 1 and value != 1:
            result.missing.append(f"collections_total jumps from {prev} to {value} at {t}")
    times = [t for t, _ in ticks]
    index = {t: i for i, t in enumerate(times)}
    first_after_start = {t for t, value in ticks if value == 1}
    for key, samples in _by_figure(data).items():
        result.series += 1
        have = [t for t, _ in samples]
        strays = [t for t in have if t not in index]
        result.strays.extend(f"{key} @ {t}" for t in strays[:3])
        inside = [t for t in have if t in index]
        if not inside:
            continue
        expected = times[index[inside[0]] : index[inside[-1]] + 1]
        if json.loads(key)["__name__"].startswith(TWO_SAMPLE_PREFIXES):
            # a rate over two samples has no value in an agent's first collection
            expected = [t for t in expected if t not in first_after_start]
        result.expected += len(expected)
        result.found += len(inside)
        lost = sorted(set(expected) - set(inside))
        result.missing.extend(f"{key} @ {t}" for t in lost[:3])
    return result


def assert_nothing_lost(
    receiver: Receiver,
    node: str,
    *,
    started: float,
    what: str,
    drained: Callable[[], bool],
    logs: Callable[[], str],
) -> str:
    """Wait until ``drained()`` (the agent's spool is empty and it is connected) and the
    TSDB caught up, then assert :func:`completeness` found nothing missing or stray."""
    try:
        wait_until(drained, 120, "the agent's spool to drain", poll=0.5)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{logs()}") from exc
    time.sleep(3)  # the last acknowledged batches are in the TSDB (the ACK follows the 2xx)
    window = int(time.time() - started) + 30
    result = completeness(receiver, node, window_s=window, at=time.time())
    report = f"{what}: {result.summary()}"
    print(report)
    assert result.series > 50, report
    assert not result.missing, f"{report}\n" + "\n".join(result.missing[:20])
    assert not result.strays, f"{report}\n" + "\n".join(result.strays[:20])
    assert result.found == result.expected, report
    return report
