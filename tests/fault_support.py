"""Real processes for the fault tests: a Prometheus remote-write receiver, the gateway, an
agent; and the check that the TSDB holds every collection of every series."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.gateway_support import TOKEN, Pki, free_ports

ROOT = Path(__file__).resolve().parent.parent
RECEIVER_CONFIG = """\
global:
  scrape_interval: 1h
storage:
  tsdb:
    out_of_order_time_window: 2h
"""


def wait_until(
    predicate: Callable[[], object], timeout: float, what: str, poll: float = 0.2
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except (httpx.HTTPError, OSError, ValueError):
            pass
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


class Process:
    """One child process with its log; restartable with the same arguments."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str]) -> None:
        self.name = name
        self.argv = argv
        self.log = log
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                self.argv,
                cwd=ROOT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def tail(self, lines: int = 40) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return f"--- {self.name} log ---\n" + "\n".join(text.splitlines()[-lines:])


def _clean_env(*prefixes: str) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}


class Receiver(Process):
    """Prometheus with --web.enable-remote-write-receiver and (by default) an out-of-order
    window; ``config`` is the text of its prometheus.yml, or a file to use as it is."""

    def __init__(self, binary: Path, tmp: Path, config: str | Path = RECEIVER_CONFIG) -> None:
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
                "--web.enable-remote-write-receiver",
            ],
            tmp / "prometheus.log",
            dict(os.environ),
        )

    def ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited {self.proc.returncode}\n{self.tail()}")
        return httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200

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
        if receiver.proc is not None and receiver.proc.poll() is None:
            receiver.proc.kill()
            receiver.proc.wait(timeout=10)


class GatewayProc(Process):
    def __init__(self, pki: Pki, tmp: Path, remote_write_url: str) -> None:
        self.ssh_port, self.http_port = free_ports(2)
        self.url = f"http://127.0.0.1:{self.http_port}"
        config = tmp / "gateway.toml"
        config.write_text(
            f"""drain_seconds = 1.0
log_level = "info"

[ssh]
listen = "127.0.0.1:{self.ssh_port}"
host_key = "{pki.gateway_key}"
user_ca = "{pki.ca.user_ca_pub}"

[http]
listen = "127.0.0.1:{self.http_port}"
tokens = ["{TOKEN}"]

[remote_write]
url = "{remote_write_url}/api/v1/write"
max_backoff_seconds = 1.0
"""
        )
        super().__init__(
            "gateway",
            [sys.executable, "-m", "cloud_gateway", "run", "--config", str(config)],
            tmp / "gateway.log",
            _clean_env("CLOUD_GATEWAY_"),
        )

    def ready(self) -> bool:
        return httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=10).text


class AgentProc(Process):
    def __init__(
        self,
        pki: Pki,
        tmp: Path,
        node: str,
        gateway: GatewayProc,
        *,
        spool_dir: Path,
        replay_rate: float = 50.0,
        max_in_flight: float = 64,
    ) -> None:
        creds = pki.node(node)
        (self.port,) = free_ports(1)
        self.url = f"http://127.0.0.1:{self.port}"
        config = tmp / f"agent-{node}.toml"
        config.write_text(
            f"""node_name = "{node}"
listen = "127.0.0.1:{self.port}"
interval_seconds = 1.0
process_interval_seconds = 1.0

[simulate]
gpus = 2
seed = 11
processes_per_gpu = 2

[gateway]
address = "127.0.0.1:{gateway.ssh_port}"
known_hosts = "{pki.ca.known_hosts}"
key = "{creds.private_key}"
certificate = "{creds.certificate}"
backoff_initial_seconds = 0.2
backoff_max_seconds = 1.0
connect_timeout_seconds = 5.0

[spool]
directory = "{spool_dir}"
replay_batches_per_second = {replay_rate}
max_in_flight = {int(max_in_flight)}
"""
        )
        super().__init__(
            f"agent {node}",
            [sys.executable, "-m", "edge_agent", "run", "--config", str(config)],
            tmp / f"agent-{node}.log",
            _clean_env("EDGE_AGENT_"),
        )

    def metric(self, name: str) -> float:
        """A label-less series of the agent's local /metrics."""
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise ValueError(f"{name} not in the agent's /metrics")


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


def completeness(receiver: Receiver, node: str, *, window_s: int, at: float) -> Completeness:
    """Every series of ``node`` must have a sample at every collection between its first and
    last sample; the collection counter must count up by one from sample to sample (a restart
    of the agent starts it again at 1)."""
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
    for key, samples in data.items():
        result.series += 1
        have = [t for t, _ in samples]
        strays = [t for t in have if t not in index]
        result.strays.extend(f"{key} @ {t}" for t in strays[:3])
        inside = [t for t in have if t in index]
        if not inside:
            continue
        expected = times[index[inside[0]] : index[inside[-1]] + 1]
        result.expected += len(expected)
        result.found += len(inside)
        lost = sorted(set(expected) - set(inside))
        result.missing.extend(f"{key} @ {t}" for t in lost[:3])
    return result
