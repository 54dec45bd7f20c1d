"""haproxy (Debian) in TCP mode in front of several gateways' SSH listeners, as operators
run it: least-connections balancing, health checks every second, and servers declared up
front so that one can be added at run time through the admin socket (a gateway joining)
without reloading.

    lb = Haproxy(tmp, backends=[("gw-a", port_a), ("gw-b", port_b)], spare=["gw-d"])
    lb.start()                          # lb.port: where agents dial
    lb.add("gw-d", port_d)              # a fourth gateway joins
"""

from __future__ import annotations

import shutil
import socket
import time
from collections.abc import Sequence
from pathlib import Path

from harness.ports import free_ports
from harness.process import HarnessError, Process

READY_TIMEOUT = 15.0


def find_haproxy() -> Path | None:
    found = shutil.which("haproxy") or (
        "/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").exists() else None
    )
    return Path(found) if found else None


class Haproxy(Process):
    def __init__(
        self,
        tmp: Path,
        backends: Sequence[tuple[str, int]],
        *,
        spare: Sequence[str] = (),
        binary: Path | None = None,
        redispatch: bool = False,
    ) -> None:
        """``redispatch``: a connection a server refuses is retried on another one and that
        server is marked down at once (retries 2, option redispatch 1, observe layer4);
        off (haproxy's defaults, as deploy/haproxy/haproxy.cfg), a dead gateway gets new
        agents until its health check has failed twice."""
        binary = binary or find_haproxy()
        if binary is None:
            raise HarnessError("haproxy not found (Debian package `haproxy`)")
        self.port = free_ports(1)[0]
        self.admin = tmp / "haproxy.sock"
        self.config = tmp / "haproxy.cfg"
        observe = " observe layer4 error-limit 1 on-error mark-down" if redispatch else ""
        servers = [
            f"    server {name} 127.0.0.1:{port} check inter 1s fall 2 rise 1{observe}"
            for name, port in backends
        ]
        # a spare starts in maintenance at a placeholder address; add() points it at a
        # gateway and makes it ready
        servers += [
            f"    server {name} 127.0.0.1:1 check inter 1s disabled{observe}" for name in spare
        ]
        self.config.write_text(
            "\n".join(
                [
                    "global",
                    f"    stats socket {self.admin} mode 600 level admin",
                    "    maxconn 4000",  # needs about 2 fds each: within a 20,000 fd limit
                    "defaults",
                    "    mode tcp",
                    "    timeout connect 2s",
                    "    timeout client 1h",
                    "    timeout server 1h",
                    *(["    retries 2", "    option redispatch 1"] if redispatch else []),
                    "frontend gateways_ssh",
                    f"    bind 127.0.0.1:{self.port}",
                    "    default_backend gateways",
                    "backend gateways",
                    "    balance leastconn",
                    *servers,
                    "",
                ]
            )
        )
        super().__init__(
            "haproxy", [str(binary), "-db", "-f", str(self.config)], tmp / "haproxy.log"
        )

    def start(self) -> None:
        super().start()
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            self.check_alive()
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                if self.admin.exists():
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise HarnessError(
                    f"haproxy did not listen within {READY_TIMEOUT:g}s\n{self.tail()}"
                )
            time.sleep(0.05)

    def command(self, line: str) -> str:
        """One admin socket command; its answer."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(str(self.admin))
            s.sendall(line.encode() + b"\n")
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode(errors="replace")

    def add(self, name: str, port: int) -> None:
        """Point the spare server ``name`` at a gateway on ``port`` and make it ready."""
        for line in (
            f"set server gateways/{name} addr 127.0.0.1 port {port}",
            f"set server gateways/{name} state ready",
        ):
            answer = self.command(line).strip()
            if answer and "changed" not in answer.lower():
                raise HarnessError(f"haproxy refused {line!r}: {answer}")

    def sessions(self) -> dict[str, int]:
        """Current connections through each server of the backend."""
        out: dict[str, int] = {}
        lines = self.command("show stat").splitlines()
        header = lines[0].lstrip("# ").split(",")
        for line in lines[1:]:
            row = dict(zip(header, line.split(","), strict=False))
            if row.get("pxname") == "gateways" and row.get("svname") not in ("BACKEND", None):
                out[row["svname"]] = int(row.get("scur") or 0)
        return out
