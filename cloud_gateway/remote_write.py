"""Prometheus remote write 1.0 client: every sample goes out with its original timestamp.

The gateway uses this to forward live and replayed (spooled) samples to a central TSDB, so an
edge outage leaves no gap there (DESIGN.md, "No data lost"). The wire format is remote write
1.0: a protobuf ``prometheus.WriteRequest`` (encoded here by hand, no protobuf dependency),
snappy *block* compressed, POSTed with the standard headers::

    Content-Encoding: snappy
    Content-Type: application/x-protobuf
    X-Prometheus-Remote-Write-Version: 0.1.0

:meth:`RemoteWriter.send` returns only when every request of the call was accepted (2xx);
the caller acknowledges a batch to the agent only then, so the agent's spool keeps data until
it is safely stored. 5xx, 429 (honouring ``Retry-After``) and transport errors are retried
with exponential backoff and jitter; any other 4xx is final and raises
:class:`RemoteWriteRejected` with the response body (logged and counted). Back-pressure: the
writer bounds the samples in flight (``max_pending_samples``); a send that would exceed the
bound waits until earlier sends finish.

Receivers
---------
Prometheus (2.33+ for the flag; out-of-order ingestion needs 2.39+)
    Start it with ``--web.enable-remote-write-receiver``; the URL is
    ``http://prometheus:9090/api/v1/write``. Replayed backlog is older than what is already
    stored for a series, so the TSDB must accept out-of-order samples; in prometheus.yml::

        storage:
          tsdb:
            out_of_order_time_window: 1h   # at least the longest outage the spool covers

    Without it, backlog samples are rejected as "out of order" (HTTP 400, not retried).
    Samples older than the head block minus the window are refused as "out of bounds".
VictoriaMetrics
    ``http://victoriametrics:8428/api/v1/write`` (single node) or
    ``http://vminsert:8480/insert/<tenant>/prometheus/api/v1/write`` (cluster). Accepts
    out-of-order and old samples without extra settings (within ``-retentionPeriod``).
Grafana Mimir
    ``http://mimir:8080/api/v1/push``; with multi-tenancy on, add the tenant header,
    e.g. ``headers = ("X-Scope-OrgID: edge",)``. Out-of-order samples need the per-tenant
    limit ``out_of_order_time_window`` (e.g. ``1h``) in Mimir's runtime/limits config.

Auth and TLS: ``bearer_token`` or ``bearer_token_file`` (re-read on every request, so a
rotated token is picked up), or ``basic_user``/``basic_password``; ``tls_ca_file`` for a
private CA, ``tls_insecure_skip_verify`` for tests only; ``headers`` for anything else.
"""

from __future__ import annotations

import asyncio
import base64
import email.utils
import logging
import math
import random
import ssl
import struct
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC
from pathlib import Path
from typing import TypeVar

import cramjam
import httpx

from cloud_gateway import __version__

__all__ = [
    "PROTOCOL_HEADERS",
    "RemoteWriteConfig",
    "RemoteWriteError",
    "RemoteWriteRejected",
    "RemoteWriteStats",
    "RemoteWriteUnavailable",
    "RemoteWriter",
    "Series",
    "encode_requests",
    "encode_write_request",
    "snappy_compress",
    "split_series",
]

log = logging.getLogger(__name__)

Labels = tuple[tuple[str, str], ...]
Series = tuple[Labels, list[tuple[int, float]]]
"""(labels including ``__name__``, [(timestamp in ms, value), ...])."""

USER_AGENT = f"edge-gpu-relay/{__version__}"
PROTOCOL_HEADERS: dict[str, str] = {
    "Content-Encoding": "snappy",
    "Content-Type": "application/x-protobuf",
    "X-Prometheus-Remote-Write-Version": "0.1.0",
    "User-Agent": USER_AGENT,
}
_RESERVED = frozenset(h.lower() for h in (*PROTOCOL_HEADERS, "Content-Length", "Host"))
MAX_RETRY_AFTER_SECONDS = 300.0  # a receiver's Retry-After is honoured up to this
_BODY_LOG_LIMIT = 1024


# --------------------------------------------------------------------------- config


@dataclass(frozen=True, kw_only=True)
class RemoteWriteConfig:
    url: str
    bearer_token: str = ""
    bearer_token_file: Path | None = None
    basic_user: str = ""
    basic_password: str = ""
    tls_ca_file: Path | None = None
    tls_insecure_skip_verify: bool = False
    headers: tuple[str, ...] = ()  # "Name: value"
    timeout_seconds: float = 30.0
    max_samples_per_send: int = 2000
    max_pending_samples: int = 500_000  # back-pressure bound
    min_backoff_seconds: float = 0.05
    max_backoff_seconds: float = 5.0
    max_retries: int = 10  # retries after the first attempt

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"remote write url must be http(s)://, got {self.url!r}")
        if self.bearer_token and self.bearer_token_file is not None:
            raise ValueError("set bearer_token or bearer_token_file, not both")
        bearer = bool(self.bearer_token) or self.bearer_token_file is not None
        if bearer and (self.basic_user or self.basic_password):
            raise ValueError("set bearer or basic auth, not both")
        if self.basic_password and not self.basic_user:
            raise ValueError("basic_password without basic_user")
        if self.timeout_seconds <= 0:
            raise ValueError("timeout_seconds must be > 0")
        if self.max_samples_per_send < 1:
            raise ValueError("max_samples_per_send must be >= 1")
        if self.max_pending_samples < 1:
            raise ValueError("max_pending_samples must be >= 1")
        if not 0 <= self.min_backoff_seconds <= self.max_backoff_seconds:
            raise ValueError("need 0 <= min_backoff_seconds <= max_backoff_seconds")
        if self.max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        self.extra_headers()  # validates

    def extra_headers(self) -> list[tuple[str, str]]:
        """``headers`` parsed; protocol headers (and Authorization when auth is set) are
        reserved and cannot be overridden."""
        out: list[tuple[str, str]] = []
        auth_set = bool(self.bearer_token or self.bearer_token_file or self.basic_user)
        for raw in self.headers:
            name, sep, value = raw.partition(":")
            name, value = name.strip(), value.strip()
            if not sep or not name or any(c in name for c in " \t\r\n"):
                raise ValueError(f"header must be 'Name: value', got {raw!r}")
            if "\r" in value or "\n" in value:
                raise ValueError(f"header value of {name!r} contains a line break")
            lowered = name.lower()
            if lowered in _RESERVED or (auth_set and lowered == "authorization"):
                raise ValueError(f"header {name!r} is set by the remote write client")
            out.append((name, value))
        return out


# --------------------------------------------------------------------------- encoding


def _varint(n: int, out: bytearray) -> None:
    n &= 0xFFFFFFFFFFFFFFFF  # int64 is encoded as its two's complement uint64
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


def _len_field(tag: int, payload: bytes | bytearray, out: bytearray) -> None:
    out.append(tag)
    _varint(len(payload), out)
    out += payload


def _encode_label(name: str, value: str) -> bytes:
    buf = bytearray()
    _len_field(0x0A, name.encode(), buf)  # name = 1, length-delimited
    _len_field(0x12, value.encode(), buf)  # value = 2, length-delimited
    return bytes(buf)


_F64 = struct.Struct("<d")
_ZERO = bytes(8)
_LABEL_CACHE_MAX = 100_000  # label sets; a fleet's series repeat from send to send
_label_cache: dict[Labels, tuple[Labels, bytes]] = {}


def _labels(labels: Labels) -> tuple[Labels, bytes]:
    """``labels`` sorted by name without empty values, and their encoded ``labels`` fields
    (TimeSeries field 1, each a Label); cached, as the same series are sent every time."""
    hit = _label_cache.get(labels)
    if hit is not None:
        return hit
    # Prometheus requires labels sorted by name; an empty value means "no such label".
    ordered = tuple(sorted((kv for kv in labels if kv[1] != ""), key=lambda kv: kv[0]))
    names = [name for name, _ in ordered]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate label name in {labels!r}")
    block = bytearray()
    for name, label_value in ordered:
        _len_field(0x0A, _encode_label(name, label_value), block)  # labels = 1
    entry = (ordered, bytes(block))
    if len(_label_cache) >= _LABEL_CACHE_MAX:
        _label_cache.clear()
    _label_cache[labels] = _label_cache[ordered] = entry
    return entry


def _by_time(samples: list[tuple[int, float]]) -> list[tuple[int, float]]:
    if len(samples) < 2:
        return samples
    return sorted(samples, key=lambda s: s[0])  # stable: equal timestamps keep their order


def _normalised(series: Series) -> tuple[Labels, list[tuple[int, float]]]:
    labels, samples = series
    return _labels(labels)[0], _by_time(samples)


def encode_write_request(series: Sequence[Series]) -> bytes:
    """Protobuf ``prometheus.WriteRequest`` for ``series``: labels sorted by name (labels
    with an empty value dropped), samples in timestamp order; proto3 canonical encoding
    (fields with default values omitted)."""
    return _encode([(_labels(labels)[1], _by_time(samples)) for labels, samples in series])


_Prepared = tuple[bytes, list[tuple[int, float]]]  # encoded labels, samples in time order


def _encode(series: Sequence[_Prepared]) -> bytes:
    out = bytearray()
    stamps: dict[int, bytes] = {}  # timestamp field per timestamp: a request has few
    pack = _F64.pack
    for block, samples in series:
        ts = bytearray(block)
        for timestamp_ms, value in samples:
            stamp = stamps.get(timestamp_ms)
            if stamp is None:
                field = bytearray()
                t = int(timestamp_ms)
                if t:
                    field.append(0x10)  # timestamp = 2, varint
                    _varint(t, field)
                stamp = stamps[timestamp_ms] = bytes(field)
            bits = pack(float(value))
            if bits == _ZERO:  # proto3: a default (+0.0) field is omitted
                ts.append(0x12)  # samples = 2; a Sample is at most 20 bytes: one length byte
                ts.append(len(stamp))
                ts += stamp
            else:
                ts.append(0x12)
                ts.append(9 + len(stamp))
                ts.append(0x09)  # value = 1, fixed64
                ts += bits
                ts += stamp
        _len_field(0x0A, ts, out)  # timeseries = 1
    return bytes(out)


def snappy_compress(data: bytes) -> bytes:
    """Snappy block format (not framed), as remote write requires."""
    return bytes(cramjam.snappy.compress_raw(data))


def split_series(series: Sequence[Series], max_samples: int) -> Iterator[list[Series]]:
    """Requests of at most ``max_samples`` samples each; a long series is cut into
    consecutive time ranges, in order, so each series stays in timestamp order across
    requests sent one after another. Series without samples are dropped."""
    return _split([_normalised(item) for item in series], max_samples)


_K = TypeVar("_K")


def _split(
    series: Sequence[tuple[_K, list[tuple[int, float]]]], max_samples: int
) -> Iterator[list[tuple[_K, list[tuple[int, float]]]]]:
    """:func:`split_series` of series already normalised (labels or their encoding)."""
    if max_samples < 1:
        raise ValueError("max_samples must be >= 1")
    batch: list[tuple[_K, list[tuple[int, float]]]] = []
    room = max_samples
    for labels, samples in series:
        start = 0
        while start < len(samples):
            take = samples[start : start + room]
            batch.append((labels, take))
            start += len(take)
            room -= len(take)
            if room == 0:
                yield batch
                batch, room = [], max_samples
    if batch:
        yield batch


def encode_requests(series: Sequence[Series], max_samples: int) -> Iterator[tuple[bytes, int]]:
    """The request bodies for ``series`` (see :func:`split_series`), snappy compressed, each
    with its number of samples; what :meth:`RemoteWriter.send` posts."""
    prepared = [(_labels(labels)[1], _by_time(samples)) for labels, samples in series]
    for batch in _split(prepared, max_samples):
        yield snappy_compress(_encode(batch)), _sample_count(batch)


def _sample_count(series: Sequence[tuple[object, list[tuple[int, float]]]]) -> int:
    return sum(len(samples) for _, samples in series)


# --------------------------------------------------------------------------- errors, stats


class RemoteWriteError(Exception):
    """A send did not get all its samples accepted."""


class RemoteWriteRejected(RemoteWriteError):
    """The receiver refused a request with a non-retryable 4xx; retrying cannot help."""

    def __init__(self, status: int, body: str, url: str) -> None:
        super().__init__(f"remote write to {url} rejected: HTTP {status}: {body}")
        self.status = status
        self.body = body
        self.url = url


class RemoteWriteUnavailable(RemoteWriteError):
    """Retries exhausted (5xx, 429 or transport errors every time)."""


@dataclass
class RemoteWriteStats:
    pending_samples: int = 0  # reserved by sends in progress (back-pressure bound applies)
    sent_samples: int = 0  # accepted by the receiver (2xx)
    failed_samples: int = 0  # given up on: rejected, or retries exhausted
    sent_requests: int = 0
    retried_requests: int = 0  # retry attempts
    rejected_requests: int = 0  # non-retryable 4xx
    failed_requests: int = 0  # retries exhausted
    last_latency_seconds: float = 0.0  # of the last HTTP attempt that got a response
    latency_seconds_sum: float = 0.0
    latency_seconds_count: int = 0


# --------------------------------------------------------------------------- writer


def _retry_after(value: str | None, now: float) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or HTTP date), or None."""
    if not value:
        return None
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = when.timestamp() - now
    if not math.isfinite(seconds):
        return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_SECONDS)


def _tls_verify(cfg: RemoteWriteConfig) -> ssl.SSLContext | bool:
    if cfg.tls_insecure_skip_verify:
        return False
    if cfg.tls_ca_file is not None:
        return ssl.create_default_context(cafile=str(cfg.tls_ca_file))
    return True


# Prometheus before 2.49 answers HTTP 500 for samples older than its out-of-order window
# ("too old sample", "out of bounds"); no retry can ever store them, so they are treated
# like the 400 newer versions send (prometheus/prometheus#13335).
_NEVER_ACCEPTED = ("too old sample", "out of bounds")


def _never_accepted(body: str) -> bool:
    lowered = body.lower()
    return any(marker in lowered for marker in _NEVER_ACCEPTED)


class _Retryable(Exception):
    def __init__(self, reason: str, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.retry_after = retry_after


class RemoteWriter:
    """Sends series to one remote write receiver; see the module docstring."""

    def __init__(
        self,
        cfg: RemoteWriteConfig,
        *,
        client: httpx.AsyncClient | None = None,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self.cfg = cfg
        self.stats = RemoteWriteStats()
        self._sleep = sleep
        self._jitter = jitter
        self._owns_client = client is None
        self._client = client or httpx.AsyncClient(
            verify=_tls_verify(cfg), timeout=cfg.timeout_seconds
        )
        self._extra_headers = cfg.extra_headers()
        self._space = asyncio.Condition()

    async def __aenter__(self) -> RemoteWriter:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._owns_client:
            await self._client.aclose()

    # ---- back-pressure

    async def _reserve(self, n: int) -> None:
        async with self._space:
            # A send larger than the whole bound goes alone rather than never.
            await self._space.wait_for(
                lambda: (
                    self.stats.pending_samples == 0
                    or self.stats.pending_samples + n <= self.cfg.max_pending_samples
                )
            )
            self.stats.pending_samples += n

    async def _release(self, n: int) -> None:
        async with self._space:
            self.stats.pending_samples -= n
            self._space.notify_all()

    # ---- sending

    async def send(self, series: Sequence[Series]) -> None:
        """Send every sample of ``series``; returns only when all requests got a 2xx.

        Raises :class:`RemoteWriteRejected` (non-retryable 4xx) or
        :class:`RemoteWriteUnavailable` (retries exhausted); requests sent before the
        failing one stay accepted, so resending the whole call only duplicates samples,
        which receivers accept (same timestamp, same value).
        """
        total = _sample_count(series)
        if total == 0:
            return
        requests = encode_requests(series, self.cfg.max_samples_per_send)
        await self._reserve(total)
        done = 0
        try:
            for body, n in requests:
                await self._send_request(body, n)
                done += n
                self.stats.sent_samples += n
        except BaseException:
            self.stats.failed_samples += total - done
            raise
        finally:
            await self._release(total)

    def _headers(self) -> dict[str, str]:
        headers = dict(PROTOCOL_HEADERS)
        headers.update(self._extra_headers)
        cfg = self.cfg
        if cfg.bearer_token_file is not None:
            token = cfg.bearer_token_file.read_text().strip()  # re-read: tokens rotate
            headers["Authorization"] = f"Bearer {token}"
        elif cfg.bearer_token:
            headers["Authorization"] = f"Bearer {cfg.bearer_token}"
        elif cfg.basic_user:
            userpass = f"{cfg.basic_user}:{cfg.basic_password}".encode()
            headers["Authorization"] = "Basic " + base64.b64encode(userpass).decode()
        return headers

    def _backoff(self, attempt: int) -> float:
        cfg = self.cfg
        base = min(cfg.max_backoff_seconds, cfg.min_backoff_seconds * 2.0**attempt)
        return base * (0.5 + 0.5 * self._jitter())  # jitter: 50-100 % of the step

    async def _send_request(self, body: bytes, samples: int) -> None:
        attempt = 0
        while True:
            try:
                await self._attempt(body)
                self.stats.sent_requests += 1
                return
            except RemoteWriteRejected:
                self.stats.rejected_requests += 1
                raise
            except _Retryable as err:
                if attempt >= self.cfg.max_retries:
                    self.stats.failed_requests += 1
                    log.error(
                        "remote write to %s failed after %d attempts, %d samples: %s",
                        self.cfg.url,
                        attempt + 1,
                        samples,
                        err,
                    )
                    raise RemoteWriteUnavailable(
                        f"remote write to {self.cfg.url} failed after {attempt + 1} attempts: {err}"
                    ) from err
                delay = self._backoff(attempt)
                if err.retry_after is not None:
                    delay = max(delay, err.retry_after)
                log.warning(
                    "remote write to %s: %s; retry %d in %.2fs",
                    self.cfg.url,
                    err,
                    attempt + 1,
                    delay,
                )
                self.stats.retried_requests += 1
                attempt += 1
                await self._sleep(delay)

    async def _attempt(self, body: bytes) -> None:
        started = time.monotonic()
        try:
            resp = await self._client.post(
                self.cfg.url,
                content=body,
                headers=self._headers(),
                timeout=self.cfg.timeout_seconds,
            )
        except httpx.TransportError as exc:
            raise _Retryable(f"{type(exc).__name__}: {exc}") from exc
        latency = time.monotonic() - started
        self.stats.last_latency_seconds = latency
        self.stats.latency_seconds_sum += latency
        self.stats.latency_seconds_count += 1
        status = resp.status_code
        if 200 <= status < 300:
            return
        text = resp.text[:_BODY_LOG_LIMIT].strip()
        if (status == 429 or status >= 500) and not _never_accepted(text):
            retry_after = _retry_after(resp.headers.get("Retry-After"), time.time())
            raise _Retryable(f"HTTP {status}: {text}", retry_after)
        log.error("remote write to %s rejected: HTTP %d: %s", self.cfg.url, status, text)
        raise RemoteWriteRejected(status, text, self.cfg.url)
