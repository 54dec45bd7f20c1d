"""``[cluster]``: where the node directory lives, and how gateways that share one find
each other.

One gateway (``database = ""``, the default) keeps its inventory in an SQLite file:
``directory``, or ``$STATE_DIRECTORY/nodes.db`` under systemd's ``StateDirectory=`` (the
shipped unit sets it), else nowhere (the inventory lives as long as the process, as it
always did; the gateway says so at start). Several gateways share a PostgreSQL database
(``database``, a DSN; ``CLOUD_GATEWAY_CLUSTER_DATABASE`` keeps its password out of the
file) and reach each other's peer listeners at their ``advertise`` addresses."""

from __future__ import annotations

import socket
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from cloud_gateway.errors import GatewayConfigError
from gpurelay.settings import SettingsError, split_host_port

GATEWAY_ID_BYTES = 128


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    database: str = ""  # postgresql://user@host:5432/db; "": one gateway, no database
    directory: str = ""  # the single gateway's SQLite file ("": see the module docstring)
    gateway_id: str = ""  # "": this machine's hostname
    peer_listen: str = ""  # host:port of the peer listener ("": none; required with database)
    advertise: str = ""  # host:port peers dial ("": peer_listen)
    peer_token_file: str = ""  # a shared secret that peers present to each other
    # TLS on the peer hop (all three, or none): this gateway's certificate and key for its
    # peer listener, and the CA its peers' certificates are checked against (the name
    # checked is the host of each peer's advertise address). Without it the token and the
    # scrapes cross the network in clear: keep the peer network private then.
    peer_tls_cert_file: str = ""
    peer_tls_key_file: str = ""
    peer_tls_ca_file: str = ""
    heartbeat_seconds: float = 2.0
    ttl_seconds: float = 10.0  # a gateway silent for this long is gone; its nodes are free
    forget_gateways_after_seconds: float = 86400.0  # the leader deletes members this silent

    @property
    def clustered(self) -> bool:
        return bool(self.database)

    def resolved_gateway_id(self) -> str:
        return self.gateway_id or socket.gethostname()

    def sqlite_path(self, environ: Mapping[str, str]) -> Path | None:
        """The single gateway's inventory file, or None (kept in memory only)."""
        if self.directory:
            return Path(self.directory)
        state = environ.get("STATE_DIRECTORY", "").split(":")[0]
        return Path(state) / "nodes.db" if state else None

    def peer_token(self) -> str:
        try:
            token = Path(self.peer_token_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise GatewayConfigError(
                f"cluster.peer_token_file {self.peer_token_file} cannot be read: {exc.strerror}"
            ) from exc
        if len(token) < 16:
            raise GatewayConfigError(
                f"cluster.peer_token_file {self.peer_token_file} holds a token shorter than "
                "16 characters"
            )
        return token


def peer_tls(section: ClusterConfig) -> tuple[ssl.SSLContext, ssl.SSLContext] | None:
    """The peer hop's TLS: (the listener's context, the client's), or None without it."""
    keys = ("peer_tls_cert_file", "peer_tls_key_file", "peer_tls_ca_file")
    given = [k for k in keys if getattr(section, k)]
    if not given:
        return None
    if len(given) != len(keys):
        missing = ", ".join(f"cluster.{k}" for k in keys if k not in given)
        raise GatewayConfigError(f"TLS on the peer hop needs all three keys; missing {missing}")
    try:
        server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        server.minimum_version = ssl.TLSVersion.TLSv1_2
        server.load_cert_chain(section.peer_tls_cert_file, section.peer_tls_key_file)
        client = ssl.create_default_context(cafile=section.peer_tls_ca_file)
        client.minimum_version = ssl.TLSVersion.TLSv1_2
    except (OSError, ssl.SSLError) as exc:
        raise GatewayConfigError(
            f"cluster.peer_tls_*: {section.peer_tls_cert_file}, {section.peer_tls_key_file} "
            f"or {section.peer_tls_ca_file} cannot be used: {exc}"
        ) from exc
    return server, client


def check_cluster(section: ClusterConfig) -> None:
    """Errors name the key; called at load, so a bad section stops the gateway at start."""
    gid = section.resolved_gateway_id()
    if not gid or len(gid.encode()) > GATEWAY_ID_BYTES or not gid.isprintable() or " " in gid:
        raise GatewayConfigError(
            f"cluster.gateway_id must be 1-{GATEWAY_ID_BYTES} bytes of printable text without "
            f"spaces, not {gid!r}"
        )
    if not section.heartbeat_seconds > 0:
        raise GatewayConfigError("cluster.heartbeat_seconds must be > 0")
    if not section.ttl_seconds >= 2 * section.heartbeat_seconds:
        raise GatewayConfigError(
            "cluster.ttl_seconds must be at least twice cluster.heartbeat_seconds "
            f"({section.ttl_seconds:g} < 2 x {section.heartbeat_seconds:g})"
        )
    if not section.forget_gateways_after_seconds > section.ttl_seconds:
        raise GatewayConfigError(
            "cluster.forget_gateways_after_seconds must be more than cluster.ttl_seconds "
            f"({section.forget_gateways_after_seconds:g} <= {section.ttl_seconds:g})"
        )
    try:
        for key in ("peer_listen", "advertise"):
            value = getattr(section, key)
            if value:
                split_host_port(value, f"cluster.{key}")
    except SettingsError as exc:
        raise GatewayConfigError(str(exc)) from exc
    if not section.clustered:
        return
    if section.directory:
        raise GatewayConfigError(
            "cluster.directory (an SQLite file) and cluster.database (PostgreSQL) exclude each "
            "other: several gateways share the database"
        )
    if not section.database.startswith(("postgresql://", "postgres://")):
        raise GatewayConfigError(
            "cluster.database must be a PostgreSQL URL (postgresql://user@host:5432/db)"
        )
    if not section.peer_listen:
        raise GatewayConfigError(
            "cluster.peer_listen is required with cluster.database: gateways proxy scrapes of "
            "the nodes they do not own through each other's peer listeners"
        )
    host = split_host_port(section.advertise or section.peer_listen, "cluster.advertise")[0]
    if host in ("0.0.0.0", "::", "", "*"):
        raise GatewayConfigError(
            f"cluster.advertise is required when cluster.peer_listen ({section.peer_listen}) is "
            "a wildcard: peers need an address they can dial"
        )
    if not section.peer_token_file:
        raise GatewayConfigError(
            "cluster.peer_token_file is required with cluster.database (peers authenticate "
            "each other with it)"
        )
    section.peer_token()
    peer_tls(section)
