"""Certificate renewal over the live tunnel (issue 17 §1).

From two thirds of its certificate's lifetime on (:func:`gpurelay.enrollment.renew_due`)
the agent opens the ``gpurelay-renew`` subsystem on the connection it already has, sends
its public key (or, with ``[gateway] renew_new_key = true``, a key made now) and gets a
certificate for the same node back. It writes it atomically, ends the session cleanly
and reconnects with it at once; what was not acknowledged yet stays in the spool and is
replayed, so nothing is lost. A failed renewal is logged and counted, and tried again at
most every :data:`RETRY_SECONDS`; the old certificate keeps working until it expires.

A new key is swapped in crash-safely (:func:`edge_agent.credentials.load_pair`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

import asyncssh

from edge_agent.config import TunnelConfig
from edge_agent.credentials import certificate_answer, expiry_text, next_key_path
from edge_agent.errors import AgentError
from gpurelay import compat
from gpurelay.compat import TIMEOUTS
from gpurelay.enrollment import RENEW_SUBSYSTEM, renew_due
from gpurelay.files import sync_dir, write_atomic
from gpurelay.model import Family, SampleSink
from gpurelay.ssh_cert import FOREVER, CertInfo, certificate_info

log = logging.getLogger(__name__)

RETRY_SECONDS = 300.0  # a failed renewal is tried again at most this often
REPEAT_SECONDS = 3600.0  # the same failure is logged as a warning at most this often
CHECK_SECONDS = 60.0  # how often a session looks at the clock, at most
TIMEOUT_SECONDS = 30.0  # for the gateway's answer

RENEW_FAMILIES = (
    Family(
        name="gpurelay_agent_certificate_expiry_timestamp_seconds",
        type="gauge",
        help="When the node certificate in use expires (unix seconds); absent for one that "
        "never does.",
    ),
    Family(
        name="gpurelay_agent_certificate_renewals_total",
        type="counter",
        help="Node certificates renewed over the tunnel.",
    ),
    Family(
        name="gpurelay_agent_certificate_renewal_failures_total",
        type="counter",
        help="Renewals that failed (refused, unanswered, not written); retried at most "
        "every 5 minutes.",
    ),
)


class RenewalFailed(AgentError):
    """One renewal did not give a usable certificate; tried again later."""


@dataclass
class RenewStats:
    expiry: float | None = None  # valid_before of the certificate in use
    renewals: int = 0
    failures: int = 0


class Renewer:
    """Renews the certificate of one tunnel. The tunnel tells it which certificate it
    connected with (:meth:`loaded`) and runs :meth:`watch` beside each session: it returns
    once new credentials are on disk, and the tunnel then reconnects with them."""

    def __init__(
        self,
        cfg: TunnelConfig,
        *,
        node: str,
        clock: Callable[[], float] = time.time,
    ) -> None:
        assert cfg.key is not None and cfg.certificate_path is not None
        self._cfg = cfg
        self._key_path = cfg.key
        self._cert_path = cfg.certificate_path
        self._node = node
        self._clock = clock
        self._validity: CertInfo | None = None
        self._start = 0.0  # where its lifetime counts from (see loaded)
        self._not_before = 0.0  # no attempt before this (after a failure)
        self._last_reason, self._last_warned = "", 0.0
        self.stats = RenewStats()
        self.log = logging.LoggerAdapter(log, {"node": node})

    def loaded(self, cert: asyncssh.SSHCertificate) -> None:
        """The certificate the next connection uses.

        Its lifetime counts from ``valid_after`` or from when its file was written,
        whichever is later: certificates are backdated (5 minutes, for clocks running
        behind), and with a short lifetime the two-thirds point of a backdated one can lie
        before it was issued, which would renew it again at once, in a loop."""
        try:
            self._validity = v = certificate_info(cert)
        except (ValueError, struct.error):
            self._validity = None
            self.stats.expiry = None
            return
        try:
            written = self._cert_path.stat().st_mtime
        except OSError:
            written = 0.0
        self._start = max(float(v.valid_after), min(written, float(v.valid_before)))
        before = v.valid_before
        self.stats.expiry = None if before >= FOREVER else float(before)

    def due(self, now: float) -> bool:
        v = self._validity
        if v is None or v.valid_before >= FOREVER or now < self._not_before:
            return False
        return renew_due(self._start, v.valid_before, now)

    def metrics(self, sink: SampleSink) -> None:
        for fam in RENEW_FAMILIES:
            sink.declare(fam)
        if self.stats.expiry is not None:
            sink.add("gpurelay_agent_certificate_expiry_timestamp_seconds", (), self.stats.expiry)
        sink.add("gpurelay_agent_certificate_renewals_total", (), self.stats.renewals)
        sink.add("gpurelay_agent_certificate_renewal_failures_total", (), self.stats.failures)

    async def watch(self, conn: asyncssh.SSHClientConnection, check_every: float) -> None:
        """Until due, look every ``check_every`` seconds (at most a minute); then renew.
        Returns once new credentials are written; a failure waits RETRY_SECONDS."""
        period = min(max(check_every, 0.1), CHECK_SECONDS)
        while True:
            if self.due(self._clock()) and await self.renew(conn):
                return
            await asyncio.sleep(period)

    async def renew(self, conn: asyncssh.SSHClientConnection) -> bool:
        """One renewal on ``conn``: True when the new credentials are written."""
        try:
            await self._renew(conn)
        except Exception as exc:  # a renewal never takes the tunnel down
            if not isinstance(exc, RenewalFailed):
                self.log.exception("node %s: certificate renewal failed unexpectedly", self._node)
            self.stats.failures += 1
            now = self._clock()
            self._not_before = now + RETRY_SECONDS
            expires = expiry_text(self._validity.valid_before) if self._validity else "unknown"
            # The same reason again (a read-only directory, a gateway with enrollment off)
            # is a warning once an hour, not every 5 minutes for the rest of the lifetime.
            repeat = str(exc) == self._last_reason and now < self._last_warned + REPEAT_SECONDS
            if not repeat:
                self._last_reason, self._last_warned = str(exc), now
            self.log.log(
                logging.DEBUG if repeat else logging.WARNING,
                "node %s: certificate renewal failed: %s; the current certificate (valid until "
                "%s) stays in use, next try in %.0f s",
                self._node,
                exc,
                expires,
                RETRY_SECONDS,
            )
            return False
        return True

    async def _renew(self, conn: asyncssh.SSHClientConnection) -> None:
        new_key = self._cfg.renew_new_key
        self._check_writable(new_key)
        try:
            key = (
                asyncssh.generate_private_key("ssh-ed25519")
                if new_key
                else asyncssh.read_private_key(str(self._key_path))
            )
        except (OSError, asyncssh.KeyImportError) as exc:
            raise RenewalFailed(f"node key {self._key_path} cannot be read: {exc}") from exc
        public = key.export_public_key("openssh").decode("ascii")
        try:
            async with compat.timeout(TIMEOUT_SECONDS):
                result = await conn.run(
                    subsystem=RENEW_SUBSYSTEM, input=public, check=False, encoding="utf-8"
                )
        except TIMEOUTS:
            raise RenewalFailed(f"no answer from the gateway within {TIMEOUT_SECONDS:g}s") from None
        except (OSError, asyncssh.Error) as exc:
            raise RenewalFailed(f"the gateway refused the renewal channel: {exc}") from exc
        cert, validity = certificate_answer(result, key=key, node=self._node, error=RenewalFailed)
        old = self._validity
        await asyncio.to_thread(self._write, cert, key if new_key else None)
        self.stats.renewals += 1
        self.log.info(
            "node %s: certificate renewed: serial %d, valid until %s (was serial %s, until %s)%s; "
            "reconnecting with it",
            self._node,
            validity.serial,
            expiry_text(validity.valid_before),
            old.serial if old else "?",
            expiry_text(old.valid_before) if old else "?",
            " with a new key" if new_key else "",
        )

    def _check_writable(self, new_key: bool) -> None:
        """Ask the gateway for nothing that cannot be stored (a read-only /etc under
        ProtectSystem=strict, for instance)."""
        dirs = {self._cert_path.parent} | ({self._key_path.parent} if new_key else set())
        for d in sorted(dirs):
            if not os.access(d, os.W_OK | os.X_OK):
                raise RenewalFailed(
                    f"{d} is not writable by this agent, so a renewed certificate could not be "
                    "stored there (keep the key and certificate in a writable directory, e.g. "
                    "the state directory /var/lib/edge-gpu-relay)"
                )

    def _write(self, cert: asyncssh.SSHCertificate, key: asyncssh.SSHKey | None) -> None:
        try:
            if key is not None:
                pending = next_key_path(self._key_path)
                write_atomic(pending, key.export_private_key(), 0o600)
            write_atomic(self._cert_path, cert.export_certificate(), 0o644)
            if key is not None:
                os.replace(pending, self._key_path)
                sync_dir(self._key_path.parent)
        except OSError as exc:
            raise RenewalFailed(
                f"the renewed certificate cannot be written to {self._cert_path}: "
                f"{exc.strerror or exc}"
            ) from exc
