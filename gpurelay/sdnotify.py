"""A tiny sd_notify: does nothing when ``NOTIFY_SOCKET`` is unset (not under systemd)."""

from __future__ import annotations

import os
import socket


def notify(state: str, environ: dict[str, str] | None = None) -> bool:
    """Send ``state`` (e.g. ``"READY=1"``, ``"WATCHDOG=1"``); True if it was sent."""
    env = os.environ if environ is None else environ
    address = env.get("NOTIFY_SOCKET", "")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(address)
            sock.sendall(state.encode())
        except OSError:
            return False
    return True
