"""Node names: DNS-1123 labels, as Kubernetes names nodes. One rule for every place a
name arrives (a login, a certificate principal, the revocation list, a sibling rule)."""

from __future__ import annotations

import re

MAX_NODE_NAME = 63

_NODE_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_NODE_CHAR = re.compile(r"[-a-z0-9]")


def node_name_problem(name: str) -> str | None:
    """Why ``name`` is not a DNS-1123 label (Kubernetes node-name rules), or None if it is."""
    if _NODE_NAME.fullmatch(name) and len(name) <= MAX_NODE_NAME:
        return None
    if not name:
        return "it is empty"
    if len(name) > MAX_NODE_NAME:
        return f"it has {len(name)} characters, at most {MAX_NODE_NAME} are allowed"
    bad = sorted({c for c in name if not _NODE_CHAR.fullmatch(c)})
    if bad:
        found = ", ".join(repr(c) for c in bad)
        return f"only lowercase letters a-z, digits 0-9 and '-' are allowed (found {found})"
    return "it must start and end with a lowercase letter or a digit"
