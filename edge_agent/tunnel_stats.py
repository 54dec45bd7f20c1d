"""The tunnel's own series (``gpurelay_agent_gateway_*``) and the counts behind them."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpurelay.model import Family

TUNNEL_FAMILIES = (
    Family(
        name="gpurelay_agent_gateway_connected",
        type="gauge",
        help="1 while the telemetry channel to the gateway is open.",
    ),
    Family(
        name="gpurelay_agent_gateway_address",
        type="gauge",
        help="1 for the gateway address (HOST:PORT) the telemetry channel is open to, "
        "0 for the other configured addresses.",
    ),
    Family(
        name="gpurelay_agent_gateway_connects_total",
        type="counter",
        help="Telemetry channels opened to the gateway.",
    ),
    Family(
        name="gpurelay_agent_gateway_failures_total",
        type="counter",
        help="Failed or refused gateway sessions, by reason.",
    ),
    Family(
        name="gpurelay_agent_gateway_sent_batches_total",
        type="counter",
        help="Value batches written to the gateway.",
    ),
    Family(
        name="gpurelay_agent_gateway_sent_bytes_total",
        type="counter",
        help="Bytes written into the telemetry channel (after compression).",
    ),
    Family(
        name="gpurelay_agent_gateway_acked_seq",
        type="gauge",
        help="Highest batch sequence number the gateway acknowledged.",
    ),
    Family(
        name="gpurelay_agent_proxy_refused_total",
        type="counter",
        help="Connections from the gateway to endpoints that are not published, refused.",
    ),
    Family(
        name="gpurelay_agent_replayed_batches_total",
        type="counter",
        help="Spooled batches sent again (REPLAY frames) after a reconnect or a lost ACK.",
    ),
    Family(
        name="gpurelay_agent_gateway_in_flight_batches",
        type="gauge",
        help="Batches sent on the current connection and not yet acknowledged.",
    ),
)


@dataclass
class TunnelStats:
    connected: bool = False
    connects: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    frames_sent: int = 0
    bytes_sent: int = 0
    batches_sent: int = 0
    acked_seq: int = 0
    proxy_refused: int = 0
    last_error: str = ""
    connected_since: float = 0.0
    address: str = ""  # HOST:PORT of the gateway of the open (or last) channel

    def fail(self, reason: str, message: str) -> None:
        self.failures[reason] = self.failures.get(reason, 0) + 1
        self.last_error = message
