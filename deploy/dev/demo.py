"""`make demo`: a gateway and one agent on loopback, with development certificates.

Writes (once) a development fleet PKI under certs/dev/ (git-ignored): CAs, a gateway host
certificate for localhost/127.0.0.1, a node certificate, and an operator token. Starts
`cloud-gateway run` and `edge-agent run` (real NVML when this box has a GPU, otherwise
simulated GPUs with the banner), prints what to try, and stops both on Ctrl-C.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from cloud_gateway.trust import certs

ROOT = Path(__file__).resolve().parents[2]
DEV = ROOT / "certs" / "dev"
BIN = Path(sys.executable).parent
NODE = os.environ.get("DEMO_NODE", "edge-demo-1")
SSH_PORT = int(os.environ.get("DEMO_SSH_PORT", "2222"))
HTTP_PORT = int(os.environ.get("DEMO_HTTP_PORT", "9410"))
AGENT_PORT = int(os.environ.get("DEMO_AGENT_PORT", "9400"))


def ensure_pki() -> certs.CaPaths:
    ca = certs.CaPaths(DEV / "ca")
    if not ca.user_ca.exists():
        DEV.mkdir(parents=True, exist_ok=True)
        certs.init_ca(ca.dir)
    if not (ca.dir / "gateways" / "localhost-cert.pub").exists():
        certs.issue_gateway(ca.dir, "localhost", extra_names=["127.0.0.1"])
    if not (ca.dir / "nodes" / f"{NODE}-cert.pub").exists():
        certs.issue_node(ca.dir, NODE)
    token = DEV / "operator.token"
    if not token.exists():
        fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
    return ca


def write_configs(ca: certs.CaPaths) -> tuple[Path, Path]:
    gateway = DEV / "gateway.toml"
    gateway.write_text(
        f"""# written by make demo
[ssh]
listen = "127.0.0.1:{SSH_PORT}"
host_key = "{ca.dir / "gateways" / "localhost"}"
user_ca = "{ca.user_ca_pub}"
revocation_file = "{ca.revocations}"

[http]
listen = "127.0.0.1:{HTTP_PORT}"
token_files = ["{DEV / "operator.token"}"]
"""
    )
    agent = DEV / "agent.toml"
    agent.write_text(
        f"""# written by make demo
node_name = "{NODE}"
listen = "127.0.0.1:{AGENT_PORT}"
interval_seconds = 5
process_interval_seconds = 5

[gateway]
address = "127.0.0.1:{SSH_PORT}"
known_hosts = "{ca.known_hosts}"
key = "{ca.dir / "nodes" / NODE}"

[spool]
directory = "{DEV / "spool"}"
"""
    )
    return gateway, agent


def has_gpu() -> bool:
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def port_free(port: int) -> bool:
    """Whether our servers can listen on 127.0.0.1:``port``. They bind with SO_REUSEADDR
    (asyncio, aiohttp and asyncssh do), so the check does too: without it, the last demo's
    connections still in TIME_WAIT (a minute after it stopped) made a free port "taken"."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def wait_ready(url: str, proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"demo: {what} exited with code {proc.returncode}; see its log above")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    sys.exit(f"demo: {what} did not become ready at {url}")


SIMULATED_PROFILE = "h100-sxm"  # without a GPU (edge_agent/sim/profiles.py)


def main() -> int:
    for port in (SSH_PORT, HTTP_PORT, AGENT_PORT):
        if not port_free(port):
            sys.exit(f"demo: port {port} on 127.0.0.1 is taken (DEMO_*_PORT variables move it)")
    ca = ensure_pki()
    gateway_cfg, agent_cfg = write_configs(ca)
    agent_args = [str(BIN / "edge-agent"), "run", "--config", str(agent_cfg)]
    gpus = "this box's GPUs, through NVML"
    if not has_gpu():
        agent_args += ["--simulate", f"{SIMULATED_PROFILE}:2", "--simulate-mig"]
        gpus = (
            f"SIMULATED: 2 GPUs of machine profile {SIMULATED_PROFILE}, MIG on GPU 0 "
            "(3g.40gb, 2g.20gb, 1g.10gb); other machines: edge-agent --simulate PROFILE, "
            "docs/simulator.md"
        )
    gateway = subprocess.Popen([str(BIN / "cloud-gateway"), "run", "--config", str(gateway_cfg)])
    procs = [gateway]
    try:
        wait_ready(f"http://127.0.0.1:{HTTP_PORT}/readyz", gateway, "the gateway")
        agent = subprocess.Popen(agent_args)
        procs.append(agent)
        wait_ready(f"http://127.0.0.1:{AGENT_PORT}/healthz", agent, "the agent")
        token = DEV / "operator.token"
        print(
            f"""
=== edge-gpu-relay demo: gateway and agent {NODE!r} on loopback ===
GPUs:                          {gpus}
gateway /metrics (all nodes):  curl -s http://127.0.0.1:{HTTP_PORT}/metrics | grep 'Hostname="{NODE}"' | head
BIE map of all nodes:          curl -s http://127.0.0.1:{HTTP_PORT}/v1/collect
operator API:                  curl -s -H "Authorization: Bearer $(cat {token})" http://127.0.0.1:{HTTP_PORT}/api/v1/nodes
nodes table:                   .venv/bin/cloud-gateway nodes --gateway http://127.0.0.1:{HTTP_PORT} --token-file {token}
operator page (browser):       http://127.0.0.1:{HTTP_PORT}/ui  (any user name, the token in {token} as password)
the agent itself:              curl -s http://127.0.0.1:{AGENT_PORT}/metrics | head
dev certificates and configs:  {DEV}  (git-ignored)
Ctrl-C stops both.
""",
            flush=True,
        )
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
        print("demo: a process exited; stopping the other", flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        print("demo: stopped", flush=True)
    return 0


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _terminate)
    sys.exit(main())
