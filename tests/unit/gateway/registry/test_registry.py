"""The node registry: stamping, connections, duplicates, states, expiry (no I/O, time injected)."""

from __future__ import annotations

import pytest

from cloud_gateway.registry.config import LivenessPolicy
from cloud_gateway.registry.store import (
    Connected,
    Registry,
    StaleConnection,
    StoreConfig,
    stamp_node,
)
from gpurelay.families import known
from gpurelay.model import GpuInventory, Labels, MetricType
from gpurelay.wire import Batch, Declare, Hello, Limits, SeriesDecl, WireError, check_series

T0 = 1_790_000_000.0

GPU = GpuInventory(
    index=0,
    uuid="GPU-0",
    name="NVIDIA H100 80GB HBM3",
    pci_bus_id="00000000:1B:00.0",
    minor=0,
    memory_total_bytes=80 * 1024**3,
    memory_used_bytes=1024**3,
)


def hello(node: str, interval: float = 10.0) -> Hello:
    return Hello(agent_version="0.1.0", node=node, interval_seconds=interval, gpus=(GPU,))


def decl(sid: int, name: str, labels: Labels, type_: MetricType = "gauge") -> SeriesDecl:
    return SeriesDecl(id=sid, name=name, type=type_, help=f"help of {name}", labels=labels)


def device_series(claimed_host: str) -> Declare:
    """What an agent declares: a device series, an ACK series and an unlabelled one."""
    return Declare(
        series=(
            decl(0, "DCGM_FI_DEV_GPU_UTIL", (("gpu", "0"), ("Hostname", claimed_host))),
            decl(1, "DCGM_CUSTOM_PROCESS_SM_UTIL", (("NodeName", claimed_host), ("PodName", "p"))),
            decl(2, "gpurelay_agent_collections_total", (), "counter"),
        )
    )


def batch(seq: int, *values: tuple[int, float], full: bool = False) -> Batch:
    return Batch(seq=seq, timestamp=T0, values=values, full=full)


def online(reg: Registry, node: str, now: float = T0) -> Connected:
    conn = reg.connect(node, remote="10.0.0.1:50000", hello=hello(node), now=now)
    assert reg.declare(node, conn.conn_id, device_series(node)).rejected == ()
    reg.apply(node, conn.conn_id, batch(1, (0, 50.0), (1, 7.0), (2, 3.0)), now=now, size_bytes=100)
    return conn


def lines(reg: Registry) -> list[str]:
    return [
        line
        for _, blocks in reg.family_blocks()
        for b in blocks
        for line in b.decode().splitlines()
    ]


def test_stamp_node_sets_the_authenticated_name() -> None:
    assert stamp_node((("gpu", "0"), ("Hostname", "x")), "n") == (("gpu", "0"), ("Hostname", "n"))
    assert stamp_node((("NodeName", "x"), ("Hostname", "y")), "n") == (
        ("NodeName", "n"),
        ("Hostname", "n"),
    )
    assert stamp_node((("gpu", "0"),), "n") == (("gpu", "0"), ("Hostname", "n"))


def test_agent_claiming_another_node_is_stamped_with_its_own() -> None:
    reg = Registry()
    conn = reg.connect("edge-a", remote="r", hello=hello("victim"), now=T0)
    reg.declare("edge-a", conn.conn_id, device_series("victim"))
    reg.apply("edge-a", conn.conn_id, batch(1, (0, 50.0), (1, 7.0), (2, 3.0)), now=T0, size_bytes=1)
    assert sorted(lines(reg)) == [
        'DCGM_CUSTOM_PROCESS_SM_UTIL{NodeName="edge-a",PodName="p"} 7',
        'DCGM_FI_DEV_GPU_UTIL{gpu="0",Hostname="edge-a"} 50',
        'gpurelay_agent_collections_total{Hostname="edge-a"} 3',
    ]
    assert "victim" not in "".join(lines(reg))


def test_newer_connection_wins_and_the_old_one_is_ignored() -> None:
    reg = Registry()
    first = online(reg, "n")
    second = reg.connect("n", remote="10.0.0.2:1", hello=hello("n"), now=T0 + 5)
    assert second.replaced == first.conn_id and second.conn_id != first.conn_id
    with pytest.raises(StaleConnection):
        reg.apply("n", first.conn_id, batch(2, (0, 1.0)), now=T0 + 6, size_bytes=1)
    reg.disconnect("n", first.conn_id, now=T0 + 6, reason="replaced")  # late close of the old one
    view = reg.node("n", now=T0 + 6)
    assert view is not None and view.state == "online" and view.remote == "10.0.0.2:1"
    assert reg.liveness()[0].up
    reg.disconnect("n", second.conn_id, now=T0 + 7, reason="eof")
    view = reg.node("n", now=T0 + 7)
    assert view is not None and view.state == "offline" and view.last_disconnect_reason == "eof"


def test_duplicate_batches_never_overwrite_newer_values_even_after_reconnect() -> None:
    """Delivery decides what is a duplicate (tests/unit/gateway/ingest/test_delivery.py);
    the registry, told so, fills only series without a value and counts it."""
    reg = Registry()
    conn = online(reg, "n")
    assert not reg.apply("n", conn.conn_id, batch(5, (0, 60.0)), now=T0, size_bytes=1).duplicate
    dup = reg.apply("n", conn.conn_id, batch(1, (0, 99.0)), now=T0, size_bytes=1, duplicate=True)
    assert dup.duplicate and dup.seq == 1
    again = reg.connect("n", remote="r", hello=hello("n"), now=T0 + 1)
    new = decl(9, "DCGM_FI_DEV_GPU_TEMP", (("gpu", "0"),))
    reg.declare("n", again.conn_id, Declare(series=(*device_series("n").series, new)))
    replay = batch(5, (0, 99.0), (9, 41.0))
    assert reg.apply("n", again.conn_id, replay, now=T0 + 1, size_bytes=1, duplicate=True).duplicate
    # the duplicate fills a series that never had a value, and overwrites nothing
    assert 'DCGM_FI_DEV_GPU_UTIL{gpu="0",Hostname="n"} 60' in lines(reg)
    assert 'DCGM_FI_DEV_GPU_TEMP{gpu="0",Hostname="n"} 41' in lines(reg)
    view = reg.node("n", now=T0 + 1)
    assert view is not None and view.duplicates == 2 and view.batches_received == 4


def test_a_batch_not_delivered_yet_is_applied_whatever_its_seq() -> None:
    """The registry keeps no high-water mark: a live batch with a lower seq than one
    applied before is applied (duplicates are delivery's call, per seq)."""
    reg = Registry()
    conn = online(reg, "n")
    reg.apply("n", conn.conn_id, batch(7, (0, 11.0)), now=T0, size_bytes=1)
    applied = reg.apply("n", conn.conn_id, batch(3, (0, 12.0)), now=T0, size_bytes=1)
    assert not applied.duplicate and applied.changed == 1
    assert 'DCGM_FI_DEV_GPU_UTIL{gpu="0",Hostname="n"} 12' in lines(reg)


def test_replays_never_change_the_exposed_values() -> None:
    reg = Registry()
    conn = online(reg, "n")
    before = lines(reg)
    first = reg.replay("n", conn.conn_id, 0, now=T0 + 5, size_bytes=300)
    assert not first.duplicate and first.seq == 0
    assert reg.replay("n", conn.conn_id, 0, now=T0 + 6, size_bytes=300, duplicate=True).duplicate
    assert reg.replay("n", conn.conn_id, 2, now=T0 + 6, size_bytes=1, duplicate=True).duplicate
    assert lines(reg) == before
    view = reg.node("n", now=T0 + 6)
    assert view is not None
    assert (view.replays_received, view.batches_received, view.duplicates) == (3, 1, 2)
    assert view.bytes_received == 100 + 601 and view.last_seen == T0 + 6
    assert view.last_batch_time == T0  # replays are old collections, not fresh data
    other = reg.connect("n", remote="r", hello=hello("n"), now=T0 + 7)
    with pytest.raises(StaleConnection):
        reg.replay("n", conn.conn_id, 3, now=T0 + 7, size_bytes=1)
    assert other.replaced == conn.conn_id


def test_samples_are_the_full_state_with_remote_write_labels() -> None:
    reg = Registry()
    conn = online(reg, "n")
    reg.apply("n", conn.conn_id, batch(2, (0, 51.0)), now=T0, size_bytes=1)  # one changed
    assert sorted(reg.samples("n")) == [
        ((("__name__", "DCGM_CUSTOM_PROCESS_SM_UTIL"), ("NodeName", "n"), ("PodName", "p")), 7.0),
        ((("__name__", "DCGM_FI_DEV_GPU_UTIL"), ("gpu", "0"), ("Hostname", "n")), 51.0),
        ((("__name__", "gpurelay_agent_collections_total"), ("Hostname", "n")), 3.0),
    ]
    reg.apply("n", conn.conn_id, Batch(seq=3, timestamp=T0, values=(), removed=(1,)), now=T0,
              size_bytes=1)  # fmt: skip
    assert [labels[0][1] for labels, _ in sorted(reg.samples("n"))] == [
        "DCGM_FI_DEV_GPU_UTIL",
        "gpurelay_agent_collections_total",
    ]
    assert reg.samples("unknown") == []


def test_refuses_what_a_declaration_may_not_carry() -> None:
    reg = Registry()
    assert reg.refuses("DCGM_FI_DEV_GPU_UTIL") is None

    def reason(name: str, labels: Labels = ()) -> str:
        refusal = reg.refuses(name, labels)
        return "" if refusal is None else f"{refusal.code}: {refusal.message}"

    assert reason("gpurelay_gateway_x").startswith("reserved_name")
    assert reason("gpurelay_node_up").startswith("reserved_name")
    assert reason("up").startswith("reserved_name")
    assert reason("x", (("job", "other"),)).startswith("reserved_label")


@pytest.mark.parametrize(
    ("name", "labels", "code"),
    [
        ("bad-name", (), "bad_name"),
        ("x", (("__name__", "y"),), "bad_label"),
        ("x", (("a", "1"), ("a", "2")), "bad_label"),
    ],
)
def test_the_naming_rules_are_the_wire_rules(name: str, labels: Labels, code: str) -> None:
    """Names and labels are checked once, by gpurelay.wire.rules, before the registry
    sees a series (the decoder for DECLARE, the record codec for REPLAY)."""
    with pytest.raises(WireError) as err:
        check_series(decl(0, name, labels), Limits())
    assert err.value.code == code


def test_states_follow_the_agent_interval_plus_a_margin() -> None:
    reg = Registry(StoreConfig(liveness=LivenessPolicy(margin_seconds=2)))
    conn = reg.connect("n", remote="r", hello=hello("n", interval=10), now=T0)
    assert reg.states(T0 + 31.9) == {"n": "online"}  # no batch yet: counted from the connect
    assert reg.states(T0 + 32.1) == {"n": "stale"}
    reg.declare("n", conn.conn_id, device_series("n"))
    reg.apply("n", conn.conn_id, batch(1, (0, 1.0)), now=T0 + 40, size_bytes=1)
    # that batch came 30 s late: the margin is now 2 x 30 s
    assert reg.liveness()[0].late_after == 30 + 60
    assert reg.states(T0 + 40 + 89) == {"n": "online"}
    assert reg.states(T0 + 40 + 91) == {"n": "stale"}
    assert [v.name for v in reg.nodes(T0 + 131, state="stale")] == ["n"]
    reg.disconnect("n", conn.conn_id, now=T0 + 132, reason="silent")
    assert reg.states(T0 + 132) == {"n": "offline"}
    assert reg.liveness()[0].state == "offline" and not reg.liveness()[0].up


def test_refresh_publishes_what_time_changed_and_a_batch_makes_a_late_node_online() -> None:
    reg = Registry(StoreConfig(liveness=LivenessPolicy(margin_seconds=2)))
    conn = reg.connect("n", remote="r", hello=hello("n", interval=1), now=T0)
    reg.declare("n", conn.conn_id, device_series("n"))
    assert reg.refresh(T0 + 4.9) == [] and reg.liveness()[0].up
    generation = reg.generation
    assert reg.refresh(T0 + 5.1) == [("n", "stale")]
    assert reg.generation > generation  # node_up is re-rendered
    live = reg.liveness()[0]
    assert (live.state, live.up) == ("stale", False)
    assert reg.refresh(T0 + 6) == []  # published once
    reg.apply("n", conn.conn_id, batch(1, (0, 1.0)), now=T0 + 7, size_bytes=1)
    assert reg.liveness()[0].state == "online"  # at once, not at the next tick


def test_a_lossy_link_earns_a_wider_margin_and_a_regular_one_gets_it_back() -> None:
    """Issue 13, row 6: on a link losing 20 % of its packets TCP delivers some batches
    seconds late; after one such batch the node must not turn stale on the next one."""
    reg = Registry(StoreConfig(liveness=LivenessPolicy(margin_seconds=2)))
    conn = reg.connect("n", remote="r", hello=hello("n", interval=1), now=T0)
    reg.declare("n", conn.conn_id, device_series("n"))
    t, seq = T0, 0
    for gap in (1.0, 1.2, 0.8, 2.6, 0.4, 1.0):  # one batch 1.6 s late, retransmitted
        t, seq = t + gap, seq + 1
        reg.apply("n", conn.conn_id, batch(seq, (0, float(seq))), now=t, size_bytes=1)
    assert reg.liveness()[0].late_after == pytest.approx(3 + 2 * 1.6 * 0.98**2)
    assert reg.states(t + 3.5) == {"n": "online"}  # the 3.5 s gap of the issue
    assert reg.refresh(t + 3.5) == []
    for _ in range(200):  # a regular link again: the margin decays back to its floor
        t, seq = t + 1.0, seq + 1
        reg.apply("n", conn.conn_id, batch(seq, (0, float(seq))), now=t, size_bytes=1)
    assert reg.liveness()[0].late_after == pytest.approx(3 + 2)
    assert reg.silent_after("n") == pytest.approx(6 + 2)
    reg.disconnect("n", conn.conn_id, now=t, reason="x")
    assert reg.silent_after("n") is None and reg.liveness()[0].late_after is None


def test_liveness_policy_refuses_thresholds_that_make_no_sense() -> None:
    with pytest.raises(ValueError, match="offline_after_intervals"):
        LivenessPolicy(stale_after_intervals=3, offline_after_intervals=3)
    with pytest.raises(ValueError, match="margin"):
        LivenessPolicy(margin_seconds=-1)


def test_expire_drops_series_after_the_grace_but_keeps_the_node() -> None:
    reg = Registry(StoreConfig(offline_grace=300))
    conn = online(reg, "n")
    reg.disconnect("n", conn.conn_id, now=T0 + 10, reason="eof")
    assert reg.expire(T0 + 300) == [] and len(lines(reg)) == 3
    assert reg.expire(T0 + 311) == ["n"]
    assert lines(reg) == [] and reg.family_blocks() == []
    view = reg.node("n", now=T0 + 311)
    assert view is not None and view.series_count == 0 and view.state == "offline"
    assert reg.liveness()[0] == ("n", "offline", T0, None)


def test_reconnect_keeps_values_until_a_full_batch_drops_the_unlisted() -> None:
    reg = Registry()
    online(reg, "n")
    conn = reg.connect("n", remote="r", hello=hello("n"), now=T0 + 1)
    # ids are per connection: the same series may come back under other ids
    reg.declare(
        "n", conn.conn_id, Declare(series=(decl(7, "DCGM_FI_DEV_GPU_UTIL", (("gpu", "0"),)),))
    )
    assert len(lines(reg)) == 3  # nothing vanished while the agent re-declared
    reg.apply("n", conn.conn_id, batch(2, (7, 51.0), full=True), now=T0 + 1, size_bytes=1)
    assert lines(reg) == ['DCGM_FI_DEV_GPU_UTIL{gpu="0",Hostname="n"} 51']


def test_removed_series_leave_their_block() -> None:
    reg = Registry()
    conn = online(reg, "n")
    res = reg.apply(
        "n", conn.conn_id, Batch(seq=2, timestamp=T0, values=(), removed=(1,)), now=T0, size_bytes=1
    )
    assert res.removed == 1
    assert not any(line.startswith("DCGM_CUSTOM") for line in lines(reg))


def test_removing_from_the_middle_of_a_block_keeps_the_others_in_place() -> None:
    reg = Registry()
    conn = reg.connect("n", remote="r", hello=hello("n"), now=T0)
    series = tuple(decl(i, "DCGM_FI_DEV_GPU_UTIL", (("gpu", str(i)),)) for i in range(4))
    reg.declare("n", conn.conn_id, Declare(series=series))
    reg.apply("n", conn.conn_id, batch(1, *((i, float(i)) for i in range(4))), now=T0, size_bytes=1)
    gone = Batch(seq=2, timestamp=T0, values=((3, 30.0),), removed=(1,))
    reg.apply("n", conn.conn_id, gone, now=T0, size_bytes=1)
    reg.apply("n", conn.conn_id, batch(3, (2, 20.0)), now=T0, size_bytes=1)
    assert lines(reg) == [
        'DCGM_FI_DEV_GPU_UTIL{gpu="0",Hostname="n"} 0',
        'DCGM_FI_DEV_GPU_UTIL{gpu="2",Hostname="n"} 20',
        'DCGM_FI_DEV_GPU_UTIL{gpu="3",Hostname="n"} 30',
    ]


def test_declare_rejects_with_clear_reasons() -> None:
    reg = Registry(StoreConfig(max_series_per_node=5))
    online(reg, "a")
    conn = reg.connect("b", remote="r", hello=hello("b"), now=T0)
    res = reg.declare(
        "b",
        conn.conn_id,
        Declare(
            series=(
                decl(0, "DCGM_FI_DEV_GPU_UTIL", (), "counter"),  # a gauge on node a
                decl(2, "gpurelay_node_up", ()),
                decl(5, "ok", ()),
                decl(5, "ok2", ()),
                decl(6, "ok", (("Hostname", "other"),)),  # the same series after stamping
            )
        ),
    )
    reasons = {r.id: r.reason for r in res.rejected}
    assert res.accepted == 1 and set(reasons) == {0, 2, 5, 6}
    assert "DCGM_FI_DEV_GPU_UTIL is a gauge in the fleet's catalogue" in reasons[0]
    assert "reserved" in reasons[2] and "already declared" in reasons[5]
    assert "same name and labels" in reasons[6]
    # values for refused ids are dropped quietly; ids never declared are counted
    applied = reg.apply(
        "b", conn.conn_id, batch(1, (0, 1.0), (5, 2.0), (99, 3.0)), now=T0, size_bytes=1
    )
    assert applied.changed == 1 and applied.unknown == 1
    more = reg.declare(
        "b", conn.conn_id, Declare(series=tuple(decl(10 + i, f"m{i}", ()) for i in range(5)))
    )
    assert more.accepted == 4 and "limit" in more.rejected[0].reason


def test_a_catalogued_family_is_served_with_the_catalogues_help() -> None:
    """Whatever the first node (or any) words: the catalogue's HELP (issue 24, W09)."""
    reg = Registry()
    online(reg, "a")  # help "help of DCGM_FI_DEV_GPU_UTIL"
    conn = reg.connect("b", remote="r", hello=hello("b"), now=T0)
    reworded = SeriesDecl(
        id=0, name="DCGM_FI_DEV_GPU_UTIL", type="gauge", help="new words", labels=()
    )
    assert reg.declare("b", conn.conn_id, Declare(series=(reworded,))).rejected == ()
    reg.apply("b", conn.conn_id, batch(1, (0, 5.0)), now=T0, size_bytes=1)
    family, blocks = next(fb for fb in reg.family_blocks() if fb[0].name == "DCGM_FI_DEV_GPU_UTIL")
    catalogued = known("DCGM_FI_DEV_GPU_UTIL")
    assert catalogued is not None and family == catalogued and len(blocks) == 2


def test_family_is_forgotten_when_its_last_series_goes() -> None:
    reg = Registry(StoreConfig(offline_grace=0))
    conn = reg.connect("a", remote="r", hello=hello("a"), now=T0)
    reg.declare("a", conn.conn_id, Declare(series=(decl(0, "site_util", (), "gauge"),)))
    reg.disconnect("a", conn.conn_id, now=T0, reason="eof")
    reg.expire(T0 + 1)
    b = reg.connect("b", remote="r", hello=hello("b"), now=T0 + 1)
    res = reg.declare("b", b.conn_id, Declare(series=(decl(0, "site_util", (), "counter"),)))
    assert res.rejected == ()


def test_recent_errors_are_bounded_and_latest_tracks_fb_values() -> None:
    reg = Registry(StoreConfig(recent_errors=3))
    for i in range(5):
        reg.record_error("n", f"error {i}", T0 + i)
    view = reg.node("n", now=T0)
    assert view is not None and [e.message for e in view.recent_errors] == [
        "error 2",
        "error 3",
        "error 4",
    ]
    conn = reg.connect("n", remote="r", hello=hello("n"), now=T0)
    reg.declare(
        "n", conn.conn_id, Declare(series=(decl(0, "DCGM_FI_DEV_FB_USED", (("UUID", "GPU-0"),)),))
    )
    assert reg.latest("n", "DCGM_FI_DEV_FB_USED") == []  # no value yet
    reg.apply("n", conn.conn_id, batch(1, (0, 1024.0)), now=T0, size_bytes=1)
    assert reg.latest("n", "DCGM_FI_DEV_FB_USED") == [
        ((("UUID", "GPU-0"), ("Hostname", "n")), 1024.0)
    ]


def test_last_batches_are_the_views_last_batch_times_without_the_views() -> None:
    reg = Registry()
    online(reg, "b", now=T0 + 5)
    online(reg, "a", now=T0 + 7)
    reg.connect("c", remote="r", hello=hello("c"), now=T0)  # no batch yet
    expected = [(v.name, v.last_batch_time) for v in reg.nodes(T0 + 10)]
    assert reg.last_batches() == expected == [("a", T0 + 7), ("b", T0 + 5), ("c", None)]


def test_after_a_refresh_the_published_states_are_the_states_of_that_moment() -> None:
    reg = Registry(StoreConfig(liveness=LivenessPolicy(margin_seconds=2)))
    online(reg, "a", now=T0)
    b = online(reg, "b", now=T0)
    reg.connect("c", remote="r", hello=hello("c"), now=T0)
    reg.disconnect("b", b.conn_id, now=T0 + 1, reason="silent")
    for now in (T0 + 1, T0 + 31, T0 + 40):
        reg.refresh(now)
        assert reg.published_states() == reg.states(now)
    assert reg.published_states() == {"a": "stale", "b": "offline", "c": "stale"}
