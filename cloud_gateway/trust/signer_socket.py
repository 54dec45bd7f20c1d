"""``cloud-gateway signer``: the user CA key in a process of its own, on a Unix socket.

With ``[enroll] signer_socket`` the gateway never reads the CA key: it asks this process,
which runs as another user or on the CA's machine behind a forwarded socket. The protocol
is one JSON object a line, each way::

    -> {"node": N, "public_key": "ssh-ed25519 ...", "reason": "enroll"|"renew",
        "lifetime_seconds": L}
    <- {"certificate": "ssh-ed25519-cert-v01@openssh.com ..."}  or  {"error": "..."}

The signer checks the node name, the key and the CA directory's revocation list itself
(a compromised gateway cannot get a certificate for a revoked node), grants at most its own
``--lifetime``, logs every issuance and appends it to ``CA_DIR/issued.log``; serial
numbers come from the CA directory's counter, whoever signs. The socket is made mode 0600:
only its owner can connect; with ``--group G`` it is 0660 and group G, so the signer can
run as a user of its own (the only one that can read the CA key) and the gateway's user,
a member of G, can still ask it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import grp
import json
import logging
import os
import signal
import socket
import stat
import sys
from pathlib import Path
from typing import Any

import asyncssh

from cloud_gateway.errors import GatewayError
from cloud_gateway.trust import certs
from cloud_gateway.trust.config import DEFAULT_MIN_RSA_BITS, check_min_rsa_bits
from cloud_gateway.trust.key_policy import check_node_key
from cloud_gateway.trust.revocation import RevocationWatcher
from cloud_gateway.trust.signing import Issued, SigningRefused, parse_public_key, sign_node_key
from gpurelay import logs
from gpurelay.ssh_cert import certificate_info

log = logging.getLogger("cloud_gateway.signer")

MAX_REQUEST_BYTES = 64 * 1024
REQUEST_TIMEOUT_SECONDS = 30.0
DEFAULT_LIFETIME_SECONDS = 7 * 86400


class SignerUnavailable(GatewayError):
    """The signer process cannot be reached, or answered nonsense."""


class SignerServer:
    """Holds the user CA key of ``ca_dir`` and signs for whoever can open ``socket_path``."""

    def __init__(
        self,
        ca_dir: Path,
        socket_path: Path,
        *,
        max_lifetime_seconds: int,
        group: str | None = None,
        min_rsa_bits: int = DEFAULT_MIN_RSA_BITS,
    ) -> None:
        self.paths = certs.CaPaths(ca_dir)
        self.gid = _group_id(group) if group else None
        self.socket_path = socket_path
        self.max_lifetime = max_lifetime_seconds
        self.min_rsa_bits = min_rsa_bits
        self.ca_key = certs._load_ca(self.paths.user_ca)
        self.revocations = RevocationWatcher(self.paths.revocations)
        self._server: asyncio.AbstractServer | None = None
        self.issued = 0

    async def start(self) -> None:
        _remove_stale_socket(self.socket_path)
        old_umask = os.umask(0o177)  # the socket is 0600 from its first moment
        try:
            self._server = await asyncio.start_unix_server(
                self._serve, path=str(self.socket_path), limit=MAX_REQUEST_BYTES
            )
        finally:
            os.umask(old_umask)
        if self.gid is not None:
            os.chown(self.socket_path, -1, self.gid)
        os.chmod(self.socket_path, 0o600 if self.gid is None else 0o660)
        log.info(
            "signer for %s listening on %s (mode %s), certificates for at most %ds",
            self.paths.dir,
            self.socket_path,
            "0600" if self.gid is None else f"0660, group {self.gid}",
            self.max_lifetime,
        )

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    async with asyncio.timeout(REQUEST_TIMEOUT_SECONDS):
                        line = await reader.readline()
                except (ValueError, asyncio.LimitOverrunError):
                    await _reply(writer, {"error": "request too long"})
                    return
                if not line:
                    return
                await _reply(writer, await self.answer(line))
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def answer(self, line: bytes) -> dict[str, str]:
        try:
            request = _request(line)
        except SigningRefused as exc:
            log.warning("refused a malformed request: %s", exc)
            return {"error": exc.reason}
        node, reason = request["node"], request["reason"]
        lifetime = min(request["lifetime_seconds"], self.max_lifetime)
        try:
            key = check_node_key(request["public_key"], min_rsa_bits=self.min_rsa_bits)
            issued: Issued = await asyncio.to_thread(
                sign_node_key,
                self.paths.dir,
                node,
                key,
                lifetime_seconds=lifetime,
                reason=reason,
                ca_key=self.ca_key,
                revoked=self.revocations.current(),
            )
        except SigningRefused as exc:
            log.warning("refused to sign for node %r (%s): %s", node, reason, exc)
            return {"error": exc.reason}
        except (GatewayError, OSError) as exc:
            log.error("cannot sign for node %r (%s): %s", node, reason, exc)
            return {"error": "the signer failed (its log says why)"}
        self.issued += 1
        log.info("%s", issued.describe(reason))
        return {"certificate": issued.certificate}


def _request(line: bytes) -> dict[str, Any]:
    try:
        request = json.loads(line)
    except (UnicodeDecodeError, ValueError):
        raise SigningRefused("bad request", "not a JSON line") from None
    except RecursionError:  # '[' * 60000 fits MAX_REQUEST_BYTES
        raise SigningRefused("bad request", "JSON nested too deeply") from None
    if not isinstance(request, dict):
        raise SigningRefused("bad request", "not a JSON object")
    for name in ("node", "public_key", "reason"):
        if not isinstance(request.get(name), str):
            raise SigningRefused("bad request", f"{name} is missing or not text")
    lifetime = request.get("lifetime_seconds")
    if isinstance(lifetime, bool) or not isinstance(lifetime, int):
        raise SigningRefused("bad request", "lifetime_seconds is not an integer")
    return request


async def _reply(writer: asyncio.StreamWriter, message: dict[str, str]) -> None:
    writer.write(json.dumps(message, separators=(",", ":")).encode() + b"\n")
    await writer.drain()


def _group_id(name: str) -> int:
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise GatewayError(f"no group {name!r} (--group)") from None


def _remove_stale_socket(path: Path) -> None:
    """A socket left by a signer that died is removed; a live signer or any other file
    stops this one."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise GatewayError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        path.unlink(missing_ok=True)
        return
    finally:
        probe.close()
    raise GatewayError(f"another signer is listening on {path}")


class SocketSigner:
    """The gateway's side: one connection per request (a restarted signer just works)."""

    def __init__(self, socket_path: Path, *, timeout: float = REQUEST_TIMEOUT_SECONDS) -> None:
        self.socket_path = socket_path
        self.timeout = timeout

    async def sign(
        self, node: str, public_key: str, *, reason: str, lifetime_seconds: int
    ) -> Issued:
        key = parse_public_key(public_key)  # refuse nonsense before bothering the signer
        request = {
            "node": node,
            "public_key": public_key.strip(),
            "reason": reason,
            "lifetime_seconds": lifetime_seconds,
        }
        try:
            async with asyncio.timeout(self.timeout):
                answer = await self._ask(request)
        except (OSError, TimeoutError, ValueError) as exc:
            raise SignerUnavailable(
                f"signer socket {self.socket_path}: {getattr(exc, 'strerror', None) or exc!r}"
            ) from exc
        if isinstance(answer.get("error"), str):
            raise SigningRefused(answer["error"], f"the signer refused: {answer['error']}")
        return _issued(answer.get("certificate"), node, key, self.socket_path)

    async def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        reader, writer = await asyncio.open_unix_connection(
            str(self.socket_path), limit=MAX_REQUEST_BYTES
        )
        try:
            writer.write(json.dumps(request, separators=(",", ":")).encode() + b"\n")
            await writer.drain()
            line = await reader.readline()
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
        answer = json.loads(line) if line else None
        if not isinstance(answer, dict):
            raise ValueError("the signer closed the connection without an answer")
        return answer


def _issued(text: object, node: str, key: asyncssh.SSHKey, where: Path) -> Issued:
    """What the signer's certificate says, checked: for ``key`` and ``node`` only."""
    try:
        cert = asyncssh.import_certificate(str(text))
        info = certificate_info(cert)
    except (asyncssh.KeyImportError, ValueError, TypeError, AttributeError) as exc:
        raise SignerUnavailable(f"signer {where} answered no certificate: {exc}") from None
    if cert.key.public_data != key.public_data or info.principals != (node,):
        raise SignerUnavailable(f"signer {where} answered a certificate for another key or node")
    return Issued(
        certificate=str(text).strip(),
        serial=info.serial,
        node=node,
        valid_after=info.valid_after,
        valid_before=info.valid_before,
        key_fingerprint=info.key_fingerprint,
    )


# -- the command ---------------------------------------------------------------------------


def add_signer_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "signer",
        help="hold the user CA key and sign node certificates for the gateway (Unix socket)",
        description="Sign enrollment and renewal requests from the gateway ([enroll] "
        "signer_socket), so that the gateway never reads the CA key.",
    )
    parser.add_argument("--ca-dir", type=Path, required=True, help="CA directory (user_ca)")
    parser.add_argument("--socket", type=Path, required=True, help="Unix socket (made 0600)")
    parser.add_argument(
        "--lifetime",
        type=int,
        default=DEFAULT_LIFETIME_SECONDS,
        help=f"most seconds a certificate is valid (default {DEFAULT_LIFETIME_SECONDS})",
    )
    parser.add_argument(
        "--group", help="make the socket 0660 and this group's (the gateway's user's group)"
    )
    parser.add_argument(
        "--min-rsa-bits",
        type=int,
        default=DEFAULT_MIN_RSA_BITS,
        help="refuse RSA keys shorter than this (default 3072, at least 2048); DSA never",
    )
    parser.add_argument("--log-level", default="info", help="debug, info, warning, error")
    parser.add_argument(
        "--log-format",
        choices=logs.FORMATS,
        default="text",
        help="text (default) or json: one JSON object per line, as log_format in the configs",
    )
    return parser


def run_signer(args: argparse.Namespace) -> int:
    logs.setup(args.log_level, log_format=args.log_format)
    if args.lifetime < 60:
        print("cloud-gateway signer: error: --lifetime must be at least 60", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve_until_stopped(args))
    except GatewayError as exc:
        print(f"cloud-gateway signer: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # the socket's directory is missing or not ours
        print(f"cloud-gateway signer: error: {args.socket}: {exc.strerror}", file=sys.stderr)
        return 1
    return 0


async def _serve_until_stopped(args: argparse.Namespace) -> None:
    check_min_rsa_bits(args.min_rsa_bits, "--min-rsa-bits")
    server = SignerServer(
        args.ca_dir,
        args.socket,
        max_lifetime_seconds=args.lifetime,
        group=args.group,
        min_rsa_bits=args.min_rsa_bits,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    try:
        await stop.wait()
    finally:
        await server.close()
        log.info("signer stopped after %d certificate(s)", server.issued)
