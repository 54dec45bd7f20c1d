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
import dataclasses
import email.utils
import logging
import math
import ssl
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC
from pathlib import Path
from typing import Final

import httpx

from cloud_gateway import __version__
from cloud_gateway.remote_write.prompb import Series, encode_requests
from gpurelay.files import in_daemon_thread

# A node's collections waiting for remote write before its channel is no longer read
# (back-pressure); the default of [remote_write] max_queued_batches_per_node, and the one
# place it is written.
MAX_QUEUED_BATCHES: Final = 256

__all__ = [
    "PROTOCOL_HEADERS",
    "RemoteWriteConfig",
    "RemoteWriteError",
    "RemoteWriteRejected",
    "RemoteWriteStats",
    "RemoteWriteUnavailable",
    "RemoteWriter",
    "classify",
]

log = logging.getLogger("cloud_gateway.remote_write")

USER_AGENT = f"edge-gpu-relay/{__version__}"
PROTOCOL_HEADERS: dict[str, str] = {
    "Content-Encoding": "snappy",
    "Content-Type": "application/x-protobuf",
    "X-Prometheus-Remote-Write-Version": "0.1.0",
    "User-Agent": USER_AGENT,
}
_RESERVED_HEADERS = frozenset(h.lower() for h in (*PROTOCOL_HEADERS, "Content-Length", "Host"))
MAX_RETRY_AFTER_SECONDS = 300.0  # a receiver's Retry-After is honoured up to this
_BODY_LOG_LIMIT = 1024


# --------------------------------------------------------------------------- config


@dataclass(frozen=True, kw_only=True)
class RemoteWriteConfig:
    """Remote write settings, declared once: the ``[remote_write]`` section of
    gateway.toml (every key overridable by ``CLOUD_GATEWAY_REMOTE_WRITE_<KEY>``), read by
    the writer (the request) and the forwarders (backoff, queue). ``url = ""``: off.
    Checked by :meth:`validate` (the config loader and :class:`RemoteWriter` call it)."""

    url: str = ""
    bearer_token: str = ""
    bearer_token_file: Path | None = None  # re-read on every request (rotation)
    basic_user: str = ""
    basic_password: str = ""
    tls_ca_file: Path | None = None
    tls_insecure_skip_verify: bool = False
    headers: tuple[str, ...] = ()  # "Name: value", e.g. "X-Scope-OrgID: edge"
    timeout_seconds: float = 30.0  # per request
    max_samples_per_send: int = 2000  # per request
    max_pending_samples: int = 500_000  # in flight across all nodes (back-pressure bound)
    min_backoff_seconds: float = 0.05  # the forwarder's retry backoff, doubling with jitter
    max_backoff_seconds: float = 5.0  # ... up to this (a longer Retry-After is honoured)
    max_queued_batches_per_node: int = MAX_QUEUED_BATCHES  # more: stop reading that node
    max_retries: int | None = field(
        default=None,
        metadata={"deprecated": "batches are retried until the receiver accepts or refuses them"},
    )

    def validate(self) -> None:
        """ValueError naming the first setting that is wrong (the url only when set)."""
        if self.url and not self.url.startswith(("http://", "https://")):
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
        if self.max_queued_batches_per_node < 1:
            raise ValueError("max_queued_batches_per_node must be >= 1")
        self.extra_headers()  # validates

    def deprecated(self) -> list[str]:
        """One line for each deprecated key that is set (accepted, ignored): for the log."""
        return [
            f"remote_write.{f.name} is deprecated and ignored ({f.metadata['deprecated']}); "
            "remove it from the config"
            for f in dataclasses.fields(self)
            if "deprecated" in f.metadata and getattr(self, f.name) is not None
        ]

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
            if lowered in _RESERVED_HEADERS or (auth_set and lowered == "authorization"):
                raise ValueError(f"header {name!r} is set by the remote write client")
            out.append((name, value))
        return out


# --------------------------------------------------------------------------- errors, stats


class RemoteWriteError(Exception):
    """A request of a send was not accepted. ``status``: the HTTP status, or None when
    there was no answer (a transport error); ``body``: the receiver's answer (its start),
    or what went wrong."""

    verdict = "not accepted"

    def __init__(self, status: int | None, body: str, url: str) -> None:
        answer = body if status is None else f"HTTP {status}: {body}"
        super().__init__(f"remote write to {url} {self.verdict}: {answer}")
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
        self, status: int | None, body: str, url: str, *, retry_after: float | None = None
    ) -> None:
        super().__init__(status, body, url)
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


def classify(
    status: int, body: str, retry_after: str | None, url: str, *, now: float
) -> RemoteWriteError | None:
    """What an answer means: None for a 2xx, else the error to raise. ``body`` is the
    receiver's answer, ``retry_after`` its Retry-After header, ``now`` the wall clock."""
    if 200 <= status < 300:
        return None
    never = any(marker in body.lower() for marker in _NEVER_ACCEPTED)
    if (status == 429 or status >= 500) and not never:
        delay = _retry_after(retry_after, now)
        return RemoteWriteUnavailable(status, body, url, retry_after=delay)
    return RemoteWriteRejected(status, body, url)


class RemoteWriter:
    """Sends series to one remote write receiver; see the module docstring."""

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
        requests = encode_requests(series, self.cfg.max_samples_per_send)
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

    async def _headers(self) -> dict[str, str]:
        headers = dict(PROTOCOL_HEADERS)
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
            raise RemoteWriteUnavailable(None, reason, url) from exc
        started = time.monotonic()
        try:
            resp = await self._client.post(
                url, content=body, headers=headers, timeout=self.cfg.timeout_seconds
            )
        except httpx.TransportError as exc:
            self.stats.retried_requests += 1
            raise RemoteWriteUnavailable(None, f"{type(exc).__name__}: {exc}", url) from exc
        latency = time.monotonic() - started
        self.stats.last_latency_seconds = latency
        self.stats.latency_seconds_sum += latency
        self.stats.latency_seconds_count += 1
        text = "" if resp.is_success else resp.text[:_BODY_LOG_LIMIT].strip()
        error = classify(
            resp.status_code, text, resp.headers.get("Retry-After"), url, now=time.time()
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
