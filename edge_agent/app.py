"""The agent binary, top to bottom: startup -> run -> shutdown.

Startup opens NVML (or the simulator), enumerates GPUs, builds the collectors, runs a
first collection (which also tells which fields this node cannot supply), binds the
local HTTP listener and only then tells systemd READY=1. Run collects every interval in
a worker thread. Signals only set the stop event; shutdown closes in reverse order.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from edge_agent import __version__, http_server
from edge_agent.backend import open_backend
from edge_agent.config import AgentConfig
from edge_agent.errors import AgentError
from edge_agent.httpd import HttpServer
from edge_agent.outbox import Outbox
from edge_agent.pipeline import Pipeline, build_pipeline
from edge_agent.spool import Spool, SpoolLimits
from edge_agent.tunnel import Tunnel
from edge_agent.tunnel_types import PublishedEndpoint
from gpurelay.model import Snapshot
from gpurelay.sdnotify import notify
from gpurelay.tasks import stop_task
from gpurelay.wire import Hello

log = logging.getLogger("edge_agent")
SPOOL_RECOVERY_SECONDS = 300.0  # a full-disk episode ends after this long without a failure


class Agent:
    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.stop = _StopEvent(self._interrupt)
        self.published = http_server.LatestSnapshot(max_age=max(3 * cfg.interval_seconds, 30.0))
        self.pipeline: Pipeline | None = None
        self.runner: HttpServer | None = None
        self.port = 0
        self.local_port = 0  # where the tunnel reaches our exporter (plain, loopback)
        self.listening: http_server.Listening | None = None
        self.tunnel: Tunnel | None = None
        self.outbox: Outbox | None = None  # its spool locked first: one agent per spool
        self._alarm: asyncio.Future[bool] | None = None  # the run loop's sleep, if asleep
        # Collections run one at a time, always on this one thread: asyncio.to_thread's
        # shared pool handed them to whichever thread was idle, each with its own malloc
        # arena (more resident memory for nothing).
        self._collector = ThreadPoolExecutor(max_workers=1, thread_name_prefix="collect")
        self._next_at = 0.0
        self._tunnel_task: asyncio.Task[None] | None = None

    def hello(self) -> Hello:
        assert self.pipeline is not None
        snap = self.published.snapshot
        return Hello(
            agent_version=__version__,
            node=self.pipeline.node,
            domain=self.cfg.domain or self.pipeline.node,
            backend=self.pipeline.backend,
            driver_version=self.pipeline.driver_version,
            hostname=socket.gethostname(),
            interval_seconds=self.cfg.interval_seconds,
            gpus=snap.gpus if snap else (),
        )

    def published_endpoints(self) -> list[PublishedEndpoint]:
        """The allowlist offered through the tunnel: our exporter, then the config's."""
        assert self.pipeline is not None
        node = self.pipeline.node
        out = []
        if self.cfg.publish_agent:
            host = self.cfg.listen_host
            local = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
            if self.local_port != self.port:  # TLS outside: the plain loopback listener
                local = "127.0.0.1"
            out.append(PublishedEndpoint("edge-agent", node, self.port, local, self.local_port))
        for p in self.cfg.publish:
            out.append(PublishedEndpoint(p.name, p.node or node, p.port, p.host, p.target))
        return out

    async def startup(self) -> None:
        self.outbox = self._outbox() if self.cfg.gateway.gateways else None  # first (the lock)
        self.pipeline = build_pipeline(open_backend(self.cfg))
        if self.pipeline.xid is not None:
            self.pipeline.xid.start()
        if self.outbox is not None:
            # Before the first collection, so that every collection (the first one after a
            # restart included) carries the tunnel's and the spool's own series.
            self.tunnel = Tunnel(
                self.cfg.gateway,
                node=self.pipeline.node,
                hello=self.hello,
                outbox=self.outbox,
                replay_batches_per_second=self.cfg.spool.replay_batches_per_second,
            )
            self.pipeline.collection.extra.append(self.tunnel.metrics)
        snapshot = await self._collect()
        self.published.publish(snapshot)
        web_config = self.cfg.web_config()
        self.listening = listening = await http_server.serve(
            self.published,
            self.cfg.listen_host,
            self.cfg.listen_port,
            web_config=web_config,
            tunnel=self.tunnel is not None and self.cfg.publish_agent,
        )
        self.runner, self.port, self.local_port = (
            listening.runner,
            listening.port,
            listening.local_port,
        )
        tls = web_config is not None and web_config.tls is not None
        log.info(
            "serving /metrics, /v1/collect, /healthz on %s://%s:%d%s",
            "https" if tls else "http",
            self.cfg.listen_host,
            self.port,
            " (basic auth)" if web_config and web_config.basic_auth_users else "",
        )
        warning = http_server.listener_warning(self.cfg.listen_host, tls=tls)
        if warning is not None:
            log.warning("%s", warning)
        if self.tunnel is not None:
            self.tunnel.publish(self.published_endpoints())
            self.tunnel.submit(snapshot)
            self._tunnel_task = asyncio.create_task(self.tunnel.run(), name="tunnel")
        else:
            log.info("no gateway.address(es) configured: serving locally only, not pushing")
        notify("READY=1")

    def _outbox(self) -> Outbox:
        sp = self.cfg.spool
        if not sp.enabled:
            log.warning(
                "spool disabled: collections taken while the gateway is unreachable are lost"
            )
            return Outbox(None, max_in_flight=sp.max_in_flight)
        spool = Spool(
            sp.path,
            limits=SpoolLimits(max_bytes=sp.max_bytes, max_age_seconds=sp.max_age_seconds),
            recovery_seconds=SPOOL_RECOVERY_SECONDS,
        )
        st = spool.stats()
        log.info(
            "spool %s: %d batches (%d bytes) waiting; bounds %d bytes, %gs",
            sp.path,
            st.batches,
            st.bytes,
            sp.max_bytes,
            sp.max_age_seconds,
        )
        return Outbox(spool, max_in_flight=sp.max_in_flight)

    def reload(self, new: AgentConfig) -> list[str]:
        """Apply what is safe to change while running (log level, intervals); returns the
        keys that need a restart. Called on SIGHUP with the re-read configuration."""
        assert self.pipeline is not None
        old = self.cfg
        safe = {"log_level", "interval_seconds", "process_interval_seconds"}
        restart = [
            f.name
            for f in dataclasses.fields(AgentConfig)
            if f.name not in safe and getattr(old, f.name) != getattr(new, f.name)
        ]
        logging.getLogger().setLevel(new.log_level.upper())
        self.pipeline.collection.set_process_interval(new.process_interval_seconds)
        self.cfg = dataclasses.replace(
            old,
            log_level=new.log_level,
            interval_seconds=new.interval_seconds,
            process_interval_seconds=new.process_interval_seconds,
        )
        self.published.max_age = max(3 * new.interval_seconds, 30.0)
        self._next_at = time.monotonic() + new.interval_seconds
        self._interrupt()
        log.info(
            "configuration reloaded: log level %s, interval %gs, process interval %gs%s",
            new.log_level,
            new.interval_seconds,
            new.process_interval_seconds,
            f"; restart to apply: {', '.join(restart)}" if restart else "",
        )
        return restart

    async def _sleep_until(self, when: float) -> bool:
        """Wait until ``when``; False if stopped, or woken early by a reload. One timer
        and one future per cycle (not two tasks and a wait: a share of the idle agent's
        event-loop CPU)."""
        if self.stop.is_set():
            return False
        loop = asyncio.get_running_loop()
        alarm: asyncio.Future[bool] = loop.create_future()
        self._alarm = alarm
        timer = loop.call_later(max(when - time.monotonic(), 0), _resolve, alarm, True)
        try:
            return await alarm
        finally:
            timer.cancel()
            self._alarm = None

    async def _collect(self) -> Snapshot:
        assert self.pipeline is not None
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._collector, self.pipeline.collection.collect)

    def _interrupt(self) -> None:
        """End the run loop's current sleep early (stop or reload)."""
        if self._alarm is not None:
            _resolve(self._alarm, False)

    def collect_now(self) -> None:
        """Have the running loop collect (and push) at once, then every interval from
        then on: for a test or tool that decides when a collection happens."""
        self._next_at = time.monotonic()
        self._interrupt()

    async def run(self) -> None:
        assert self.pipeline is not None
        self._next_at = time.monotonic() + self.cfg.interval_seconds
        while not self.stop.is_set():
            if not await self._sleep_until(self._next_at):
                continue  # stopped (the loop ends) or reloaded (_next_at was moved)
            self._next_at += self.cfg.interval_seconds
            if self._next_at < time.monotonic():  # fell behind (hung NVML call): no burst
                self._next_at = time.monotonic() + self.cfg.interval_seconds
            snapshot = await self._collect()
            self.published.publish(snapshot)
            if self.tunnel is not None:
                self.tunnel.submit(snapshot)
            notify("WATCHDOG=1")

    async def shutdown(self) -> None:
        notify("STOPPING=1")
        if self._tunnel_task is not None:  # cancelled again if it lost a cancellation
            node = self.pipeline.node if self.pipeline is not None else "?"
            await stop_task(self._tunnel_task, what=f"node {node}: the tunnel")
        if self.outbox is not None:
            self.outbox.close()
        if self.listening is not None:
            await self.listening.close()
        self._collector.shutdown(wait=False, cancel_futures=True)  # a hung NVML call stays
        if self.pipeline is not None:
            self.pipeline.close()
        log.info("stopped")


def _resolve(future: asyncio.Future[bool], value: bool) -> None:
    if not future.done():
        future.set_result(value)


class _StopEvent(asyncio.Event):
    """``Agent.stop``: setting it also ends the run loop's sleep."""

    def __init__(self, on_set: Callable[[], None]) -> None:
        super().__init__()
        self._on_set = on_set

    def set(self) -> None:
        super().set()
        self._on_set()


async def serve(cfg: AgentConfig, reload: Callable[[], AgentConfig] | None = None) -> None:
    """Run until SIGINT/SIGTERM; SIGHUP re-reads the configuration through ``reload``."""
    agent = Agent(cfg)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, agent.stop.set)

    def on_hup() -> None:
        if reload is None or agent.pipeline is None:
            return
        try:
            agent.reload(reload())
        except AgentError as exc:
            log.error("configuration not reloaded, keeping the running one: %s", exc)

    loop.add_signal_handler(signal.SIGHUP, on_hup)
    try:
        await agent.startup()
        await agent.run()
    finally:
        await agent.shutdown()
