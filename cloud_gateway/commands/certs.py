"""``cloud-gateway certs ...``: the operator's side of the fleet PKI (see certs/README.md).

The gateway CLI adds this with :func:`add_certs_parser` and hands the parsed arguments to
:func:`run_certs`. Output says what was written where, with file modes and expiry; key
material is never printed. Errors are one line on stderr: exit 2 for bad input (a node
name, a file that is no key, ``--days 0``), 1 for anything else.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from cloud_gateway.errors import GatewayError, InvalidInput
from cloud_gateway.trust import certs
from cloud_gateway.trust.auth_policy import format_time
from cloud_gateway.trust.config import WEEK
from cloud_gateway.trust.signing import make_enroll_token

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


def add_certs_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add ``certs`` with its sub-commands; sets ``func=run_certs`` as the default."""
    parser = subparsers.add_parser(
        "certs",
        help="fleet PKI: CAs, node and gateway certificates, revocation",
        description="Create the fleet CAs, issue node and gateway certificates, revoke nodes.",
    )
    commands = parser.add_subparsers(dest="certs_command", metavar="COMMAND", required=True)

    init = commands.add_parser(
        "init-ca", help="create the user CA (signs agents) and host CA (signs gateways)"
    )
    init.add_argument("--dir", type=Path, required=True, help="CA directory (made mode 0700)")

    node = commands.add_parser("issue-node", help="key and user certificate for one node")
    node.add_argument("node", metavar="NODE", help="node name (a DNS-1123 label)")
    _add_issue_options(node, default_days=90, default_out="CA_DIR/nodes")

    gateway = commands.add_parser("issue-gateway", help="host key and certificate for a gateway")
    gateway.add_argument("host", metavar="HOST", help="the name agents dial")
    gateway.add_argument(
        "--name",
        dest="extra_names",
        action="append",
        default=[],
        metavar="EXTRA",
        help="another name or IP address agents may dial (repeatable)",
    )
    _add_issue_options(gateway, default_days=365, default_out="CA_DIR/gateways")

    token = commands.add_parser(
        "enroll-token", help="a one-time token a node enrolls with (edge-agent enroll)"
    )
    token.add_argument("node", metavar="NODE", help="the node it is for (a DNS-1123 label)")
    token.add_argument("--ca-dir", "--dir", dest="ca_dir", type=Path, required=True)
    token.add_argument("--ttl", type=_duration, default="24h", help="valid for (default 24h)")
    token.add_argument("--out", type=Path, help="token file (default CA_DIR/enroll/NODE.token)")
    token.add_argument("--print", dest="print_token", action="store_true", help="print it too")
    token.add_argument(
        "--gateway", default="GATEWAY:2222", metavar="HOST:PORT", help="for the printed command"
    )

    revoke = commands.add_parser("revoke", help="add a node or key to the revocation list")
    revoke.add_argument(
        "target",
        metavar="NODE|KEYFILE",
        help="node name, SHA256 fingerprint, or public key / certificate / private key file "
        "(write ./NAME for a key file named like a node)",
    )
    where = revoke.add_mutually_exclusive_group(required=True)
    where.add_argument("--ca-dir", type=Path, help="CA directory (uses CA_DIR/revocations)")
    where.add_argument("--revocation-file", type=Path, help="the revocation list to append to")

    parser.set_defaults(func=run_certs)
    return parser


def _add_issue_options(
    parser: argparse.ArgumentParser, *, default_days: int, default_out: str
) -> None:
    parser.add_argument("--ca-dir", type=Path, required=True, help="CA directory")
    parser.add_argument(
        "--out", type=Path, default=None, help=f"output directory (default {default_out})"
    )
    parser.add_argument(
        "--days", type=int, default=default_days, help=f"validity (default {default_days})"
    )


def run_certs(args: argparse.Namespace) -> int:
    """Run the ``certs`` sub-command in ``args``; print the outcome; return the exit code."""
    command: str = args.certs_command
    handler = _HANDLERS[command]
    try:
        lines = handler(args)
    except InvalidInput as exc:
        return _fail(command, str(exc), EXIT_BAD_INPUT)
    except GatewayError as exc:
        return _fail(command, str(exc), EXIT_FAILED)
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        return _fail(command, f"{where}{exc.strerror or exc}", EXIT_FAILED)
    for line in lines:
        print(line)
    return EXIT_OK


def _fail(command: str, message: str, code: int) -> int:
    one_line = " ".join(message.split())
    print(f"cloud-gateway certs {command}: error: {one_line}", file=sys.stderr)
    return code


def _init_ca(args: argparse.Namespace) -> list[str]:
    paths = certs.init_ca(args.dir)
    return [
        f"created the fleet CAs in {paths.dir} (mode {_mode(paths.dir)})",
        *_files(
            (paths.user_ca, "user CA private key: signs node certificates; keep it secret"),
            (paths.user_ca_pub, "user CA public key: the gateway trusts this (user_ca)"),
            (paths.host_ca, "host CA private key: signs gateway certificates; keep it secret"),
            (paths.host_ca_pub, "host CA public key"),
            (paths.known_hosts, "for agents: trust every gateway the host CA signed"),
            (paths.revocations, "revocation list; the gateway re-reads it on change"),
        ),
        f"next: cloud-gateway certs issue-node NODE --ca-dir {paths.dir}",
    ]


def _issue_node(args: argparse.Namespace) -> list[str]:
    issued = certs.issue_node(args.ca_dir, args.node, out_dir=args.out, days=args.days)
    known_hosts = certs.CaPaths(args.ca_dir).known_hosts
    if issued.private_key is None:
        note = "copy the certificate to the node, next to the key it was made for"
    else:
        note = "copy these files to that node only; the agent's [gateway] key is the first"
    return _issued("node", issued, args.days, f"{note}; its known_hosts is {known_hosts}")


def _issue_gateway(args: argparse.Namespace) -> list[str]:
    issued = certs.issue_gateway(
        args.ca_dir, args.host, extra_names=args.extra_names, out_dir=args.out, days=args.days
    )
    note = "the private key is the gateway's host_key; the certificate beside it is found"
    return _issued("gateway", issued, args.days, f"{note} as <host_key>-cert.pub")


def _issued(role: str, issued: certs.Credentials, days: int, note: str) -> list[str]:
    key_note = "new private key" if issued.new_key else "existing private key (not changed)"
    entries: list[tuple[Path, str]] = []
    if issued.private_key is not None:
        entries.append((issued.private_key, key_note))
    entries.append((issued.public_key, f"public key {issued.key_fingerprint}"))
    principals = ", ".join(issued.principals)
    entries.append((issued.certificate, f"certificate for {principals}"))
    expires = format_time(issued.expires.timestamp())
    return [
        f"issued {role} certificate {issued.key_id!r}: serial {issued.serial}, "
        f"valid until {expires} ({days} days)",
        *_files(*entries),
        note,
    ]


def _duration(text: str) -> int:
    """``24h``, ``30m``, ``7d``, ``90s`` or plain seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    number, unit = (text[:-1], text[-1]) if text[-1:] in units else (text, "s")
    if not number.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 24h, 30m, 7d")
    return int(number) * units[unit]


def _human(seconds: int) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _enroll_token(args: argparse.Namespace) -> list[str]:
    paths = certs.CaPaths(args.ca_dir)
    text, exp = make_enroll_token(args.ca_dir, args.node, ttl_seconds=args.ttl)
    out: Path = args.out or args.ca_dir / "enroll" / f"{args.node}.token"
    if out.exists() or out.is_symlink():
        raise InvalidInput(
            f"{out} exists (an earlier token: it stays valid until it expires or is used); "
            "remove it, or pass --out"
        )
    out.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    certs._write_new(out, f"{text}\n".encode(), 0o600)
    host_ca = certs._read_public(paths.host_ca_pub).get_fingerprint("sha256")
    lines = [
        f"made a one-time enrollment token for node {args.node}, valid until "
        f"{format_time(exp)} ({_human(args.ttl)}), single use",
        *_files((out, "the token: a password for that node only; copy it there")),
        f"host CA fingerprint: {host_ca} (the agent accepts gateways signed by it only)",
        "on the node, run:",
        f"  edge-agent enroll --gateway {args.gateway} --token-file {out.name} "
        f"--host-ca-fingerprint {host_ca} --node-name {args.node}",
    ]
    if args.ttl > WEEK:
        lines.append(
            "note: gateways refuse tokens valid for longer than [enroll] "
            f"token_max_ttl_seconds (default {WEEK}s, 7 days)"
        )
    return [*lines, f"token: {text}"] if args.print_token else lines


def _revoke(args: argparse.Namespace) -> list[str]:
    where: Path = args.ca_dir if args.ca_dir is not None else args.revocation_file
    done = certs.revoke(where, args.target)
    if not done.added:
        return [f"already revoked: {done.rule} in {done.file} (nothing changed)"]
    return [
        f"revoked {done.source}",
        f"added '{done.rule}' to {done.file} (mode {_mode(done.file)})",
        f"a gateway applies it within seconds, no restart needed, only if its "
        f"[ssh] revocation_file is {done.file.resolve()} (a gateway without one logs a "
        "WARNING at start and revokes nothing)",
    ]


def _files(*entries: tuple[Path, str]) -> list[str]:
    width = max(len(str(path)) for path, _ in entries)
    return [f"  {path!s:<{width}}  {_mode(path)}  {what}" for path, what in entries]


def _mode(path: Path) -> str:
    return f"{os.stat(path).st_mode & 0o777:04o}"


_HANDLERS: dict[str, Callable[[argparse.Namespace], Sequence[str]]] = {
    "init-ca": _init_ca,
    "issue-node": _issue_node,
    "issue-gateway": _issue_gateway,
    "revoke": _revoke,
    "enroll-token": _enroll_token,
}
