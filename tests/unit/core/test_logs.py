"""gpurelay.logs: text lines as before, or one JSON object per line (log_format = "json")."""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from cloud_gateway import config as gateway_config
from cloud_gateway.errors import GatewayConfigError
from edge_agent import config as agent_config
from edge_agent.errors import ConfigError
from gpurelay import logs

HOSTILE = "edge-1\r\n2026-01-01T00:00:00Z ERROR forged\x1b[2J\x00\x7f\x9b done"
RFC3339_MS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


@pytest.fixture
def root() -> Iterator[logging.Logger]:
    """The root logger as it was, after the test configured it."""
    logger = logging.getLogger()
    handlers, level = list(logger.handlers), logger.level
    yield logger
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    for handler in handlers:
        logger.addHandler(handler)
    logger.setLevel(level)


def configure(root: logging.Logger, **kwargs: object) -> io.StringIO:
    """``logs.setup`` with its handler writing to a buffer instead of stderr."""
    logs.setup("debug", **kwargs)  # type: ignore[arg-type]
    (handler,) = root.handlers
    stream = io.StringIO()
    assert isinstance(handler, logging.StreamHandler)
    handler.setStream(stream)
    return stream


def lines(stream: io.StringIO) -> list[dict[str, str]]:
    text = stream.getvalue()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def test_every_line_is_one_json_object(root: logging.Logger) -> None:
    stream = configure(root, log_format="json", environ={}, fields={"node": "edge-1"})
    log = logging.getLogger("edge_agent.tunnel")
    log.debug("dialling %s:%d", "gw", 2222)
    log.info("connected")
    log.warning("slow: %.1fs", 2.5)
    log.error("refused")
    entries = lines(stream)
    assert [e["level"] for e in entries] == ["debug", "info", "warning", "error"]
    assert entries[0]["message"] == "dialling gw:2222"
    for entry in entries:
        assert RFC3339_MS.match(entry["time"]), entry["time"]
        assert entry["logger"] == "edge_agent.tunnel"
        assert entry["node"] == "edge-1"
        assert list(entry)[:4] == ["time", "level", "logger", "message"]


def test_a_hostile_message_stays_one_line_and_round_trips(root: logging.Logger) -> None:
    stream = configure(root, log_format="json", environ={})
    logging.getLogger("cloud_gateway").warning("refused %s", HOSTILE, extra={"client": HOSTILE})
    text = stream.getvalue()
    assert text.count("\n") == 1
    assert not re.search(r"[\x00-\x1f\x7f-\x9f]", text[:-1])  # nothing raw: all escaped
    (entry,) = lines(stream)
    # what the text format prints, decoded back exactly: a viewer decoding the JSON still
    # gets no CR/LF to forge a line and no ANSI escape to repaint a terminal
    assert entry["message"] == logs.escape_controls(f"refused {HOSTILE}")
    assert "\\r\\n2026-01-01T00:00:00Z ERROR forged\\x1b[2J\\x00\\x7f\\x9b" in entry["message"]
    assert entry["client"] == logs.escape_controls(HOSTILE)


def test_the_exception_is_a_field_on_the_same_line(root: logging.Logger) -> None:
    stream = configure(root, log_format="json", environ={})
    try:
        raise ValueError(f"bad frame {HOSTILE}")
    except ValueError:
        logging.getLogger("cloud_gateway.ingest").exception("session failed")
    text = stream.getvalue()
    assert text.count("\n") == 1
    (entry,) = lines(stream)
    assert entry["message"] == "session failed"
    assert entry["exception"].startswith("Traceback (most recent call last):\n")
    assert "ValueError: bad frame edge-1\\r\n" in entry["exception"]  # CR escaped, LF kept
    assert "\x1b" not in entry["exception"] and "\\x1b[2J" in entry["exception"]


def test_the_node_is_a_field_wherever_the_record_names_it(root: logging.Logger) -> None:
    stream = configure(root, log_format="json", environ={}, fields={"gateway": "gw-a"})
    gateway_log = logging.getLogger("cloud_gateway.ssh_server")
    logs.node_logger(gateway_log, "edge-7.example.com").info("published")
    logging.LoggerAdapter(logging.getLogger("edge_agent.tunnel"), {"node": "edge-8"}).info("up")
    logging.getLogger("cloud_gateway.http").info("GET", extra={"client": "10.0.0.9:41234"})
    logging.getLogger("cloud_gateway").info("other", extra={"gateway": "gw-b"})
    a, b, c, d = lines(stream)
    assert a["logger"] == "cloud_gateway.ssh_server.node.edge-7.example.com"
    assert (a["node"], a["gateway"]) == ("edge-7.example.com", "gw-a")
    assert b["node"] == "edge-8"
    assert "node" not in c and c["client"] == "10.0.0.9:41234"
    assert d["gateway"] == "gw-b"  # the record's own value wins over the process's


def test_under_systemd_the_priority_prefixes_the_object(root: logging.Logger) -> None:
    stream = configure(root, log_format="json", environ={"JOURNAL_STREAM": "8:1234"})
    logging.getLogger("x").warning("careful\nnow")
    logging.getLogger("x").error("broken")
    first, second = stream.getvalue().splitlines()
    assert first.startswith("<4>{") and second.startswith("<3>{")
    # journald strips the prefix: MESSAGE is the object, with its one time field
    entry = json.loads(first[3:])
    assert entry["message"] == "careful\\nnow" and RFC3339_MS.match(entry["time"])


@pytest.mark.parametrize("journal", [False, True])
def test_text_stays_the_default(root: logging.Logger, journal: bool) -> None:
    environ = {"JOURNAL_STREAM": "8:1"} if journal else {}
    stream = configure(root, prefix="node=edge-1", environ=environ)
    logging.getLogger("edge_agent").info("hello %s", "x\ny")
    line = stream.getvalue()
    if journal:
        assert line == "<6>INFO node=edge-1 edge_agent: hello x\\ny\n"
    else:
        assert re.fullmatch(
            r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ INFO node=edge-1 edge_agent: hello x\\ny\n", line
        )


def test_rfc3339_is_utc_with_milliseconds() -> None:
    assert logs.rfc3339(0.0) == "1970-01-01T00:00:00.000Z"
    assert logs.rfc3339(1795860594.1239) == "2026-11-28T10:09:54.123Z"


def test_an_unknown_format_is_refused(root: logging.Logger) -> None:
    with pytest.raises(ValueError, match="text or json"):
        logs.setup("info", log_format="logfmt")


def test_both_configs_take_log_format_from_file_and_environment(tmp_path: Path) -> None:
    assert agent_config.load(None, {}).log_format == "text"
    assert gateway_config.load(None, {}).log_format == "text"
    assert agent_config.load(None, {"EDGE_AGENT_LOG_FORMAT": "json"}).log_format == "json"
    assert gateway_config.load(None, {"CLOUD_GATEWAY_LOG_FORMAT": "json"}).log_format == "json"
    toml = tmp_path / "c.toml"
    toml.write_text('log_format = "json"\n')
    assert agent_config.load(toml, {}).log_format == "json"
    assert gateway_config.load(toml, {}).log_format == "json"
    with pytest.raises(ConfigError, match="log_format must be text or json, not 'xml'"):
        agent_config.load(None, {"EDGE_AGENT_LOG_FORMAT": "xml"})
    with pytest.raises(GatewayConfigError, match="log_format must be text or json, not 'xml'"):
        gateway_config.load(None, {"CLOUD_GATEWAY_LOG_FORMAT": "xml"})


def test_the_guides_logs_table_is_both_configs() -> None:
    guide = (Path(__file__).resolve().parents[3] / "docs" / "operator-guide.md").read_text()
    start = guide.index("## Logs\n")
    section = guide[start : guide.index("\n## ", start + 1)]
    rows = dict(re.findall(r"^\| `(\w+)` \| `([^`]+)` \|", section, re.MULTILINE))
    assert set(rows) == {"log_level", "log_format"}
    for cfg in (agent_config.AgentConfig(), gateway_config.GatewayConfig()):
        for key, shown in rows.items():
            assert json.loads(shown) == getattr(cfg, key), key


def test_the_signer_takes_log_format_on_its_command_line() -> None:
    from cloud_gateway.cli import _parser

    base = ["signer", "--ca-dir", "ca", "--socket", "sock"]
    assert _parser().parse_args(base).log_format == "text"
    assert _parser().parse_args([*base, "--log-format", "json"]).log_format == "json"
    with pytest.raises(SystemExit):
        _parser().parse_args([*base, "--log-format", "xml"])
