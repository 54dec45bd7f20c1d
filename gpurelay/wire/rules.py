"""The naming and size rules a declared series must meet, on both ends (written once).

The agent's encoder refuses what breaks them, the gateway's decoder rejects it, the
record codec leaves such series out; the gateway adds only its own policy (reserved
prefixes) on top."""

from __future__ import annotations

import re
from collections.abc import Set
from typing import Final

from gpurelay.model import Labels
from gpurelay.wire.frames import MAX_SERIES_ID, Limits, SeriesDecl, WireError

METRIC_NAME: Final = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
LABEL_NAME: Final = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


# --- validation shared by both ends ------------------------------------------------------


def show(text: object, limit: int = 60) -> str:
    """A peer-supplied value, quoted and shortened, for an error message."""
    if isinstance(text, str) and len(text) > limit:
        return repr(text[:limit] + "...")
    return repr(text)


def utf8_size(text: str, code: str, what: str) -> int:
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise WireError(code, f"{what} is not valid Unicode text ({exc.reason})") from exc


class Passed:
    """What passed the checks within one DECLARE: a label pair (name, value) and a series
    head (name, type, help) are valid or not whatever series carries them, and a node's
    DECLARE repeats the same GPU's pairs and the same families' heads hundreds of times.
    Made per frame and dropped with it, so a peer cannot grow it past one frame."""

    __slots__ = ("heads", "pairs")

    def __init__(self) -> None:
        self.heads: set[tuple[str, str, str]] = set()
        self.pairs: set[tuple[str, str]] = set()


NONE_PASSED: Final[frozenset[tuple[str, str]]] = frozenset()


def _known_pair(pair: object, done: Set[tuple[str, str]]) -> bool:
    try:
        return type(pair) is tuple and pair in done
    except TypeError:  # a part that cannot be hashed is not a string
        return False


def check_series(decl: SeriesDecl, limits: Limits, done: Passed | None = None) -> None:
    """Raise :class:`WireError` unless ``decl`` is a declaration the gateway will accept.
    ``done``: what passed earlier in the same frame (under the same limits), skipped."""
    sid = decl.id
    labels = decl.labels
    if (
        done is not None
        and type(sid) is int
        and 0 <= sid <= MAX_SERIES_ID
        and type(labels) is tuple
    ):
        try:  # the fast path: every part was checked before (an unhashable part: not so)
            if (
                (decl.name, decl.type, decl.help) in done.heads
                and len(labels) <= limits.max_labels
                and done.pairs.issuperset(labels)  # only 2-tuples of str are in it
                and len(dict(labels)) == len(labels)  # no label name twice
            ):
                return
        except TypeError:
            pass
    if type(sid) is not int or not 0 <= sid <= MAX_SERIES_ID:
        raise WireError(
            "malformed", f"series id {show(sid)} is not an integer in 0..{MAX_SERIES_ID}"
        )
    name = decl.name
    if not isinstance(name, str) or METRIC_NAME.fullmatch(name) is None:
        raise WireError(
            "bad_name",
            f"series {sid}: metric name {show(name)} is not valid "
            "(it must match [a-zA-Z_:][a-zA-Z0-9_:]*)",
        )
    if len(name) > limits.max_name_bytes:
        raise WireError(
            "bad_name",
            f"series {sid}: metric name {show(name)} is {len(name)} bytes long, "
            f"more than the limit of {limits.max_name_bytes}",
        )
    if decl.type not in ("gauge", "counter"):
        raise WireError(
            "malformed", f"series {sid} ({name}): type {show(decl.type)} is not gauge or counter"
        )
    if not isinstance(decl.help, str):
        raise WireError("malformed", f"series {sid} ({name}): help is not a string")
    size = utf8_size(decl.help, "malformed", f"series {sid} ({name}): help")
    if size > limits.max_help_bytes:
        raise WireError(
            "malformed",
            f"series {sid} ({name}): help is {size} bytes long, "
            f"more than the limit of {limits.max_help_bytes}",
        )
    check_labels(sid, name, decl.labels, limits, NONE_PASSED if done is None else done.pairs)
    if done is not None:
        done.heads.add((name, decl.type, decl.help))
        done.pairs.update(decl.labels)


def check_labels(
    sid: int, name: str, labels: Labels, limits: Limits, known: Set[tuple[str, str]]
) -> None:
    where = f"series {sid} ({name})"
    if not isinstance(labels, tuple):
        raise WireError("malformed", f"{where}: labels are not a sequence of (name, value) pairs")
    if len(labels) > limits.max_labels:
        raise WireError(
            "too_many_labels",
            f"{where} has {len(labels)} labels, more than the limit of {limits.max_labels}",
        )
    seen: set[str] = set()
    for pair in labels:
        if _known_pair(pair, known):  # this (name, value) was checked before
            if pair[0] in seen:
                raise WireError("bad_label", f"{where}: label {pair[0]} is given twice")
            seen.add(pair[0])
            continue
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise WireError("malformed", f"{where}: label {show(pair)} is not a (name, value) pair")
        label, value = pair
        if (
            not isinstance(label, str)
            or LABEL_NAME.fullmatch(label) is None
            or label.startswith("__")
        ):
            raise WireError(
                "bad_label",
                f"{where}: label name {show(label)} is not valid (it must match "
                "[a-zA-Z_][a-zA-Z0-9_]* and not start with __, which Prometheus reserves)",
            )
        if len(label) > limits.max_name_bytes:
            raise WireError(
                "bad_label",
                f"{where}: label name {show(label)} is {len(label)} bytes long, "
                f"more than the limit of {limits.max_name_bytes}",
            )
        if label in seen:
            raise WireError("bad_label", f"{where}: label {label} is given twice")
        seen.add(label)
        if not isinstance(value, str):
            raise WireError("bad_label", f"{where}: the value of label {label} is not a string")
        size = utf8_size(value, "bad_label", f"{where}: the value of label {label}")
        if size > limits.max_label_value_bytes:
            raise WireError(
                "bad_label",
                f"{where}: the value of label {label} is {size} bytes long, "
                f"more than the limit of {limits.max_label_value_bytes}",
            )
