"""Prometheus remote write 1.0 client: one attempt per request, and what the answer means.

The gateway forwards every sample, live and replayed from an agent's spool, with its
original timestamp to a central TSDB, so an edge outage leaves no gap there: a batch is
acknowledged to the agent (and leaves its spool) only once the receiver accepted it. The
wire format is remote write 1.0: a protobuf ``prometheus.WriteRequest``
(:mod:`cloud_gateway.remote_write.prompb`), snappy *block* compressed, POSTed with the standard
headers::

    Content-Encoding: snappy
    Content-Type: application/x-protobuf
    X-Prometheus-Remote-Write-Version: 0.1.0

:meth:`RemoteWriter.send` makes one attempt per request and classifies the answer:

- 2xx: accepted.
- 5xx, 429 and transport errors: :class:`RemoteWriteUnavailable`, worth sending again
  later, not before its ``retry_after`` (the receiver's ``Retry-After``) when it has one.
- any other 4xx, and the 500 old Prometheus versions answer for samples too old to ever
  be stored: :class:`RemoteWriteRejected`, final, with the receiver's answer.

The writer never sleeps or retries: :class:`~cloud_gateway.remote_write.forwarder.Forwarder`
owns the one backoff (``min_backoff_seconds`` doubling to ``max_backoff_seconds``, with jitter,
``Retry-After`` as a floor) and retries for as long as the agent's session lives.
Back-pressure: the writer bounds the samples in flight (``max_pending_samples``); a send
that would exceed the bound waits until earlier sends finish.

Receivers (Prometheus with ``--web.enable-remote-write-receiver`` and an out-of-order
window, VictoriaMetrics, Grafana Mimir), their URLs and what each refuses:
deploy/prometheus/README.md and docs/operator-guide.md, "Remote write".

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
import ssl
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC
from pathlib import Path
from typing import Protocol

import httpx

from cloud_gateway.remote_write.config import (
    PROTOCOL_HEADERS,
    RemoteWriteConfig,
)
from cloud_gateway.remote_write.prompb import Series, encode_requests
from gpurelay.files import in_daemon_thread

__all__ = [
    "Fanout",
    "RemoteWriteError",
    "RemoteWriteRejected",
    "RemoteWriteStats",
    "RemoteWriteUnavailable",
    "RemoteWriter",
    "Writer",
    "classify",
]

log = logging.getLogger("cloud_gateway.remote_write")

MAX_RETRY_AFTER_SECONDS = 300.0  # a receiver's Retry-After is honoured up to this
_BODY_LOG_LIMIT = 1024


# --------------------------------------------------------------------------- config


# --------------------------------------------------------------------------- errors, stats


class RemoteWriteError(Exception):
    """A request of a send was not accepted. ``status``: the HTTP status, or None when
    there was no answer (a transport error); ``body``: the receiver's answer (its start),
    or what went wrong."""

    verdict = "not accepted"

    def __init__(
        self, status: int | None, body: str, url: str, *, protocol: str = "remote write"
    ) -> None:
        answer = body if status is None else f"HTTP {status}: {body}"
        super().__init__(f"{protocol} to {url} {self.verdict}: {answer}")
        self.status = status
        self.body = body
        self.url = url


class RemoteWriteRejected(RemoteWriteError):
    """Refused for good (a 4xx other than 429, or a sample too old to ever be stored):
    sending the same request again cannot help."""

    verdict = "rejected"


class RemoteWriteUnavailable(RemoteWriteError):
    """Not taken now (5xx, 429, a transport error): the same request may be accepted
    later, not before ``retry_after`` seconds when the receiver said so (``Retry-After``)."""

    verdict = "unavailable"

    def __init__(
        self,
        status: int | None,
        body: str,
        url: str,
        *,
        retry_after: float | None = None,
        protocol: str = "remote write",
    ) -> None:
        super().__init__(status, body, url, protocol=protocol)
        self.retry_after = retry_after


@dataclass
class RemoteWriteStats:
    pending_samples: int = 0  # reserved by sends in progress (back-pressure bound applies)
    sent_samples: int = 0  # accepted by the receiver (2xx)
    failed_samples: int = 0  # of sends that failed: rejected, or to be sent again
    sent_requests: int = 0  # accepted (2xx)
    retried_requests: int = 0  # unavailable (5xx, 429, transport error): sent again later
    rejected_requests: int = 0  # refused for good
    last_latency_seconds: float = 0.0  # of the last request that got a response
    latency_seconds_sum: float = 0.0
    latency_seconds_count: int = 0


# --------------------------------------------------------------------------- writer


def retry_after_seconds(value: str | None, now: float) -> float | None:
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


def classify(
    status: int, body: str, retry_after: str | None, url: str, *, now: float
) -> RemoteWriteError | None:
    """What an answer means: None for a 2xx, else the error to raise. ``body`` is the
    receiver's answer, ``retry_after`` its Retry-After header, ``now`` the wall clock."""
    if 200 <= status < 300:
        return None
    never = any(marker in body.lower() for marker in _NEVER_ACCEPTED)
    if (status == 429 or status >= 500) and not never:
        delay = retry_after_seconds(retry_after, now)
        return RemoteWriteUnavailable(status, body, url, retry_after=delay)
    return RemoteWriteRejected(status, body, url)


class Writer(Protocol):
    """What a node's forwarder sends through: one receiver, or several (:class:`Fanout`)."""

    async def send(self, series: Sequence[Series]) -> None: ...


class Fanout:
    """Several receivers (remote write and OTLP): a send returns once every one accepted,
    and raises what the first that did not raised. A batch sent again after a failure goes
    to every receiver again; one that had taken it gets the same samples twice (same
    timestamps and values: Prometheus-compatible stores keep one)."""

    def __init__(self, writers: Sequence[Writer]) -> None:
        self.writers = tuple(writers)

    async def send(self, series: Sequence[Series]) -> None:
        for writer in self.writers:
            await writer.send(series)


class RemoteWriter:
    """Sends series to one remote write receiver; see the module docstring. The protocol
    is in three methods a subclass replaces (:class:`~cloud_gateway.remote_write.otlp.
    OtlpWriter`): the request bodies, the protocol's headers, what an answer means."""

    protocol = "remote write"

    def __init__(self, cfg: RemoteWriteConfig, *, client: httpx.AsyncClient | None = None) -> None:
        cfg.validate()
        if not cfg.url:
            raise ValueError("remote write url is empty (remote write is off)")
        self.cfg = cfg
        self.stats = RemoteWriteStats()
        self._owns_client = client is None
        self._client = client or httpx.AsyncClient(
            verify=_tls_verify(cfg), timeout=cfg.timeout_seconds
        )
        self._extra_headers = cfg.extra_headers()
        self._space = asyncio.Condition()
        self._token_read: asyncio.Future[str] | None = None  # bearer_token_file, in a thread

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
        """Send every sample of ``series``, one attempt per request (of at most
        ``max_samples_per_send`` samples); returns when every request got a 2xx.

        Raises at the first request that did not: :class:`RemoteWriteUnavailable` (send
        again later) or :class:`RemoteWriteRejected` (final); ValueError if ``series``
        cannot be encoded (a duplicate label name). Requests before the failing one stay
        accepted: sending ``series`` again duplicates their samples (same timestamps, same
        values), which receivers accept.
        """
        total = sum(len(samples) for _, samples in series)
        if total == 0:
            return
        requests = self._requests(series)
        await self._reserve(total)
        done = 0
        try:
            for body, n in requests:
                await self._post(body)
                done += n
                self.stats.sent_samples += n
        except BaseException:
            self.stats.failed_samples += total - done
            raise
        finally:
            await self._release(total)

    def _requests(self, series: Sequence[Series]) -> Iterator[tuple[bytes, int]]:
        return encode_requests(series, self.cfg.max_samples_per_send)

    def _protocol_headers(self) -> Mapping[str, str]:
        return PROTOCOL_HEADERS

    def _classify(
        self, status: int, body: str, retry_after: str | None, *, now: float
    ) -> RemoteWriteError | None:
        return classify(status, body, retry_after, self.cfg.url, now=now)

    async def _headers(self) -> dict[str, str]:
        headers = dict(self._protocol_headers())
        headers.update(self._extra_headers)
        cfg = self.cfg
        if cfg.bearer_token_file is not None:
            token = await self._file_token(cfg.bearer_token_file)
            headers["Authorization"] = f"Bearer {token}"
        elif cfg.bearer_token:
            headers["Authorization"] = f"Bearer {cfg.bearer_token}"
        elif cfg.basic_user:
            userpass = f"{cfg.basic_user}:{cfg.basic_password}".encode()
            headers["Authorization"] = "Basic " + base64.b64encode(userpass).decode()
        return headers

    async def _file_token(self, path: Path) -> str:
        """``bearer_token_file``, read again for this request (tokens rotate), in a thread:
        a slow or hung mount must not stall the loop. Requests meanwhile share that read
        and wait for it at most a request's timeout (TimeoutError, an OSError)."""
        read = self._token_read
        if read is None or read.done():
            read = self._token_read = in_daemon_thread(path.read_text, name="remote-write-token")
        async with asyncio.timeout(self.cfg.timeout_seconds):
            return (await asyncio.shield(read)).strip()

    async def _post(self, body: bytes) -> None:
        """One attempt at one request; the counters say how it went."""
        url = self.cfg.url
        try:
            headers = await self._headers()
        except OSError as exc:  # the token file, mid-rotation or hung: try again later
            self.stats.retried_requests += 1
            why = exc.strerror or f"not read within {self.cfg.timeout_seconds:g} s"
            reason = f"bearer_token_file {self.cfg.bearer_token_file}: {why}"
            raise RemoteWriteUnavailable(None, reason, url, protocol=self.protocol) from exc
        started = time.monotonic()
        try:
            resp = await self._client.post(
                url, content=body, headers=headers, timeout=self.cfg.timeout_seconds
            )
        except httpx.TransportError as exc:
            self.stats.retried_requests += 1
            why = f"{type(exc).__name__}: {exc}"
            raise RemoteWriteUnavailable(None, why, url, protocol=self.protocol) from exc
        latency = time.monotonic() - started
        self.stats.last_latency_seconds = latency
        self.stats.latency_seconds_sum += latency
        self.stats.latency_seconds_count += 1
        text = "" if resp.is_success else resp.text[:_BODY_LOG_LIMIT].strip()
        error = self._classify(
            resp.status_code, text, resp.headers.get("Retry-After"), now=time.time()
        )
        if error is None:
            self.stats.sent_requests += 1
            return
        if isinstance(error, RemoteWriteRejected):
            self.stats.rejected_requests += 1
            log.error("%s", error)
        else:
            self.stats.retried_requests += 1
        raise error
