"""The node directory: what the gateway knows about every node it has ever accepted, kept
outside the process so that it survives a restart (and, with PostgreSQL, is shared by
several gateways).

Pure types and the interface; the stores are :mod:`cloud_gateway.cluster.store_sqlite` (the
embedded default, one file) and, for several gateways, a PostgreSQL one. The registry
keeps the live state (connections, series, liveness); the directory keeps the inventory:

- a node's facts from its last HELLO and certificate (agent version, hostname, GPUs,
  certificate serial and expiry), its first and last time seen, why it last disconnected;
- its owner (the gateway id) and an epoch that grows with every claim, so that of two
  gateways that both think they own a node, the one with the lower epoch knows it lost.

Last-seen times are written in batches (:meth:`Directory.seen`), never per telemetry
batch: the directory's load follows connects and the flush period, not the data rate."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Protocol

from gpurelay.model import GpuInventory
from gpurelay.wire import Hello

SCHEMA_VERSION = 1


class DirectoryError(Exception):
    """The directory cannot be read or written (a damaged or foreign file, a full disk, an
    unreachable database); the message says which and where."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeFacts:
    """What a node said about itself in HELLO, and what its certificate said."""

    agent_version: str = ""
    hostname: str = ""
    domain: str = ""
    backend: str = ""
    driver_version: str = ""
    interval_seconds: float = 0.0
    gpus: tuple[GpuInventory, ...] = ()
    cert_serial: int | None = None
    cert_valid_before: int | None = None  # unix seconds; None: no expiry, or not known
    remote: str = ""  # the address it connected from

    @classmethod
    def from_hello(
        cls,
        hello: Hello,
        *,
        cert_serial: int | None,
        remote: str,
        cert_valid_before: int | None = None,
    ) -> NodeFacts:
        return cls(
            agent_version=hello.agent_version,
            hostname=hello.hostname,
            domain=hello.domain,
            backend=hello.backend,
            driver_version=hello.driver_version,
            interval_seconds=hello.interval_seconds,
            gpus=hello.gpus,
            cert_serial=cert_serial,
            cert_valid_before=cert_valid_before,
            remote=remote,
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> NodeFacts:
        """Facts written by this or an older gateway; keys it does not know are ignored
        (written by a newer one), wrong types are a DirectoryError."""
        try:
            raw = json.loads(text)
            if not isinstance(raw, dict):
                raise TypeError("not an object")
            known = {k: v for k, v in raw.items() if k in _FACT_FIELDS}
            gpus = tuple(
                GpuInventory(**{k: v for k, v in g.items() if k in _GPU_FIELDS})
                for g in known.pop("gpus", ())
            )
            facts = cls(gpus=gpus, **known)
            _check_types(facts)
        except (ValueError, TypeError, AttributeError) as exc:
            raise DirectoryError(f"a node's stored facts are unreadable: {exc}") from None
        return facts


_FACT_FIELDS = frozenset(NodeFacts.__dataclass_fields__)
_GPU_FIELDS = frozenset(GpuInventory.__dataclass_fields__)


def _check_types(facts: NodeFacts) -> None:
    for name in ("agent_version", "hostname", "domain", "backend", "driver_version", "remote"):
        if not isinstance(getattr(facts, name), str):
            raise TypeError(f"{name} is not text")
    if not isinstance(facts.interval_seconds, int | float):
        raise TypeError("interval_seconds is not a number")
    for name in ("cert_serial", "cert_valid_before"):
        value = getattr(facts, name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise TypeError(f"{name} is not an integer")


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeEntry:
    """One node in the directory."""

    node: str
    gateway: str  # the id of the gateway that claimed it last
    epoch: int  # grows by one with every claim
    first_seen: float  # unix seconds
    last_seen: float
    facts: NodeFacts
    connected: bool  # claimed and not released since
    last_disconnect_reason: str = ""
    # NAME:PORT endpoints the node publishes through its tunnel (its own exporter, its
    # siblings'), as its owner last wrote them: /api/v1/sd on every gateway lists them
    published: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Claim:
    epoch: int
    previous_gateway: str | None  # another gateway that owned it (None: new, or this one)


class Directory(Protocol):
    """Where node entries live. Every method may raise DirectoryError."""

    async def open(self) -> Sequence[NodeEntry]:
        """Create or migrate the schema; every entry (the inventory after a restart)."""
        ...

    async def claim(self, node: str, facts: NodeFacts, *, now: float) -> Claim:
        """This gateway owns ``node`` from now on (epoch + 1)."""
        ...

    async def seen(self, last_seen: Mapping[str, float]) -> None:
        """Last-seen times of nodes this gateway owns, many at once."""
        ...

    async def release(self, node: str, epoch: int, *, reason: str, now: float) -> bool:
        """The node's connection ended; False when another claim came since (a newer
        epoch: the entry is left to its new owner)."""
        ...

    async def entries(self) -> Sequence[NodeEntry]: ...

    async def enrollment_nonce_used(self, nonce: str) -> bool:
        """Whether an enrollment token with this nonce was used already (on any gateway)."""
        ...

    async def use_enrollment_nonce(self, nonce: str, node: str, exp: int, *, now: float) -> bool:
        """Record the nonce of a token being used, atomically: False when it was already
        (a second use, or a lost race). Rows of tokens expired for a day are dropped."""
        ...

    async def close(self) -> None: ...
