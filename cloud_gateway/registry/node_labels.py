"""The node's name on its series, stamped from the authenticated node (pure).

A node may publish its own series only (DESIGN.md, "Trust boundaries"), so whatever name
an agent wrote into a series is replaced by the principal of its certificate. The labels
that carry it:

* ``NodeName`` on ACK-style series (``DCGM_CUSTOM_*``), and on device series too, as
  ACK's exporter has it (ACK's prometheus-adapter rules group device series by it);
* ``Hostname`` on device series (dcgm-exporter's name up to 4.8), or ``hostname``
  (dcgm-exporter's name from its PR #655 on): which one the gateway publishes is its
  ``[registry] node_label``.

The gateway's setting wins: a series that came with the other spelling (an agent set to
``hostname`` behind a gateway set to ``Hostname``, or the reverse) gets the gateway's,
with the authenticated node as its value; the agent's spelling does not stay beside it.
A series with none of these labels gets the gateway's one. Both labels of a device
series (``NodeName`` and the host label) carry the authenticated name.
"""

from __future__ import annotations

from typing import Final

from gpurelay.model import NODE_LABEL_NAMES, Labels

ACK_NODE_LABEL: Final = "NodeName"
HOST_LABELS: Final = frozenset(NODE_LABEL_NAMES)
NODE_LABELS: Final = (ACK_NODE_LABEL, *NODE_LABEL_NAMES)  # every label stamping rewrites


def stamp_node(labels: Labels, node: str, node_label: str = "Hostname") -> Labels:
    """``labels`` with every node label set to ``node``: ``NodeName`` kept in place, a
    host label (either spelling) renamed to ``node_label``; ``node_label`` added at the
    end when the series had no node label at all."""
    out: list[tuple[str, str]] = []
    named = host = False
    for key, value in labels:
        if key == ACK_NODE_LABEL:
            out.append((key, node))
            named = True
        elif key in HOST_LABELS:
            if not host:  # both spellings sent: one label, the gateway's
                out.append((node_label, node))
            named = host = True
        else:
            out.append((key, value))
    if not named:
        out.append((node_label, node))
    return tuple(out)
