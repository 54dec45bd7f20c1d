from __future__ import annotations

from cloud_gateway.endpoints import EndpointTable, PublishedListener


def test_own_name_sibling_names_and_conflicts() -> None:
    table = EndpointTable(is_tunnel_node=lambda name: name in {"edge-a", "edge-b"})
    conn_a, conn_b = object(), object()
    assert table.offer(via="edge-a", name="edge-a", port=9400, conn=conn_a) is None
    assert table.offer(via="edge-a", name="cam-1", port=9100, conn=conn_a) is None
    # a node with its own tunnel cannot be published by another node
    refusal = table.offer(via="edge-a", name="edge-b", port=9400, conn=conn_a)
    assert refusal is not None and "own tunnel" in refusal
    # a sibling name belongs to the first agent that claims it
    refusal = table.offer(via="edge-b", name="cam-1", port=9100, conn=conn_b)
    assert refusal == "cam-1:9100 is already published by edge-a"
    refusal = table.offer(via="edge-a", name="Bad_Name", port=1, conn=conn_a)
    assert refusal is not None and "DNS-1123" in refusal
    assert table.offer(via="edge-a", name="edge-a", port=0, conn=conn_a) is not None
    assert [e.target for e in table.published_via("edge-a")] == ["cam-1:9100", "edge-a:9400"]
    assert table.siblings == {"cam-1": "edge-a"}


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
