"""Logging for both binaries: one line per record, readable in a terminal and in journald.

Under systemd (``JOURNAL_STREAM`` is set) each line starts with a ``<N>`` syslog priority,
which journald turns into the entry's level (``journalctl -p warning`` works), and carries
no timestamp of its own (journald adds one). In a terminal, lines carry a UTC timestamp.

One record is one line: what a node or client sent is ``%r``-quoted where it is logged,
and as a backstop the formatters escape any control character left in a message (a CR/LF
or an ANSI escape can never forge a line or repaint a terminal). Tracebacks keep their
lines.
"""

from __future__ import annotations

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


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


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


def setup(level: str, prefix: str = "", environ: Mapping[str, str] | None = None) -> None:
    """Configure the root logger once; ``prefix`` goes before the logger name (node=...)."""
    env = os.environ if environ is None else environ
    head = f"{prefix} " if prefix else ""
    body = head.replace("%", "%%") + "%(name)s: %(message)s"
    handler = logging.StreamHandler(sys.stderr)
    if env.get("JOURNAL_STREAM"):
        handler.setFormatter(JournalFormatter("%(levelname)s " + body))
    else:
        formatter = OneLineFormatter(
            "%(asctime)s %(levelname)s " + body, datefmt="%Y-%m-%dT%H:%M:%SZ"
        )
        formatter.converter = time.gmtime
        handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
