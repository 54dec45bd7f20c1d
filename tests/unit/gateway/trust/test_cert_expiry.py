"""Node certificate expiry (cloud_gateway.trust.cert_expiry): the gauge, the warnings at 14 and 3
days (once per threshold per node per certificate), forgetting, the inventory fact, and
the ``cloud-gateway nodes`` column."""

from __future__ import annotations

import logging
from pathlib import Path

import asyncssh
import pytest
from asyncssh.public_key import SSHOpenSSHCertificate

from cloud_gateway.cluster.directory import DirectoryError, NodeFacts
from cloud_gateway.commands.nodes import render_table
from cloud_gateway.exposition.body import Exposition
from cloud_gateway.registry.store import Registry
from cloud_gateway.trust.cert_expiry import CERT_EXPIRY, DAY, CertificateExpiry, expiry_of
from gpurelay.ssh_cert import FOREVER
from tests.promtool_support import unexpected_findings
from tests.unit.gateway.test_gateway_metrics import own_families

NOW = 1_800_000_000
CA = asyncssh.generate_private_key("ssh-ed25519")
KEY = asyncssh.generate_private_key("ssh-ed25519")


def cert(node: str, valid_before: int, serial: int = 7) -> SSHOpenSSHCertificate:
    made = CA.generate_user_certificate(
        KEY, f"node:{node}", principals=[node], serial=serial, valid_before=valid_before
    )
    assert isinstance(made, SSHOpenSSHCertificate)
    return made


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    caplog.clear()
    return lines


def test_expiry_and_serial_are_read_from_the_certificate() -> None:
    assert expiry_of(cert("a", NOW + 5 * 86400, serial=42)) == (NOW + 5 * 86400, 42)
    assert expiry_of(cert("a", FOREVER, serial=3)) == (None, 3)


def test_warns_at_14_and_3_days_and_expired_once_each(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="cloud_gateway.certificates")
    expires = NOW + 20 * 86400
    live = {"edge-1": cert("edge-1", expires, serial=9)}
    watch = CertificateExpiry()
    for days_left in (20, 15):
        watch.refresh(expires - days_left * DAY, live=live)
    assert warnings(caplog) == []
    watch.refresh(expires - 14 * DAY, live=live)
    assert [r.name for r in caplog.records] == ["cloud_gateway.certificates.node.edge-1"]
    (line,) = warnings(caplog)
    assert "node edge-1" in line and "serial 9" in line and "within 14 days" in line
    assert "2027-02-04 08:00:00 UTC" in line  # NOW + 20 days, in UTC
    for days_left in (13, 10, 4):
        watch.refresh(expires - days_left * DAY, live=live)
    assert warnings(caplog) == []  # not on every tick
    watch.refresh(expires - 2.5 * DAY, live=live)
    (line,) = warnings(caplog)
    assert "within 3 days" in line and "in 2.5 days" in line
    watch.refresh(expires - 1, live=live)
    assert warnings(caplog) == []
    watch.refresh(expires, live=live)
    (line,) = warnings(caplog)
    assert "expired on 2027-02-04" in line and "edge-1" in line
    watch.refresh(expires + DAY, live=live)
    assert warnings(caplog) == []


def test_a_node_first_seen_close_gets_one_line_and_a_new_certificate_starts_over(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="cloud_gateway.certificates")
    watch = CertificateExpiry()
    watch.refresh(NOW, live={"n": cert("n", NOW + 2 * 86400, serial=1)})
    (line,) = warnings(caplog)
    assert "within 3 days" in line
    renewed = cert("n", NOW + 10 * 86400, serial=2)
    watch.refresh(NOW + 60, live={"n": renewed})
    (line,) = warnings(caplog)
    assert "within 14 days" in line and "serial 2" in line
    watch.refresh(NOW + 120, live={"n": renewed})
    assert warnings(caplog) == []
    assert watch.of("n") == (NOW + 10 * 86400, 2)


def test_forever_has_no_series_and_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="cloud_gateway.certificates")
    watch = CertificateExpiry()
    watch.refresh(NOW, live={"f": cert("f", FOREVER), "e": cert("e", NOW + 100 * 86400)})
    fam, samples = watch.family("Hostname")
    assert fam is CERT_EXPIRY
    assert [(s.labels, s.value) for s in samples] == [
        ((("Hostname", "e"),), float(NOW + 100 * 86400))
    ]
    assert watch.of("f") == (None, 7)
    assert warnings(caplog) == []


def test_known_nodes_held_or_stored_stay_the_rest_are_forgotten() -> None:
    watch = CertificateExpiry()
    watch.refresh(NOW, live={"a": cert("a", NOW + DAY * 30), "b": cert("b", NOW + DAY * 40)})
    watch.refresh(NOW + 1, live={}, held={"a"}, stored={"c": (NOW + 50, 3)})
    assert watch.of("a")[0] == NOW + DAY * 30  # offline, still in the registry
    assert watch.of("b") == (None, None)  # gone from the registry: forgotten
    assert watch.of("c") == (NOW + 50, 3)  # the inventory's fact
    # what this run saw on a connection wins over an older inventory fact
    watch.refresh(NOW + 2, live={}, held=(), stored={"a": (NOW + 5, 1)})
    assert watch.of("a")[0] == NOW + DAY * 30
    watch.refresh(NOW + 3, live={}, held=(), stored={})
    assert watch.of("a") == (None, None) and watch.of("c") == (None, None)


def test_the_family_is_rendered_with_the_gateways_own_and_passes_promtool(
    promtool: Path,
) -> None:
    watch = CertificateExpiry()
    watch.refresh(NOW, live={"edge-1": cert("edge-1", NOW + DAY * 30)})
    exposition = Exposition(Registry())
    exposition.set_extra([*own_families(), watch.family("Hostname")])
    text = exposition.body(openmetrics=False, gzip=False).decode()
    assert f'{CERT_EXPIRY.name}{{Hostname="edge-1"}} {NOW + 30 * 86400}\n' in text
    assert f"# TYPE {CERT_EXPIRY.name} gauge\n" in text
    assert unexpected_findings(promtool, text.encode()) == []


def test_the_inventory_keeps_the_expiry_and_refuses_a_wrong_type() -> None:
    facts = NodeFacts(hostname="h", cert_serial=4, cert_valid_before=NOW)
    assert NodeFacts.from_json(facts.to_json()) == facts
    assert NodeFacts.from_json('{"hostname": "old"}').cert_valid_before is None  # older gateway
    with pytest.raises(DirectoryError, match="cert_valid_before is not an integer"):
        NodeFacts.from_json('{"cert_valid_before": "soon"}')


def test_the_nodes_table_has_an_expires_column() -> None:
    nodes = [
        {"name": "a", "state": "online", "certificate_expires": NOW + 6 * 86400 + 600},
        {"name": "b", "state": "online", "certificate_expires": NOW + 7200},
        {"name": "c", "state": "offline", "certificate_expires": NOW - 1},
        {"name": "d", "state": "online", "certificate_expires": None},
        {"name": "e", "state": "online"},  # an older gateway's API
    ]
    rows = {line.split()[0]: line for line in render_table(nodes, NOW).splitlines()}
    assert "EXPIRES" in rows["NODE"]
    assert "2027-01-21 (6d)" in rows["a"]
    assert "2027-01-15 (2h)" in rows["b"]
    assert "2027-01-15 (expired)" in rows["c"]
    assert rows["d"].split()[-2:] == ["-", "-"] and rows["e"].split()[-2:] == ["-", "-"]
