"""Whose TYPE a family has in the fleet, and who pays when nodes disagree (issue 24, W09).

One ``/metrics`` has one TYPE and HELP per family. Before, the first node to declare a
family fixed both for everyone: a node that declared ``DCGM_FI_PROF_SM_ACTIVE`` a counter
got every other node's gauge refused. Now:

- a name in the fleet's catalogue (:mod:`gpurelay.families`: the DCGM fields, the ACK
  ``DCGM_CUSTOM_*`` names, the agent's ``gpurelay_*``) has the catalogue's TYPE and HELP;
  a series declaring another TYPE is refused for its node alone, and the HELP a node
  words differently is simply not served (nobody is told: it is not theirs to choose);
- a name outside it (an agent newer than the gateway, a user's own exporter) takes the
  TYPE of the first node to declare it, until nodes declaring the other TYPE outnumber
  the nodes holding it: then the holders' series of that family are dropped (the
  registry tells their nodes why) and the family is declared afresh. One node alone can
  therefore hold a name only until two others disagree with it.

Pure, like the registry that calls it: it decides, the registry does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from cloud_gateway.registry import series_policy as policy
from gpurelay.families import known
from gpurelay.model import Family
from gpurelay.wire import SeriesDecl

if TYPE_CHECKING:
    from cloud_gateway.registry.records import FamilyState


class Retype:
    """The verdict that the family's holders are outnumbered: drop their series of it."""


RETYPE: Final = Retype()


def family_of(sd: SeriesDecl) -> Family:
    """The family a first declaration makes: the catalogue's, else the node's words."""
    return known(sd.name) or Family(name=sd.name, type=sd.type, help=sd.help)


def judge(fs: FamilyState | None, sd: SeriesDecl, node: str) -> policy.Refusal | Retype | None:
    """``None``: the series fits the family (or makes it); a refusal for this node; or
    :data:`RETYPE` when this node's disagreement is now the majority's."""
    fixed = known(sd.name)
    if fixed is not None:
        if fixed.type == sd.type:
            return None
        return policy.Refusal(
            policy.TYPE_CONFLICT,
            f"family {sd.name} is a {fixed.type} in the fleet's catalogue (as dcgm-exporter "
            f"and the agent publish it); this series declares it a {sd.type}",
        )
    if fs is None or fs.family.type == sd.type:
        return None
    against = fs.challengers.setdefault(sd.type, set())
    against.add(node)
    if len(against) > len(fs.holders):
        return RETYPE
    return policy.Refusal(
        policy.TYPE_CONFLICT,
        f"family {sd.name} is a {fs.family.type} ({len(fs.holders)} node(s) hold it, the "
        f"first {fs.first_node!r}); this series declares it a {sd.type} (with "
        f"{len(against)} node(s): more nodes than hold it make it a {sd.type})",
    )


def lost_message(family: Family, new_type: str, nodes: int) -> str:
    """What a node whose series of ``family`` were dropped by a retype is told."""
    return (
        f"family {family.name} is a {new_type} now ({nodes} node(s) declared it so, more "
        f"than held it a {family.type}): this node's series of it are dropped; declare it "
        f"a {new_type} (reconnect) to publish it again"
    )
