"""edge-gpu-relay shared core: what the edge agent and the cloud gateway both speak.

The wire protocol (:mod:`gpurelay.wire`), the spool record codec (:mod:`gpurelay.record`),
the data model, Prometheus text rendering, the BIE format, settings loading, logging,
sd_notify, version helpers, and the private asyncssh hooks both ends need
(:mod:`gpurelay.asyncssh_hooks`, checked against the installed asyncssh at import).

``edge_agent`` and ``cloud_gateway`` import this package and never each other
(``tests/test_layering.py`` enforces it); this package imports neither of them.
"""

from __future__ import annotations
