"""Logging for both binaries: one line per record, readable in a terminal and in journald,
or one JSON object per line for Loki or Elasticsearch (``log_format = "json"``).

Under systemd (``JOURNAL_STREAM`` is set) each line starts with a ``<N>`` syslog priority,
which journald turns into the entry's level (``journalctl -p warning`` works), and carries
no timestamp of its own (journald adds one). In a terminal, lines carry a UTC timestamp.

One record is one line: what a node or client sent is ``%r``-quoted where it is logged,
and as a backstop the formatters escape any control character left in a message (a CR/LF
or an ANSI escape can never forge a line or repaint a terminal). Tracebacks keep their
lines in text; in JSON they are the ``exception`` field, on the record's one line.

A JSON line: ``time`` (RFC 3339, UTC, milliseconds), ``level``, ``logger``, ``message``
(escaped as in text, so a viewer that decodes the JSON still prints no control
character), then ``node``, ``gateway`` and ``client`` where the record carries them (a
LoggerAdapter's or ``extra``'s ``node``, a ``*.node.NAME`` child logger, or the process's
own fields given to :func:`setup`), then ``exception`` and ``stack``. Under systemd the
JSON object follows the ``<N>`` prefix, which journald strips: the entry's MESSAGE is the
object, its level the entry's priority.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from collections.abc import Mapping

_PRIORITY = {
    logging.CRITICAL: 2,
    logging.ERROR: 3,
    logging.WARNING: 4,
    logging.INFO: 6,
    logging.DEBUG: 7,
}

FORMATS = ("text", "json")
# Fields a record may carry (LoggerAdapter extra, logging's extra=) that a JSON line shows.
CONTEXT_FIELDS = ("node", "gateway", "client")

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_CONTROL_BUT_NEWLINE = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")
_NODE_LOGGER = re.compile(r"\.node\.(.+)$")  # cloud_gateway.ssh_server.node.NAME


def escape_controls(text: str) -> str:
    """``text`` with every control character written as an escape (``\\n``, ``\\x1b``)."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


class OneLineFormatter(logging.Formatter):
    """A formatter whose message part can never span lines (the traceback still does)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escape_controls(record.message)
        return super().formatMessage(record)


class JournalFormatter(OneLineFormatter):
    def format(self, record: logging.LogRecord) -> str:
        priority = _PRIORITY.get(record.levelno, 6)
        text = super().format(record)
        # journald reads the prefix per line: keep a multi-line record (traceback) together
        return "\n".join(f"<{priority}>{line}" for line in text.splitlines())


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line whatever the record holds.

    ``fields`` are the process's own (the agent's ``node``, the gateway's ``gateway``);
    a record's own value of the same field wins. ``journal``: prefix the ``<N>`` priority.
    """

    def __init__(self, fields: Mapping[str, str] | None = None, *, journal: bool = False):
        super().__init__()
        self.fields = dict(fields or {})
        self.journal = journal

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, str] = {
            "time": rfc3339(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": escape_controls(record.getMessage()),
        }
        entry.update(self.fields)
        named = _NODE_LOGGER.search(record.name)
        if named:
            entry["node"] = named.group(1)
        for name in CONTEXT_FIELDS:
            value = record.__dict__.get(name)
            if value is not None and value != "":
                entry[name] = escape_controls(str(value))
        if record.exc_info:
            record.exc_text = record.exc_text or self.formatException(record.exc_info)
        if record.exc_text:
            entry["exception"] = _CONTROL_BUT_NEWLINE.sub(
                lambda m: repr(m.group())[1:-1], record.exc_text
            )
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        # ensure_ascii: every control character (and U+2028/9) leaves as an escape
        line = json.dumps(entry, ensure_ascii=True, separators=(",", ":"))
        if self.journal:
            return f"<{_PRIORITY.get(record.levelno, 6)}>{line}"
        return line


def node_logger(parent: logging.Logger, node: str) -> logging.Logger:
    """``parent``'s child logger for ``node`` (``PARENT.node.NAME``), so that every line
    says which node it is about; a JSON line reads its ``node`` field from that name."""
    return parent.getChild(f"node.{node}")


def rfc3339(created: float) -> str:
    """``2026-11-24T10:09:54.123Z``: UTC with milliseconds."""
    seconds = int(created)
    millis = int((created - seconds) * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{millis:03d}Z"


def setup(
    level: str,
    prefix: str = "",
    environ: Mapping[str, str] | None = None,
    *,
    log_format: str = "text",
    fields: Mapping[str, str] | None = None,
) -> None:
    """Configure the root logger once; ``prefix`` goes before the logger name (node=...) in
    text, ``fields`` into every JSON line (``{"node": ...}``)."""
    if log_format not in FORMATS:
        raise ValueError(f"log_format must be text or json, not {log_format!r}")
    env = os.environ if environ is None else environ
    journal = bool(env.get("JOURNAL_STREAM"))
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter(fields, journal=journal))
    else:
        handler.setFormatter(text_formatter(prefix, journal=journal))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())


def text_formatter(prefix: str = "", *, journal: bool = False) -> logging.Formatter:
    head = f"{prefix} " if prefix else ""
    body = head.replace("%", "%%") + "%(name)s: %(message)s"
    if journal:
        return JournalFormatter("%(levelname)s " + body)
    formatter = OneLineFormatter("%(asctime)s %(levelname)s " + body, datefmt="%Y-%m-%dT%H:%M:%SZ")
    formatter.converter = time.gmtime
    return formatter


class Throttled:
    """A log line at most every ``every`` seconds; the next one counts those left out.

    For lines a client can cause at will (refused connections, evictions): the log says
    it happens, and how often, without letting a flood write it line by line."""

    def __init__(self, logger: logging.Logger, level: int, every: float = 10.0) -> None:
        self.level, self.every = level, every
        self._logger = logger
        self._next = 0.0
        self._left_out = 0

    def __call__(self, message: str, *args: object) -> None:
        now = time.monotonic()
        if now < self._next:
            self._left_out += 1
            return
        if self._left_out:
            message += " (and %d more like it since the last such line)"
            args = (*args, self._left_out)
        self._logger.log(self.level, message, *args)
        self._next, self._left_out = now + self.every, 0
