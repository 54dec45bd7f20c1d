"""The gateway binary, top to bottom: startup -> run -> shutdown.

Startup loads the trust material (user CA, host key and certificate, revocation list),
binds SSH and HTTP, and only then reports ready (``/readyz``, systemd READY=1). Run ticks
once a second: send heartbeats due and close silent connections, publish node states
that time changed (online -> stale), expire offline nodes, re-check live certificates
against the revocation list, refresh the gateway's own metrics. Shutdown stops accepting,
says GOODBYE to every agent, drains for ``drain_seconds``, then closes (SSH, then remote
write forwarding and its client, then HTTP); signals only set the stop event.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import time
from collections.abc import Callable, Mapping
from contextlib import suppress
from typing import cast
from urllib.parse import urlsplit, urlunsplit

import asyncssh
from aiohttp import web

from cloud_gateway import __version__
from cloud_gateway.cluster.config import peer_tls
from cloud_gateway.cluster.directory import DirectoryError
from cloud_gateway.cluster.link import DirectoryLink
from cloud_gateway.cluster.membership import cluster_families
from cloud_gateway.config import GatewayConfig
from cloud_gateway.errors import GatewayConfigError, GatewayError
from cloud_gateway.exposition.body import Exposition
from cloud_gateway.fd_budget import http_cap
from cloud_gateway.http.api import families as http_families
from cloud_gateway.http.api import make_app
from cloud_gateway.http.state import HttpState
from cloud_gateway.http.ui.history import UI_FAMILIES
from cloud_gateway.ingest.delivery import Delivery, DeliverySettings
from cloud_gateway.ingest.session import Ingest
from cloud_gateway.listener import ConnectionGuard, GuardedSite
from cloud_gateway.metrics import one
from cloud_gateway.registry.store import FB_FAMILIES, NodeState, Registry, StoreConfig
from cloud_gateway.registry.types import state_families
from cloud_gateway.relay.endpoints import EndpointTable
from cloud_gateway.relay.peers import PeerClient, start_peer_listener
from cloud_gateway.relay.relay import Relay
from cloud_gateway.remote_write.client import Fanout, RemoteWriter, Writer
from cloud_gateway.remote_write.config import check_otlp, check_remote_write
from cloud_gateway.remote_write.forwarder import (
    delivery_families,
    otlp_families,
    remote_write_families,
)
from cloud_gateway.remote_write.otlp import OtlpWriter
from cloud_gateway.self_metrics import SelfMetrics
from cloud_gateway.ssh.balancer_listener import proxied_listener
from cloud_gateway.ssh.config import parse_sibling_rules
from cloud_gateway.ssh.conflicts import ConflictPolicy, Policy
from cloud_gateway.ssh.enrollment import build_enrollment
from cloud_gateway.ssh.logins import CertificatePolicy, node_log
from cloud_gateway.ssh.server import SshServer
from cloud_gateway.trust.auth_policy import load_trusted_cas
from cloud_gateway.trust.revocation import RevocationWatcher
from gpurelay.families import known
from gpurelay.sdnotify import notify
from gpurelay.settings import split_host_port
from gpurelay.web_config import BasicAuth
from gpurelay.wire import Limits

log = logging.getLogger("cloud_gateway")
TICK_SECONDS = 1.0


def _host_keys(cfg: GatewayConfig) -> list[tuple[asyncssh.SSHKey, asyncssh.SSHCertificate | None]]:
    try:
        key = asyncssh.read_private_key(str(cfg.ssh.host_key))
    except (OSError, asyncssh.KeyImportError) as exc:
        raise GatewayConfigError(f"ssh.host_key {cfg.ssh.host_key} cannot be used: {exc}") from exc
    cert_path = cfg.ssh.host_certificate_path
    cert = None
    if cert_path is not None:
        try:
            cert = asyncssh.read_certificate(str(cert_path))
        except (OSError, asyncssh.KeyImportError) as exc:
            raise GatewayConfigError(
                f"ssh.host_certificate {cert_path} cannot be used: {exc}"
            ) from exc
    return [(key, cert)]


def _redacted(url: str) -> str:
    """``url`` without a password in it (user:password@host), for the log."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username}:***@{host}"))


class Gateway:
    def __init__(self, cfg: GatewayConfig, *, clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.clock = clock
        self.stop = asyncio.Event()
        self.registry = Registry(
            StoreConfig(
                liveness=cfg.registry.liveness(),
                offline_grace=cfg.registry.offline_grace_seconds,
                max_series_per_node=cfg.ssh.max_series_per_node,
                node_label=cfg.registry.node_label,
                tracked_families=FB_FAMILIES | UI_FAMILIES,  # read by /ui
            )
        )
        self.exposition = Exposition(self.registry)
        self.self_metrics = SelfMetrics()
        self.limits = Limits(
            max_frame_bytes=cfg.ssh.max_frame_bytes, max_series=cfg.ssh.max_series_per_node
        )
        rw = check_remote_write(cfg.remote_write)
        self.remote_write = RemoteWriter(rw) if rw is not None else None
        otlp = check_otlp(cfg.otlp)
        self.otlp = (
            OtlpWriter(
                otlp,
                node_label=cfg.registry.node_label,
                kind=_family_type,
                hardware=cfg.otlp.semantic_conventions,
            )
            if otlp is not None
            else None
        )
        writers = [w for w in (self.remote_write, self.otlp) if w is not None]
        writer: Writer | None = (
            None if not writers else writers[0] if len(writers) == 1 else Fanout(writers)
        )
        self.ingest = Ingest(
            self.registry,
            clock=clock,
            limits=self.limits,
            delivery=Delivery(DeliverySettings.of(cfg.remote_write), remote_write=writer),
            self_metrics=self.self_metrics,
            conflicts=ConflictPolicy(cast(Policy, cfg.ssh.duplicate_connection)),
        )
        self.endpoints = EndpointTable(
            is_tunnel_node=lambda name: self.registry.node(name, now=self.clock()) is not None,
            siblings=parse_sibling_rules(cfg.ssh.siblings),
            max_endpoints_per_node=cfg.ssh.max_endpoints_per_node,
        )
        self.relay = Relay(
            self.registry,
            self.endpoints,
            timeout=cfg.http.proxy_timeout_seconds,
            methods=cfg.http.proxy_methods,
            clock=clock,
            self_metrics=self.self_metrics,
        )
        self.web_config = cfg.http.web_config()
        http_connections, fd_warning = http_cap(cfg.http.max_connections)
        if fd_warning is not None:
            log.warning("%s", fd_warning)
        self.connections = ConnectionGuard(
            max_connections=http_connections,
            header_timeout=cfg.http.header_timeout_seconds,
            tls=self.web_config.ssl_context() if self.web_config else None,
        )
        users = self.web_config.basic_auth_users if self.web_config else {}
        self.http = HttpState(
            registry=self.registry,
            exposition=self.exposition,
            tokens=cfg.api_tokens(),
            protect_metrics=cfg.http.protect_metrics,
            clock=clock,
            endpoints=self.endpoints,
            relay=self.relay,
            proxy_tokens=frozenset(cfg.http.proxy_tokens) or None,
            sd_tokens=frozenset(cfg.http.sd_tokens) or None,
            protect_proxy=cfg.http.protect_proxy,
            protect_sd=cfg.http.protect_sd,
            connections=self.connections,
            basic_auth=BasicAuth(users) if users else None,
        )
        self.ssh: SshServer | None = None
        self.link = DirectoryLink(
            cfg.cluster,
            self.registry,
            environ=os.environ,
            let_go=lambda reason, node: self.ssh.let_go(reason, node) if self.ssh else 0,
            clock=clock,
            endpoints=self.endpoints,
            held=self.ingest.conflicts.held,  # no directory claim for a held node
            forgotten=self._forgotten,
        )
        self.http.directory = self.link
        self.certificates = self.http.certificates  # node certificate expiry (the tick's)
        self.peer_runner: web.AppRunner | None = None
        self.peer_guard: ConnectionGuard | None = None
        self.peer_port = 0
        self.runner: web.AppRunner | None = None
        self.ssh_port = 0
        self.http_port = 0

    async def startup(self) -> None:
        cfg = self.cfg
        try:
            trusted = load_trusted_cas(cfg.ssh.user_ca)
        except (OSError, GatewayError) as exc:
            raise GatewayConfigError(f"ssh.user_ca: {exc}") from exc
        for deprecated in cfg.remote_write.deprecated():
            log.warning("%s", deprecated)
        token_file = cfg.remote_write.bearer_token_file
        if self.remote_write is not None and token_file is not None:
            try:  # read on every request; a missing file at start is an error, not a surprise
                token_file.read_text(encoding="utf-8")
            except OSError as exc:
                raise GatewayConfigError(
                    f"remote_write.bearer_token_file {token_file} cannot be read: {exc.strerror}"
                ) from exc
        revocations = None
        if cfg.ssh.revocation_file is not None:
            revocations = RevocationWatcher(cfg.ssh.revocation_file)
            revocations.current()  # a malformed file at start is an error, not a surprise
        else:  # `certs revoke` writes a file nobody reads: say so where operators look
            log.warning(
                "no [ssh] revocation_file: `cloud-gateway certs revoke` cannot take effect on "
                "this gateway (a stolen node certificate is valid until it expires); set it "
                "to the CA directory's revocations file (docs/operator-guide.md)"
            )
        self.ssh = SshServer(
            host_keys=_host_keys(cfg),
            policy=CertificatePolicy(
                trusted_cas=trusted, revocations=revocations, clock=self.clock
            ),
            sessions=self.ingest,
            limits=self.limits,
            login_timeout=cfg.ssh.login_timeout_seconds,
            frame_timeout=cfg.ssh.frame_timeout_seconds,
            max_channels_per_connection=cfg.ssh.max_channels_per_connection,
            keepalive_seconds=cfg.ssh.keepalive_seconds,
            keepalive_count_max=cfg.ssh.keepalive_count_max,
            endpoints=self.endpoints,
            proxied=proxied_listener(
                on=cfg.ssh.proxy_protocol,
                allowed=cfg.ssh.proxy_protocol_from,
                timeout=cfg.ssh.proxy_protocol_timeout_seconds,
            ),
        )
        if self.link.cluster is not None:
            await self._start_peers()
        try:
            await self.link.start()
        except DirectoryError as exc:  # exit 1, not 2: a database down at boot comes back
            raise GatewayError(f"cluster: {exc}") from exc
        if self.link.directory is not None or self.link.cluster is not None:
            self.ssh.admission = self.link
        self.ssh.policy.enrollment = build_enrollment(  # [enroll]: None when off
            cfg.enroll, trusted_cas=trusted, revocations=revocations, link=self.link
        )
        ssh_host, ssh_port = split_host_port(cfg.ssh.listen, "ssh.listen")
        self.ssh_port = await self.ssh.start(ssh_host, ssh_port)
        http_host, http_port = split_host_port(cfg.http.listen, "http.listen")
        self.runner = web.AppRunner(
            make_app(self.http),
            access_log=None,
            keepalive_timeout=cfg.http.idle_timeout_seconds,
        )
        await self.runner.setup()
        site = GuardedSite(self.runner, http_host, http_port, self.connections)
        await site.start()
        self.http_port = site.port
        self.link.set_http(http_host, self.http_port)  # for the other gateways' http_sd
        if self.http.basic_auth and not cfg.http.protect_metrics:
            log.warning(
                "basic_auth_users are set, but /metrics and /v1/collect stay open: set "
                "http.protect_metrics = true to require credentials there too"
            )
        if not self.http.tokens and not self.http.basic_auth:
            log.warning(
                "no API tokens configured: /api/* answers 403 until http.tokens or "
                "http.token_files is set"
            )
        self._refresh()
        self.http.ready = True
        log.info(
            "listening: SSH %s:%d, %s %s:%d (%d trusted user CA key(s))",
            ssh_host,
            self.ssh_port,
            "HTTP" if self.connections.tls is None else "HTTPS",
            http_host,
            self.http_port,
            len(trusted),
        )
        if self.remote_write is not None:
            log.info("remote write to %s", _redacted(self.remote_write.cfg.url))
        if self.otlp is not None:
            log.info("OTLP metrics to %s", _redacted(self.otlp.cfg.url))
        notify("READY=1")

    async def _start_peers(self) -> None:
        """The peer listener, and the relay's route to the other gateways' listeners."""
        token = self.cfg.cluster.peer_token()
        tls = peer_tls(self.cfg.cluster)
        self.relay.peers = PeerClient(token, self.link.owner, tls=tls[1] if tls else None)
        host, port = split_host_port(self.cfg.cluster.peer_listen, "cluster.peer_listen")
        self.peer_runner, self.peer_guard, self.peer_port = await start_peer_listener(
            self.relay, token, host, port, tls=tls[0] if tls else None
        )
        if not self.cfg.cluster.advertise:  # peer_listen as bound (port 0: the one chosen)
            self.link.advertise = f"{host}:{self.peer_port}"
        if tls is not None:
            log.info(
                "peer listener on https://%s:%d (gateway %s)",
                host,
                self.peer_port,
                self.link.gateway,
            )
        else:
            log.warning(
                "peer listener on http://%s:%d (gateway %s): the peer token and proxied scrapes "
                "cross the peer network in clear; set [cluster] peer_tls_* unless that network "
                "is private",
                host,
                self.peer_port,
                self.link.gateway,
            )

    def _refresh(self) -> None:
        assert self.ssh is not None
        now = self.clock()
        self.ingest.sweep()  # heartbeats due; close connections silent for too long
        for node, state in self.registry.refresh(now):
            view = self.registry.node(node, now=now)
            if state == "stale" and view is not None and view.last_batch_time is not None:
                node_log(node).warning(
                    "stale: no batch for %.1fs (an agent at %gs)",
                    now - view.last_batch_time,
                    view.interval_seconds,
                )
        for node in self.registry.expire(now):
            log.info(
                "node %s offline for more than %.0fs: its series leave /metrics",
                node,
                self.cfg.registry.offline_grace_seconds,
            )
        self.http.history.sample(self.registry, self.registry.last_batches())
        states = self.registry.published_states()  # refresh(now) made them states(now)
        self.certificates.refresh(
            now, live=self.ssh.revalidate(), held=states, stored=self.link.stored_certificates()
        )
        self._publish_gateway_families(states)

    def _forgotten(self, nodes: list[str]) -> None:
        """Another gateway holds these nodes now: their certificate series leave this
        gateway's /metrics at once too, not on the next refresh."""
        self.certificates.forget(nodes)
        if self.ssh is not None:
            self._publish_gateway_families(self.registry.states(self.clock()))

    def _publish_gateway_families(self, states: Mapping[str, NodeState]) -> None:
        assert self.ssh is not None
        """The gateway's own families, each stage's from its own ``families()``."""
        families = [
            one("gpurelay_gateway_info", 1, (("version", __version__),)),
            *state_families(states),
            *self.ssh.families(),
            *self.ingest.stats.families(),
            *self.exposition.families(),
            *http_families(self.http, self.connections.stats),
            *self.relay.families(),
        ]
        if self.remote_write is not None or self.otlp is not None:
            families += delivery_families(self.ingest.forward_stats)
        if self.remote_write is not None:
            families += remote_write_families(self.remote_write.stats)
        if self.otlp is not None:
            families += otlp_families(self.otlp.stats)
        if self.link.cluster is not None:
            peers = self.peer_guard.stats if self.peer_guard else None
            families += cluster_families(self.link.cluster, peers)
        families.append(self.certificates.family(self.registry.config.node_label))
        self.exposition.set_extra(families, histograms=self.self_metrics)
        self.exposition.set_orphans(self.link.orphans())  # the leader's: dead gateways' nodes

    async def run(self) -> None:
        while not self.stop.is_set():
            with suppress(TimeoutError):
                async with asyncio.timeout(TICK_SECONDS):
                    await self.stop.wait()
                break
            self._refresh()
            await self.link.tick(time.monotonic())
            await self.exposition.prepare(time.monotonic())  # ahead of a scrape due
            notify("WATCHDOG=1")

    async def shutdown(self) -> None:
        notify("STOPPING=1")
        started, self.http.ready = self.http.ready, False
        if self.ssh is not None:
            if started:  # not when startup failed (a port taken): nobody to tell
                log.info("shutting down: telling %d agent(s) goodbye", self.ssh.channels)
            await self.ssh.stop(self.cfg.drain_seconds)
        await self.ingest.aclose()
        await self.link.stop()
        if self.relay.peers is not None:
            await self.relay.peers.close()
        if self.peer_runner is not None:
            await self.peer_runner.cleanup()
        if self.remote_write is not None:
            await self.remote_write.close()
        if self.otlp is not None:
            await self.otlp.close()
        if self.runner is not None:
            await self.runner.cleanup()
            log.info("stopped")


async def serve(cfg: GatewayConfig) -> None:
    gateway = Gateway(cfg)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, gateway.stop.set)
    try:
        await gateway.startup()
        # The registry holds many long-lived objects: freeze what exists and collect less
        # often, so that a thousand agents declaring at once (after a gateway restart) do
        # not trigger back-to-back full collections.
        gc.collect()
        gc.freeze()
        gc.set_threshold(50_000, 20, 20)
        await gateway.run()
    finally:
        await gateway.shutdown()


def _family_type(name: str) -> str | None:
    """The fleet catalogue's TYPE of a metric name (OTLP sends counters as Sums)."""
    family = known(name)
    return family.type if family is not None else None
