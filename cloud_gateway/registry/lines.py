"""Series lines of the text format, as the registry stores them (:class:`TextLines`, the
gateway's :class:`~cloud_gateway.registry.types.LineFormat`): a prefix per series, made
once, a value slot per line in a block's template, and the way back from a prefix to
its labels. Every value's text is exactly :func:`gpurelay.exposition.format_value`."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Final

from gpurelay.exposition import format_labels, format_value
from gpurelay.model import Labels


def _value_end(value: float) -> bytes:
    """``format_value(value) + "\\n"`` as bytes; integral values (most GPU readings) take a
    shortcut that formats the same digits in half the time (the gateway's hot loop)."""
    if value.is_integer() and abs(value) < 1e15:
        return b"%d\n" % value
    return format_value(value).encode() + b"\n"


_SPECIAL: Final = {math.inf: b"+Inf", -math.inf: b"-Inf"}
_LABEL: Final = re.compile(r'([^=,{}]+)="((?:[^"\\]|\\.)*)"')
_UNESCAPE: Final = re.compile(r"\\(.)", re.S)


def _unescape(m: re.Match[str]) -> str:
    c = m.group(1)
    return "\n" if c == "n" else c


class TextLines:
    """Series lines of the text format (the same bytes in OpenMetrics): the prefix
    ``NAME{labels} `` made once per series, then the value and a newline. In a block's
    template a value's slot is ``%d`` for an integral value below 1e15 (the digits of
    ``str(int(v))``), ``%r`` for another finite one (``repr``), ``%s`` with ``NaN``,
    ``+Inf`` or ``-Inf``: exactly :func:`gpurelay.exposition.format_value`."""

    def prefix(self, name: str, labels: Labels) -> bytes:
        return f"{name}{format_labels(labels)} ".encode()

    value = staticmethod(_value_end)

    @staticmethod
    def labels(prefix: bytes) -> Labels:
        """The labels of a :meth:`prefix`, unescaped, in their order."""
        text = prefix.decode()
        brace = text.find("{")
        if brace < 0:
            return ()
        return tuple((k, _UNESCAPE.sub(_unescape, v)) for k, v in _LABEL.findall(text, brace + 1))

    @staticmethod
    def slot(value: float) -> tuple[bytes, object]:
        if math.isnan(value):
            return b"%s", b"NaN"
        special = _SPECIAL.get(value)
        if special is not None:
            return b"%s", special
        if value.is_integer() and abs(value) < 1e15:
            return b"%d", value
        return b"%r", value

    @staticmethod
    def kinds(values: Sequence[float]) -> bytes | None:
        """1 where a value takes ``%d``, 0 where ``%r``; ``None`` when some value is not
        finite or is integral beyond 1e15 (C loops only: sum, abs, min, max, is_integer)."""
        if not values:
            return b""
        if not sum(map(abs, values)) < 1e15:  # one C loop for the common case
            total = sum(values)
            if total - total != 0.0 or max(values) >= 1e15 or min(values) <= -1e15:
                return None  # a NaN or infinity (or an overflowing sum), or a huge value
        return bytes(map(float.is_integer, values))


TEXT_LINES: Final = TextLines()
