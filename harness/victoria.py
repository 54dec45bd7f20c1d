"""VictoriaMetrics single node (Debian ``victoria-metrics``) as a second, independent
remote-write receiver: ``/api/v1/write`` in, raw samples out through its own export API
(``/api/v1/export``), so a test can check every sample of every series for gaps and
duplicates without going through PromQL.

``dedup``: the ``-dedup.minScrapeInterval`` it runs with, as docs/operator-guide.md tells
operators to ("1ms": one sample per series and millisecond, which removes exactly the
identical copies an at-least-once replay writes; the export API then shows one); ``None``:
without, every copy written is stored and exported."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import httpx

from harness.ports import free_ports
from harness.process import HarnessError, Process

READY_TIMEOUT = 30.0


def find_victoria() -> Path | None:
    found = shutil.which("victoria-metrics")
    return Path(found) if found else None


class VictoriaMetrics(Process):
    def __init__(self, tmp: Path, binary: Path | None = None, *, dedup: str | None = "1ms") -> None:
        binary = binary or find_victoria()
        if binary is None:
            raise HarnessError("victoria-metrics not found (Debian package `victoria-metrics`)")
        self.port = free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [
            str(binary),
            f"-httpListenAddr=127.0.0.1:{self.port}",
            f"-storageDataPath={tmp / 'victoria-data'}",
            "-retentionPeriod=1d",
            "-search.latencyOffset=0s",  # samples are queryable at once, not 30 s later
            "-search.disableCache",
            "-loggerLevel=WARN",
        ]
        if dedup is not None:
            argv.append(f"-dedup.minScrapeInterval={dedup}")
        super().__init__("victoria-metrics", argv, tmp / "victoria-metrics.log")

    @property
    def write_url(self) -> str:
        return f"{self.url}/api/v1/write"

    def start(self) -> None:
        super().start()
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            self.check_alive()
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise HarnessError(
                    f"VictoriaMetrics not ready in {READY_TIMEOUT:g}s\n{self.tail()}"
                )
            time.sleep(0.1)

    def flush(self) -> None:
        """Make everything written so far searchable (its in-memory parts to disk)."""
        httpx.get(f"{self.url}/internal/force_flush", timeout=30).raise_for_status()

    def export(
        self, match: str, *, start: float = 0, end: float | None = None
    ) -> dict[str, list[tuple[int, float]]]:
        """Raw samples of every series matching ``match``, keyed by the series' sorted
        labels as text: ``{series: [(timestamp_ms, value), ...]}`` in time order."""
        params = {"match[]": match, "start": str(start)}
        if end is not None:
            params["end"] = str(end)
        r = httpx.get(f"{self.url}/api/v1/export", params=params, timeout=60)
        r.raise_for_status()
        out: dict[str, list[tuple[int, float]]] = {}
        for line in r.text.splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            labels = row["metric"]
            key = "{" + ",".join(f'{k}="{labels[k]}"' for k in sorted(labels)) + "}"
            samples = list(zip(row["timestamps"], row["values"], strict=True))
            out.setdefault(key, []).extend((int(t), float(v)) for t, v in samples)
        for samples in out.values():
            samples.sort()
        return out
