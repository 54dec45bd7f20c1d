"""What the SSH server asks before it takes a node, and tells when the node leaves: the
node directory (:mod:`cloud_gateway.cluster.link`), when the gateway has one."""

from __future__ import annotations

from typing import Protocol

from asyncssh.public_key import SSHOpenSSHCertificate

from gpurelay.wire import Hello


class AdmissionRefused(Exception):
    """The node cannot be taken now (the message is for the agent and the log)."""


class Admission(Protocol):
    """Where nodes are recorded as they come and go (cloud_gateway.cluster.link)."""

    async def admit(
        self, node: str, hello: Hello, remote: str, cert: SSHOpenSSHCertificate | None
    ) -> int:
        """Record the node as connected here; its claim's epoch, or AdmissionRefused."""
        ...

    def departed(self, node: str, epoch: int, reason: str) -> None: ...
