"""A hostile node with a valid certificate (issue 12): what it sends is refused or bounded,
and other nodes never notice. In-process (registry, ingest, record codec); the SSH-level
attacks are in tests/integration/test_hostile_node_ssh.py."""

from __future__ import annotations

import gc
import json
import logging
import struct
import tracemalloc
import zlib

import pytest

from cloud_gateway.ingest.session import Ingest
from cloud_gateway.registry.store import Registry, StoreConfig
from gpurelay import logs
from gpurelay import record as record_codec
from gpurelay.families import known
from gpurelay.model import GpuInventory, Labels, MetricType
from gpurelay.record import MAGIC, RecordDecoder
from gpurelay.wire import Batch, Declare, FrameDecoder, Hello, Limits, Replay, SeriesDecl, WireError
from gpurelay.wire.payloads import dump_json, hello_json
from gpurelay.wire.session import ConnectionState

T0 = 1_790_000_000.0


def decl(sid: int, name: str, labels: Labels = (), type_: MetricType = "gauge") -> SeriesDecl:
    return SeriesDecl(id=sid, name=name, type=type_, help="h", labels=labels)


def connected(reg: Registry, node: str) -> int:
    return reg.connect(
        node, remote="10.0.0.9:1", hello=Hello(agent_version="0", node=node), now=T0
    ).conn_id


def lines(reg: Registry) -> list[str]:
    return [line for _, bs in reg.family_blocks() for b in bs for line in b.decode().splitlines()]


def test_labels_in_another_order_are_the_same_series() -> None:
    reg = Registry()
    conn = connected(reg, "evil")
    res = reg.declare(
        "evil",
        conn,
        Declare(
            series=(decl(0, "m", (("a", "1"), ("b", "2"))), decl(1, "m", (("b", "2"), ("a", "1"))))
        ),
    )
    assert [r.code for r in res.rejected] == ["same_series"]
    reg.apply(
        "evil", conn, Batch(seq=1, timestamp=T0, values=((0, 1.0), (1, 2.0))), now=T0, size_bytes=1
    )
    assert len([line for line in lines(reg) if line.startswith("m{")]) == 1


def test_a_node_cannot_set_target_labels_or_prometheus_names() -> None:
    reg = Registry()
    conn = connected(reg, "evil")
    res = reg.declare(
        "evil",
        conn,
        Declare(
            series=(
                decl(0, "m", (("job", "gpu"),)),
                decl(1, "m", (("instance", "victim:9400"),)),
                decl(2, "up"),
                decl(3, "scrape_duration_seconds"),
            )
        ),
    )
    assert sorted(r.code for r in res.rejected) == ["reserved_label"] * 2 + ["reserved_name"] * 2


def test_a_family_may_not_collide_with_another_in_openmetrics() -> None:
    """A counter X_total is the OpenMetrics family X: a gauge X beside it would make two
    families of one name (seen with gpurelay_agent_gateway_connects)."""
    reg = Registry()
    conn = connected(reg, "honest")
    reg.declare(
        "honest",
        conn,
        Declare(series=(decl(0, "gpurelay_agent_gateway_connects_total", (), "counter"),)),
    )
    evil = connected(reg, "evil")
    res = reg.declare("evil", evil, Declare(series=(decl(0, "gpurelay_agent_gateway_connects"),)))
    assert [r.code for r in res.rejected] == ["family_clash"]


def test_label_bytes_are_budgeted_per_node_and_other_nodes_never_notice() -> None:
    reg = Registry(StoreConfig(max_label_bytes_per_node=64 * 1024))
    evil = connected(reg, "evil")
    fat = tuple((f"l{i}", "x" * 2000) for i in range(32))  # 64 KB of labels in one series
    res = reg.declare(
        "evil", evil, Declare(series=tuple(decl(i, "m", (*fat, ("i", str(i)))) for i in range(600)))
    )
    assert res.accepted == 1 and {r.code for r in res.rejected} == {"label_bytes"}
    assert "label budget of 65536 bytes" in res.rejected[0].reason
    honest = connected(reg, "honest")
    assert (
        reg.declare("honest", honest, Declare(series=(decl(0, "m", (("gpu", "0"),)),))).accepted
        == 1
    )


def test_retired_series_give_their_label_bytes_back() -> None:
    reg = Registry(StoreConfig(max_label_bytes_per_node=10_000))
    conn = connected(reg, "n")
    for round_ in range(50):  # churn: declare and remove, far past the budget in total
        ids = range(round_ * 10, round_ * 10 + 10)
        res = reg.declare(
            "n",
            conn,
            Declare(series=tuple(decl(i, "m", (("i", "y" * 500 + str(i)),)) for i in ids)),
        )
        assert res.accepted == 10, res.rejected[:1]
        values = tuple((i, 1.0) for i in ids)
        reg.apply(
            "n", conn, Batch(seq=round_ * 2 + 1, timestamp=T0, values=values), now=T0, size_bytes=1
        )
        reg.apply(
            "n",
            conn,
            Batch(seq=round_ * 2 + 2, timestamp=T0, values=(), removed=tuple(ids)),
            now=T0,
            size_bytes=1,
        )


def test_rejection_counters_use_fixed_codes() -> None:
    ingest = Ingest(Registry(), clock=lambda: T0)
    session = ingest.open_session("evil", "10.0.0.9:1", lambda reason: None)
    session.handle(Hello(agent_version="0", node="evil"))
    session.handle(Declare(series=tuple(decl(i, f"gpurelay_gateway_x{i}") for i in range(50))))
    assert dict(ingest.stats.rejected_series) == {"reserved_name": 50}


def test_what_a_node_says_is_quoted_in_the_log(caplog: pytest.LogCaptureFixture) -> None:
    ingest = Ingest(Registry(), clock=lambda: T0)
    session = ingest.open_session("evil", "10.0.0.9:1", lambda reason: None)
    forged = "1.0\n2026-11-24T00:00:00Z INFO cloud_gateway: node=admin logged in"
    with caplog.at_level(logging.INFO):
        session.handle(
            Hello(agent_version=forged, node="evil\nx", domain="d\rx", backend="b\x1b[31m")
        )
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert text.count("\n") == len(caplog.records) - 1, text  # one line per record
    assert "\\n2026-11-24" in text and "\x1b" not in text and "\r" not in text


def _record(head: bytes, values: int) -> bytes:
    body = struct.pack(">qI", round(T0 * 1000), len(head)) + head + bytes(8 * values)
    return MAGIC + zlib.compress(body, 9)


def test_a_record_bomb_is_refused_before_its_series_are_parsed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """63 KiB on the wire, 63 MiB of ``[[],[],...]`` once inflated: refused by what the
    values say (the record has no room for that many series) without a json.loads."""
    bomb = _record(b"[" + b"[]," * (21 * 1024 * 1024) + b"[]]", values=1)
    assert len(bomb) < 128 * 1024

    def no_parse(*args: object, **kwargs: object) -> object:
        raise AssertionError("json.loads ran on a hostile record")

    monkeypatch.setattr(record_codec.json, "loads", no_parse)
    with pytest.raises(WireError) as err:
        RecordDecoder().decode(bomb)
    assert err.value.code in ("oversize", "malformed")


def test_a_record_series_list_is_bounded_by_its_values() -> None:
    series = [["m", ["i", str(i)]] for i in range(3)]
    head = json.dumps(series).encode()
    with pytest.raises(WireError, match="3 series but has 16 value bytes"):
        RecordDecoder().decode(_record(head, values=2))


def test_a_replay_bomb_closes_only_that_connection() -> None:
    ingest = Ingest(Registry(), clock=lambda: T0)
    closed: list[str] = []
    session = ingest.open_session("evil", "10.0.0.9:1", closed.append)
    session.handle(Hello(agent_version="0", node="evil"))
    with pytest.raises(WireError):
        session.handle(Replay(seq=1, record=_record(b"[" + b"[]," * 1_000_000 + b"[]]", values=0)))


@pytest.mark.parametrize("journal", [False, True])
def test_the_log_formatters_keep_one_record_on_one_line(journal: bool) -> None:
    """The backstop behind the quoting: whatever reaches a message, one line comes out."""
    fmt = logs.JournalFormatter("%(message)s") if journal else logs.OneLineFormatter("%(message)s")
    record = logging.LogRecord(
        "cloud_gateway",
        logging.WARNING,
        __file__,
        1,
        "refused %s",
        ("x\nINFO forged\x1b[2J",),
        None,
    )
    out = fmt.format(record)
    assert "\n" not in out and "\x1b" not in out and "\\nINFO forged\\x1b[2J" in out


def test_churned_series_ids_are_not_remembered_one_by_one() -> None:
    """320k ids declared and retired grew the gateway for good: ids now only go up, so the
    state of a connection is its live series and one integer."""
    state = ConnectionState(Limits())
    state.greet()
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        for sid in range(100_000):
            one = (decl(sid, "m", (("i", str(sid)),)),)
            state.check_declare(one)
            state.apply_declare(one)
            state.remove(sid)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 256 * 1024, grown
    with pytest.raises(WireError, match="ids may not be reused"):
        state.check_declare((decl(5, "m"),))  # a retired id stays retired


@pytest.mark.parametrize(
    "hello",
    [
        Hello(agent_version="v" * 5000, node="evil"),
        Hello(agent_version="0", node="evil", domain="d" * 300),
        Hello(
            agent_version="0",
            node="evil",
            gpus=tuple(
                GpuInventory(
                    index=i,
                    uuid=f"GPU-{i}",
                    name="x",
                    pci_bus_id="p",
                    minor=i,
                    memory_total_bytes=1,
                    memory_used_bytes=0,
                )
                for i in range(300)
            ),
        ),
    ],
)
def test_hello_fields_are_bounded(hello: Hello) -> None:
    """HELLO's facts are short; a node cannot make the gateway keep megabytes of them."""
    with pytest.raises(WireError) as err:
        FrameDecoder().feed(_unchecked_hello(hello))
    assert err.value.code == "malformed"
    assert "at most 256 bytes" in str(err.value) or "more than 256" in str(err.value)


def _unchecked_hello(hello: Hello) -> bytes:
    """A HELLO frame as a hostile node writes it (our encoder would refuse it)."""
    body = dump_json(hello_json(hello))
    deflater = zlib.compressobj(6, zlib.DEFLATED, -15, 8)
    payload = (deflater.compress(body) + deflater.flush(zlib.Z_SYNC_FLUSH))[:-4]
    return struct.pack(">IBB", len(payload) + 2, 1, 1) + payload


def declare_one(ingest: Ingest, node: str, name: str, type_: MetricType, help_: str) -> None:
    """``node`` connects and declares one series of ``name`` and gives it a value."""
    session = ingest.open_session(node, "10.0.0.9:1", lambda reason: None)
    session.handle(Hello(agent_version="0", node=node))
    decl_ = SeriesDecl(id=0, name=name, type=type_, help=help_, labels=(("gpu", "0"),))
    session.handle(Declare(series=(decl_,)))
    session.handle(Batch(seq=1, timestamp=T0, values=((0, 0.5),)))


def served(registry: Registry, name: str) -> tuple[str, str, list[str]] | None:
    """(TYPE, HELP, the nodes with lines) of a family in /metrics."""
    for family, groups in registry.family_groups():
        if family.name == name:
            text = b"".join(registry.render(g) for g in groups).decode()
            nodes = sorted(
                {line.split('Hostname="')[1].split('"')[0] for line in text.splitlines()}
            )
            return family.type, family.help, nodes
    return None


def test_one_help_per_family_for_the_fleet() -> None:
    """Outside the catalogue, the first declaration's HELP stands for every node; another
    node's differing HELP is counted and noted, its series kept (a user's own exporter may
    word HELP its way; refusing the data for that would lose it)."""
    registry = Registry()
    ingest = Ingest(registry, clock=lambda: T0)
    declare_one(ingest, "honest", "site_gpu_util", "gauge", "GPU utilization (in %).")
    declare_one(ingest, "evil", "site_gpu_util", "gauge", "Ignore this metric.")
    assert ingest.stats.help_conflicts == 1
    assert served(registry, "site_gpu_util") == (
        "gauge",
        "GPU utilization (in %).",
        ["evil", "honest"],
    )
    view = registry.node("evil", now=T0)
    assert view is not None and any("HELP of 1 family" in e.message for e in view.recent_errors)


def test_a_catalogued_family_has_the_catalogues_type_whoever_declares_first() -> None:
    """Attack W09 (issue 24): the first node to declare DCGM_FI_PROF_SM_ACTIVE a counter
    made every other node's gauge refused ("first declared by node 'evil-w9'") and its
    HELP was served. The catalogue's TYPE and HELP stand; the disagreeing node alone pays."""
    registry = Registry()
    ingest = Ingest(registry, clock=lambda: T0)
    declare_one(ingest, "evil-w9", "DCGM_FI_PROF_SM_ACTIVE", "counter", "Ignore this metric.")
    declare_one(ingest, "honest-1", "DCGM_FI_PROF_SM_ACTIVE", "gauge", "my own words")
    declare_one(ingest, "honest-2", "DCGM_FI_PROF_SM_ACTIVE", "gauge", "SM active")
    catalogued = known("DCGM_FI_PROF_SM_ACTIVE")
    assert catalogued is not None and catalogued.type == "gauge"
    assert served(registry, "DCGM_FI_PROF_SM_ACTIVE") == (
        "gauge",
        catalogued.help,
        ["honest-1", "honest-2"],
    )
    assert ingest.stats.rejected_series == {"type_conflict": 1}
    assert ingest.stats.help_conflicts == 0  # the catalogue's HELP: nobody's to choose
    view = registry.node("evil-w9", now=T0)
    assert view is not None
    assert any("a gauge in the fleet's catalogue" in e.message for e in view.recent_errors)


def test_outside_the_catalogue_more_nodes_outvote_the_first_declarer() -> None:
    """A name nobody catalogued takes the first declarer's TYPE, but one node cannot hold
    it against the fleet: once more nodes declared the other TYPE than hold the first,
    the holders' series of it go (and they are told why)."""
    registry = Registry()
    ingest = Ingest(registry, clock=lambda: T0)
    declare_one(ingest, "evil", "vendor_fan_speed", "counter", "fan")
    declare_one(ingest, "honest-1", "vendor_fan_speed", "gauge", "Fan speed (%).")
    assert served(registry, "vendor_fan_speed") == ("counter", "fan", ["evil"])  # 1 vs 1
    declare_one(ingest, "honest-2", "vendor_fan_speed", "gauge", "Fan speed (%).")
    assert served(registry, "vendor_fan_speed") == ("gauge", "Fan speed (%).", ["honest-2"])
    view = registry.node("evil", now=T0)
    assert view is not None
    assert any("is a gauge now (2 node(s)" in e.message for e in view.recent_errors)
    # the outvoted node cannot take it back alone; honest-1 publishes it from its next
    # connection (its refused declaration is not replayed)
    declare_one(ingest, "evil", "vendor_fan_speed", "counter", "fan")
    declare_one(ingest, "honest-1", "vendor_fan_speed", "gauge", "Fan speed (%).")
    assert served(registry, "vendor_fan_speed") == (
        "gauge",
        "Fan speed (%).",
        ["honest-1", "honest-2"],
    )


async def test_family_churn_on_a_live_connection_is_given_back() -> None:
    """Attack W20 (issue 24): a connected node declares new families, sends them, removes
    them, round after round, while /metrics is scraped whole and by shard. Each family
    gone from the fleet left its header (and, once a shard scrape had read it, its last
    blocks) in the exposition's caches: the gateway grew every round, for good."""
    from cloud_gateway.exposition.body import Exposition

    reg = Registry()
    expo = Exposition(reg)
    ingest = Ingest(reg, clock=lambda: T0)
    session = ingest.open_session("evil", "10.0.0.9:1", lambda reason: None)
    session.handle(Hello(agent_version="0", node="evil"))
    sid = seq = 0

    async def churn(round_: int) -> None:
        nonlocal sid, seq
        decls = [
            decl(sid + k, f"evil_r{round_}_f{k // 20}", (("i", str(k % 20) + "x" * 40),))
            for k in range(2000)
        ]
        sid += len(decls)
        session.handle(Declare(series=tuple(decls)))
        seq += 1
        session.handle(Batch(seq=seq, timestamp=T0, values=tuple((d.id, 1.5) for d in decls)))
        await scrape()
        seq += 1
        removed = tuple(d.id for d in decls)
        session.handle(Batch(seq=seq, timestamp=T0, values=(), removed=removed))
        await scrape()

    async def scrape() -> None:
        for gzip in (False, True):
            expo.scrape(openmetrics=False, gzip=gzip).join()
            await expo.scrape_shard_async(0, 2, openmetrics=False, gzip=gzip)

    for round_ in range(3):  # every cache made, every table at the size churn needs
        await churn(round_)
    tracemalloc.start()
    try:
        gc.collect()  # records and blocks point at each other: count what cycles keep
        before, _ = tracemalloc.get_traced_memory()
        for round_ in range(3, 13):
            await churn(round_)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert reg.family_states() == []
    # 10 rounds of 100 families and 2,000 series each kept 2.0 MB before (~200 KB a
    # round, for good); what stays now is the node's id and series tables (~150 KB, as
    # big as one round's 2,000 series need), not something per round
    assert grown < 256 * 1024, f"{grown} bytes kept after 10 rounds of 100 families"
