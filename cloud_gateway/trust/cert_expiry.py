"""When each node's SSH user certificate expires: the gauge, the API field, the warnings.

The expiry is the certificate's ``valid_before`` as the gateway saw it at authentication
(:func:`gpurelay.ssh_cert.certificate_info`), for every node this gateway knows:
the nodes connected now, those it held in this run (offline, until the registry forgets
them), and, for a single gateway with an inventory, the nodes the inventory recorded
before a restart (their ``cert_valid_before`` fact). With several gateways each one
publishes the nodes it holds, so no node has two series. The family reaches the
exposition with the gateway's own, but it is about nodes (``gpurelay_node_*``): a
sharded scrape has each node's series in that node's shard
(:data:`cloud_gateway.exposition.body.NODE_PREFIX`).

A certificate without an expiry (OpenSSH's "forever") has no series and a ``null`` in the
API: an alert on ``gpurelay_node_certificate_expiry_timestamp_seconds - time()`` never
fires for it, and there is no ``+Inf`` to trip arithmetic.

As the expiry comes closer the gateway logs a WARNING naming the node and the date once
per threshold (:data:`WARN_DAYS`: 14 and 3 days) per node per certificate, and once more
when it has expired; a new certificate (another serial or expiry) starts over. The
clock is passed in: this module reads none.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Final

from asyncssh.public_key import SSHOpenSSHCertificate

from gpurelay.logs import node_logger
from gpurelay.model import Family, Sample
from gpurelay.ssh_cert import FOREVER, certificate_info

log = logging.getLogger("cloud_gateway.certificates")

WARN_DAYS: Final = (14, 3)
DAY: Final = 86400.0

CERT_EXPIRY = Family(
    name="gpurelay_node_certificate_expiry_timestamp_seconds",
    type="gauge",
    help="Unix time the node's SSH user certificate expires (its valid_before, seen at "
    "authentication); no series for a certificate without expiry.",
)

Stored = tuple[int | None, int | None]  # (valid_before or None for "forever", serial)


def expiry_of(cert: SSHOpenSSHCertificate) -> Stored:
    """(valid_before, serial) of ``cert``; valid_before None for no expiry, both None for
    a certificate whose fields cannot be read."""
    try:
        info = certificate_info(cert)
    except (ValueError, IndexError):  # struct.error is a ValueError
        return None, None
    return (None if info.valid_before >= FOREVER else info.valid_before), info.serial


@dataclass(slots=True)
class _Cert:
    expires: int | None
    serial: int | None
    live: bool  # seen on a connection in this run (else: the inventory's fact)
    warned: set[int] = field(default_factory=set)  # thresholds (days) already logged


class CertificateExpiry:
    """The known nodes' certificate expiry, refreshed on the gateway's tick."""

    def __init__(self, *, warn_days: Collection[int] = WARN_DAYS) -> None:
        self.thresholds = tuple(sorted({*warn_days, 0}, reverse=True))  # 0: expired
        self._known: dict[str, _Cert] = {}
        self._certs: dict[str, SSHOpenSSHCertificate] = {}  # the object last decoded

    def refresh(
        self,
        now: float,
        *,
        live: Mapping[str, SSHOpenSSHCertificate],
        held: Collection[str] = (),
        stored: Mapping[str, Stored] | None = None,
    ) -> None:
        """``live``: connected nodes' certificates; ``held``: nodes still in the registry
        (they keep what was seen); ``stored``: the inventory's facts of the other known
        nodes. Nodes in none of them are forgotten. Then log what is due."""
        for node, cert in live.items():
            if self._certs.get(node) is not cert:
                self._certs[node] = cert
                self._observe(node, *expiry_of(cert), live=True)
        for node, (expires, serial) in (stored or {}).items():
            known = self._known.get(node)
            if node not in live and (known is None or not known.live):  # this run's wins
                self._observe(node, expires, serial, live=False)
        for node in [n for n in self._known if n not in live and n not in held]:
            if stored is None or node not in stored:
                del self._known[node]
                self._certs.pop(node, None)
        for node, known in self._known.items():
            self._warn(node, known, now)

    def _observe(self, node: str, expires: int | None, serial: int | None, *, live: bool) -> None:
        known = self._known.get(node)
        if known is None or (known.expires, known.serial) != (expires, serial):
            self._known[node] = _Cert(expires, serial, live)

    def _warn(self, node: str, known: _Cert, now: float) -> None:
        if known.expires is None:
            return
        left = known.expires - now
        crossed = [d for d in self.thresholds if left <= d * DAY]
        if not crossed or crossed[-1] in known.warned:
            return
        known.warned.update(crossed)  # one line for a node first seen already close
        date = datetime.fromtimestamp(known.expires, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        serial = f"serial {known.serial}" if known.serial is not None else "unknown serial"
        if left <= 0:
            node_logger(log, node).warning(
                "node %s: its SSH certificate (%s) expired on %s; it cannot reconnect "
                "until it has a new one",
                node,
                serial,
                date,
            )
        else:
            node_logger(log, node).warning(
                "node %s: its SSH certificate (%s) expires on %s, in %.1f days "
                "(within %d days): renew it",
                node,
                serial,
                date,
                left / DAY,
                crossed[-1],
            )

    def of(self, node: str) -> Stored:
        """(expiry in unix seconds, serial) of the node's certificate; None for what is
        not known (and for the expiry of one that never expires)."""
        known = self._known.get(node)
        return (known.expires, known.serial) if known is not None else (None, None)

    def forget(self, nodes: Collection[str]) -> None:
        """These nodes are no longer this gateway's (another gateway holds them)."""
        for node in nodes:
            self._known.pop(node, None)
            self._certs.pop(node, None)

    def family(self, node_label: str) -> tuple[Family, list[Sample]]:
        """The gauge's samples, nodes sorted by name, named by ``node_label``."""
        samples = [
            Sample(CERT_EXPIRY.name, ((node_label, node),), float(k.expires))
            for node, k in sorted(self._known.items())
            if k.expires is not None
        ]
        return CERT_EXPIRY, samples
