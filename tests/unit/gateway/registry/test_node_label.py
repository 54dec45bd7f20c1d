"""The node label setting (issue 14): ``Hostname`` by default, ``hostname`` as in
dcgm-exporter's next release (its PR #655), and ``NodeName`` on device series as ACK's
exporter has it.

Agent (``node_label``) and gateway (``[registry] node_label``) each apply it to every
series they name the node on; where they disagree the gateway's setting wins on what it
publishes, and the authenticated node is the value whatever the agent wrote.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cloud_gateway import config as gateway_config
from cloud_gateway.errors import GatewayConfigError
from cloud_gateway.exposition.body import Exposition
from cloud_gateway.http.bie import bie_document
from cloud_gateway.ingest.delivery import Delivery, DeliverySettings
from cloud_gateway.ingest.session import Ingest
from cloud_gateway.registry.node_labels import stamp_node
from cloud_gateway.registry.store import Registry, StoreConfig
from edge_agent import config as agent_config
from edge_agent.errors import ConfigError
from gpurelay.model import Family, Sample, Snapshot
from gpurelay.record import RecordEncoder
from gpurelay.wire import Replay
from harness.pipeline import make_pipeline
from tests.unit.gateway.exposition.test_gateway_exposition import T0, Agent
from tests.unit.gateway.ingest.test_ingest_replay import NODE, UTIL, Receiver, settle
from tests.unit.gateway.ingest.test_ingest_replay import Agent as Session

# --- stamping ----------------------------------------------------------------------------------


def test_both_node_labels_of_a_device_series_get_the_authenticated_node() -> None:
    claimed = (("gpu", "0"), ("Hostname", "liar"), ("NodeName", "other-liar"))
    assert stamp_node(claimed, "edge-a") == (
        ("gpu", "0"),
        ("Hostname", "edge-a"),
        ("NodeName", "edge-a"),
    )


@pytest.mark.parametrize("gateway", ["Hostname", "hostname"])
@pytest.mark.parametrize("agent", ["Hostname", "hostname"])
def test_the_gateways_spelling_wins_and_no_forged_label_stays(gateway: str, agent: str) -> None:
    stamped = stamp_node((("gpu", "0"), (agent, "liar"), ("NodeName", "liar")), "edge-a", gateway)
    assert stamped == (("gpu", "0"), (gateway, "edge-a"), ("NodeName", "edge-a"))


def test_both_spellings_sent_become_one_label() -> None:
    both = (("Hostname", "a"), ("gpu", "0"), ("hostname", "b"))
    assert stamp_node(both, "edge-a", "hostname") == (("hostname", "edge-a"), ("gpu", "0"))
    assert stamp_node(both, "edge-a") == (("Hostname", "edge-a"), ("gpu", "0"))


def test_series_without_a_host_label() -> None:
    ack = (("NodeName", "liar"), ("PodName", "p"))
    assert stamp_node(ack, "edge-a", "hostname") == (("NodeName", "edge-a"), ("PodName", "p"))
    bare = (("collector", "device"),)
    assert stamp_node(bare, "edge-a", "hostname") == (
        ("collector", "device"),
        ("hostname", "edge-a"),
    )
    assert stamp_node((), "edge-a") == (("Hostname", "edge-a"),)


# --- settings ----------------------------------------------------------------------------------


def test_both_default_to_hostname_with_a_capital() -> None:
    assert agent_config.load(None, {}).node_label == "Hostname"
    assert gateway_config.load(None, {}).registry.node_label == "Hostname"
    assert StoreConfig().node_label == "Hostname"


def test_settings_from_toml_and_environment(tmp_path: Path) -> None:
    agent_toml = tmp_path / "agent.toml"
    agent_toml.write_text('node_label = "hostname"\n')
    assert agent_config.load(agent_toml, {}).node_label == "hostname"
    env = {"EDGE_AGENT_NODE_LABEL": "Hostname"}
    assert agent_config.load(agent_toml, env).node_label == "Hostname"
    gateway_toml = tmp_path / "gateway.toml"
    gateway_toml.write_text('[registry]\nnode_label = "hostname"\n')
    assert gateway_config.load(gateway_toml, {}).registry.node_label == "hostname"
    env = {"CLOUD_GATEWAY_REGISTRY_NODE_LABEL": "Hostname"}
    assert gateway_config.load(gateway_toml, env).registry.node_label == "Hostname"


@pytest.mark.parametrize("value", ["HOSTNAME", "NodeName", "node", ""])
def test_other_names_are_refused_clearly(value: str) -> None:
    with pytest.raises(ConfigError) as agent_error:
        agent_config.load(None, {"EDGE_AGENT_NODE_LABEL": value})
    assert str(agent_error.value) == (
        f"node_label must be one of Hostname, hostname, not {value!r}"
    )
    with pytest.raises(GatewayConfigError) as gateway_error:
        gateway_config.load(None, {"CLOUD_GATEWAY_REGISTRY_NODE_LABEL": value})
    assert str(gateway_error.value) == (
        f"registry.node_label must be one of Hostname, hostname, not {value!r}"
    )


# --- the agent ---------------------------------------------------------------------------------


def snapshot(tmp: Path, node_label: str, *, mig: bool = False) -> Snapshot:
    cfg = agent_config.load(None, {"EDGE_AGENT_NODE_LABEL": node_label})
    pipeline, _sim, _clock = make_pipeline(tmp, gpus=2, seed=7, mig=mig, cfg=cfg)
    try:
        return pipeline.collection.collect()
    finally:
        pipeline.close()


@pytest.mark.parametrize("node_label", ["Hostname", "hostname"])
def test_the_agent_names_the_node_with_its_setting(tmp_path: Path, node_label: str) -> None:
    snap = snapshot(tmp_path, node_label, mig=True)
    other = {"Hostname": "hostname", "hostname": "Hostname"}[node_label]
    device = [dict(s.labels) for s in snap.samples if s.name.startswith("DCGM_FI_")]
    assert device and any("GPU_I_ID" in d for d in device)  # MIG instances too
    for labels in device:
        assert labels[node_label] == labels["NodeName"] == "edge-node-1", labels
        assert other not in labels, labels
    (info,) = [dict(s.labels) for s in snap.samples if s.name == "gpurelay_agent_info"]
    assert info[node_label] == "edge-node-1" and other not in info
    # ACK series keep NodeName only: the setting is about the host label.
    procs = [dict(s.labels) for s in snap.samples if s.name.startswith("DCGM_CUSTOM_")]
    assert procs and all(p["NodeName"] == "edge-node-1" for p in procs)
    assert not any("Hostname" in p or "hostname" in p for p in procs)


# --- the gateway -------------------------------------------------------------------------------


def published(tmp_path: Path, agent: str, gateway: str) -> tuple[list[str], bytes]:
    """The unified body of a gateway set to ``gateway`` fed by an agent set to ``agent``
    whose certificate says edge-a (the agent itself believes it is edge-node-1)."""
    reg = Registry(StoreConfig(node_label=gateway))
    Agent(reg, "edge-a", snapshot(tmp_path, agent, mig=True))
    body = Exposition(reg).body(openmetrics=False, gzip=False)
    lines = [line for line in body.decode().splitlines() if not line.startswith("#")]
    return lines, body


@pytest.mark.parametrize("gateway", ["Hostname", "hostname"])
@pytest.mark.parametrize("agent", ["Hostname", "hostname"])
def test_the_gateway_publishes_its_own_setting(tmp_path: Path, agent: str, gateway: str) -> None:
    lines, _ = published(tmp_path, agent, gateway)
    other = {"Hostname": "hostname", "hostname": "Hostname"}[gateway]
    assert not [line for line in lines if f'{other}="' in line]
    assert not [line for line in lines if "edge-node-1" in line], "the agent's own name"
    device = [line for line in lines if line.startswith("DCGM_FI_")]
    assert device
    for line in device:
        assert f'{gateway}="edge-a"' in line and 'NodeName="edge-a"' in line, line
    own = [line for line in lines if line.startswith(("gpurelay_node_", "gpurelay_agent_info"))]
    assert len(own) == 1 + 3 + 1 + 1 + 1  # up, state x 3, last seen, late after, info
    assert all(f'{gateway}="edge-a"' in line for line in own), own


def test_bie_is_the_same_whatever_the_label(tmp_path: Path) -> None:
    """bie_document finds FB series by UUID (without GPU_I_ID), not by the node label."""
    docs = []
    for i, (agent, gateway) in enumerate([("Hostname", "Hostname"), ("hostname", "hostname")]):
        reg = Registry(StoreConfig(node_label=gateway))
        Agent(reg, "edge-a", snapshot(tmp_path / str(i), agent, mig=True))
        docs.append(bie_document(reg, T0))
    assert docs[0] == docs[1] and docs[0]["edge-a"]


async def test_replayed_series_get_the_gateways_spelling() -> None:
    """Remote write of a spooled collection: the same stamping as the live path."""
    receiver = Receiver()
    registry = Registry(StoreConfig(node_label="hostname"))
    delivery = Delivery(
        DeliverySettings(retry_backoff=(0.01, 0.02)), remote_write=receiver.writer()
    )
    ingest = Ingest(registry, clock=lambda: T0, delivery=delivery)
    agent = Session(ingest)
    labels = (("gpu", "0"), ("Hostname", "someone-else"), ("NodeName", "someone-else"))
    data = RecordEncoder().encode(
        Snapshot(
            node="x",
            timestamp=T0,
            families=(Family(name=UTIL, type="gauge", help=""),),
            samples=(Sample(UTIL, labels, 5.0),),
        )
    )
    assert agent.handle(Replay(seq=1, record=data)) == []
    await settle(lambda: agent.acks == [1])
    ((written, _points),) = receiver.requests[0]
    assert sorted(written) == [
        ("NodeName", NODE),
        ("__name__", UTIL),
        ("gpu", "0"),
        ("hostname", NODE),
    ]
    agent.session.closed("test")
