"""What the tunnel (:mod:`edge_agent.tunnel`) offers and how its attempts and sessions
end: the published endpoint, the errors, and reading the node's credentials."""

from __future__ import annotations

from dataclasses import dataclass

import asyncssh

from edge_agent.config import TunnelConfig
from edge_agent.credentials import load_pair
from edge_agent.errors import AgentError
from gpurelay.compat import TIMEOUTS
from gpurelay.wire import WireError


@dataclass(frozen=True, slots=True)
class PublishedEndpoint:
    """An endpoint offered to the gateway: NODE:PORT -> host:target_port on the edge."""

    name: str
    node: str
    port: int
    host: str
    target_port: int


class TunnelError(AgentError):
    """The session with the gateway failed; the tunnel reconnects after a backoff."""


class SessionEnded(Exception):  # not an error: what became of a session
    """A session that the gateway had acknowledged data on ended, cleanly or not (a reset,
    a crashed gateway, a dead link): the next connection starts a *new* backoff sequence,
    after the short jittered pause, instead of counting as one more failure of the last
    outage (issue 13: agents waited up to 60 s after a gateway's kill -9)."""


# A failed attempt: try again. TIMEOUTS: on Python 3.10 a timeout is asyncio.TimeoutError,
# not an OSError as on 3.11; one that escaped a call would otherwise end the tunnel.
RETRIED = (TunnelError, OSError, asyncssh.Error, WireError, *TIMEOUTS)


class Unanswered(TunnelError):
    """Nobody answered the TCP handshake: a silent path, retried after a short pause."""


class Refused(TunnelError):
    """The gateway's address answered the TCP handshake with a reset: nothing listens
    there (a gateway restarting after a crash, stopped, or not started yet). Nothing
    reached a gateway, so the backoff does not grow: retried after a pause as long as the
    one after a session ended (up to 10 x ``backoff_initial_seconds``), which spreads a
    fleet whose gateway is coming back over as many seconds instead of letting it grow
    apart for a minute and return in one burst (issue 26: 654 refused dials grew the
    fleet's backoff; every agent was back 88 s after a gateway's ``kill -9``)."""


class GatewaySilent(TunnelError):
    """The gateway sent nothing (no ACK, no HEARTBEAT) for the silence timeout."""


class GatewayRefused(TunnelError):
    """The gateway sent an ERROR frame: it will not take this agent's data as sent."""


def load_client_key(cfg: TunnelConfig) -> tuple[asyncssh.SSHKey, asyncssh.SSHCertificate]:
    """Read the node key and certificate, with errors that name the file. Called at start
    and again before every connection: a renewed certificate (edge_agent.renew) or one an
    operator replaced is used from the next connection on."""
    assert cfg.key is not None
    cert_path = cfg.certificate_path
    assert cert_path is not None
    return load_pair(cfg.key, cert_path)


def load_known_hosts(cfg: TunnelConfig) -> asyncssh.SSHKnownHosts:
    assert cfg.known_hosts is not None
    try:
        return asyncssh.read_known_hosts(str(cfg.known_hosts))
    except (OSError, ValueError) as exc:
        raise AgentError(f"gateway known_hosts {cfg.known_hosts} cannot be used: {exc}") from exc
