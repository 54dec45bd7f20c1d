"""The registry's reading side: what the exposition, remote write, the API and the page
ask of it. A base of :class:`cloud_gateway.registry.store.Registry`, which changes the records;
kept apart so that each module reads as one job. Pure, like the registry."""

from __future__ import annotations

from cloud_gateway.registry.records import FamilyState, Group, NodeRecord
from cloud_gateway.registry.types import (
    LineFormat,
    Liveness,
    NodeState,
    NodeView,
    StoreConfig,
)
from gpurelay.model import Family, Labels


class RegistryReads:
    config: StoreConfig
    lines: LineFormat
    blocks_rendered: int
    _nodes: dict[str, NodeRecord]
    _names: list[str]
    _families: dict[str, FamilyState]
    _family_order: list[FamilyState] | None

    def samples(self, node: str) -> list[tuple[Labels, float]]:
        """The full current state of a node's live series: ``(labels, value)`` with the
        labels as remote write wants them, ``(("__name__", name), *stamped labels)``."""
        n = self._nodes.get(node)
        if n is None:
            return []
        lines = self.lines
        return [
            (s.labels or s.read_labels(n, lines), value)
            for g in n.groups.values()
            for s, value in zip(g.members, g.values, strict=True)
        ]

    def node(self, name: str, *, now: float) -> NodeView | None:
        n = self._nodes.get(name)
        return None if n is None else self._view(n, now)

    def nodes(self, now: float, state: NodeState | None = None) -> list[NodeView]:
        views = [self._view(self._nodes[name], now) for name in self._names]
        return [v for v in views if state is None or v.state == state]

    def last_batches(self) -> list[tuple[str, float | None]]:
        """(node, time of its last live batch) for every node, by name: what the UI's
        history samples each tick, without a view of every node."""
        nodes = self._nodes
        return [(name, nodes[name].last_batch_time) for name in self._names]

    def published_states(self) -> dict[str, NodeState]:
        """Every node's state as last published: after ``refresh(now)`` (the tick), the
        same as ``states(now)`` without working each one out again."""
        nodes = self._nodes
        return {name: nodes[name].state for name in self._names}

    def states(self, now: float) -> dict[str, NodeState]:
        return {name: self._state(self._nodes[name], now) for name in self._names}

    def liveness(self) -> list[Liveness]:
        """Per node, sorted by name: its published state, the last time it was heard
        from, and how long it may go without a batch before it is stale."""
        out = []
        for name in self._names:
            n = self._nodes[name]
            arrivals = n.arrivals
            late = None if arrivals is None else arrivals.late_after(self.config.liveness)
            out.append(Liveness(n.name, n.state, n.last_seen, late))
        return out

    def silent_after(self, node: str) -> float | None:
        """Seconds without any data after which the node's connection should be closed
        (``None``: not connected)."""
        n = self._nodes.get(node)
        arrivals = n.arrivals if n is not None and n.connected else None
        return None if arrivals is None else arrivals.silent_after(self.config.liveness)

    def latest(self, node: str, family: str) -> list[tuple[Labels, float]]:
        """Labels and value of a node's live series of a tracked family (config)."""
        n = self._nodes.get(node)
        if n is None:
            return []
        return [
            ((s.labels or s.read_labels(n, self.lines))[1:], g.values[s.pos])
            for s in n.tracked
            if (g := s.group) is not None and s.fs.family.name == family
        ]

    def family_groups(self) -> list[tuple[Family, list[Group]]]:
        """:meth:`family_states` with the families only."""
        return [(fs.family, groups) for fs, groups in self.family_states()]

    def family_states(self) -> list[tuple[FamilyState, list[Group]]]:
        """Families sorted by name, each with its (family, node) blocks in node order. A
        block's ``version`` changes with its text, a family's with any of its blocks;
        :meth:`render` makes a block's text (the caller keeps it)."""
        if self._family_order is None:
            self._family_order = [self._families[k] for k in sorted(self._families)]
        out = []
        for fs in self._family_order:
            if fs.ordered is None:
                fs.ordered = [fs.groups[k] for k in sorted(fs.groups)]
            if fs.ordered:
                out.append((fs, fs.ordered))
        return out

    def render(self, group: Group) -> bytes:
        """One block's lines (a ``%`` of its template over its values)."""
        self.blocks_rendered += 1
        return group.render(self.lines)

    def family_blocks(self) -> list[tuple[Family, list[bytes]]]:
        """:meth:`family_groups` with every block rendered (tests, benches)."""
        return [(fam, [self.render(g) for g in groups]) for fam, groups in self.family_groups()]

    def _state(self, n: NodeRecord, now: float) -> NodeState:
        if not n.connected or n.arrivals is None:
            return "offline"
        return "stale" if n.arrivals.is_late(self.config.liveness, now) else "online"

    def _view(self, n: NodeRecord, now: float) -> NodeView:
        return n.view(self._state(n, now))
