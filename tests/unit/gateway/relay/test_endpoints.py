from __future__ import annotations

from cloud_gateway.relay.endpoints import EndpointTable, PublishedListener
from cloud_gateway.ssh.config import parse_sibling_rules


def test_own_name_sibling_names_and_conflicts() -> None:
    table = EndpointTable(
        is_tunnel_node=lambda name: name in {"edge-a", "edge-b"},
        siblings={"edge-a": ("cam-*",), "edge-b": ("cam-1",)},
    )
    conn_a, conn_b = object(), object()
    assert table.offer(via="edge-a", name="edge-a", port=9400, conn=conn_a) is None
    assert table.offer(via="edge-a", name="cam-1", port=9100, conn=conn_a) is None
    # a node with its own tunnel cannot be published by another node
    refusal = table.offer(via="edge-a", name="edge-b", port=9400, conn=conn_a)
    assert refusal is not None and "own tunnel" in refusal
    # two nodes allowed the same sibling: it stays with the one that has it
    refusal = table.offer(via="edge-b", name="cam-1", port=9100, conn=conn_b)
    assert refusal == "cam-1:9100 is already published by edge-a"
    refusal = table.offer(via="edge-a", name="Bad_Name", port=1, conn=conn_a)
    assert refusal is not None and "DNS-1123" in refusal
    assert table.offer(via="edge-a", name="edge-a", port=0, conn=conn_a) is not None
    assert [e.target for e in table.published_via("edge-a")] == ["cam-1:9100", "edge-a:9400"]
    assert table.siblings == {"cam-1": "edge-a"}


def test_a_sibling_name_needs_the_operators_rule() -> None:
    """Names belong to nodes: no first-come claims (issue 12)."""
    table = EndpointTable(siblings={"edge-gw": ("cam-*",)})
    refusal = table.offer(via="evil", name="victim-late", port=9400, conn=object())
    assert refusal is not None and 'siblings rule, e.g. "evil=victim-late"' in refusal
    assert table.offer(via="edge-gw", name="plc-1", port=502, conn=object()) is not None
    assert table.offer(via="edge-gw", name="cam-9", port=80, conn=object()) is None


def test_a_node_takes_its_own_name_back() -> None:
    """A node allowed a broad pattern claimed victim-late:9400 before victim-late ever
    connected; when it does, the name is its own."""
    table = EndpointTable(siblings={"evil": ("*",)})
    thief, owner = object(), object()
    assert table.offer(via="evil", name="victim-late", port=9400, conn=thief) is None
    assert table.offer(via="victim-late", name="victim-late", port=9400, conn=owner) is None
    entry = table.lookup("victim-late", 9400)
    assert entry is not None and entry.via == "victim-late" and "victim-late" not in table.siblings
    PublishedListener(table, "victim-late", 9400, thief).close()  # the thief leaving: no effect
    assert table.lookup("victim-late", 9400) is entry


def test_endpoints_and_remembered_sibling_names_per_node_are_capped() -> None:
    """One node published 2,000 ports and 2,000 sibling names (issue 12)."""
    table = EndpointTable(siblings={"edge-gw": ("*",)}, max_endpoints_per_node=3)
    conn = object()
    for port in (1, 2, 3):
        assert table.offer(via="edge-gw", name=f"s{port}", port=port, conn=conn) is None
    refusal = table.offer(via="edge-gw", name="s4", port=4, conn=conn)
    assert refusal is not None and "the limit" in refusal
    assert table.offer(via="edge-gw", name="s1", port=1, conn=conn) is None  # a re-offer fits
    live = {port: f"s{port}" for port in (1, 2, 3)}
    for i in range(2000):  # churn through names: withdraw one, publish a new name
        port = 1 + i % 3
        PublishedListener(table, live[port], port, conn).close()
        live[port] = f"n{i}"
        assert table.offer(via="edge-gw", name=live[port], port=port, conn=conn) is None
    assert table.count() == 3 and len(table.siblings) <= 3 + 3


def test_sibling_rules_are_parsed_with_clear_errors() -> None:
    assert parse_sibling_rules(["edge-gw-1=cam-*, plc-2", "edge-gw-1=x"]) == {
        "edge-gw-1": ("cam-*", "plc-2", "x")
    }
    for bad in ("edge-gw-1", "=cam-1", "Edge_GW=cam", "edge-gw-1="):
        try:
            parse_sibling_rules([bad])
        except ValueError as exc:
            assert bad in str(exc)
        else:
            raise AssertionError(f"{bad!r} was accepted")


def test_listener_close_withdraws_only_its_own_entry() -> None:
    table = EndpointTable()
    old, new = object(), object()
    table.offer(via="edge-a", name="edge-a", port=9400, conn=old)
    stale = PublishedListener(table, "edge-a", 9400, old)
    table.offer(via="edge-a", name="edge-a", port=9400, conn=new)  # reconnect: newer wins
    stale.close()  # the old connection going away must not remove the new entry
    entry = table.lookup("edge-a", 9400)
    assert entry is not None and entry.conn is new
    PublishedListener(table, "edge-a", 9400, new).close()
    assert table.lookup("edge-a", 9400) is None and table.count() == 0
