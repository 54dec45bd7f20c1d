"""docs/operator-guide.md, "Enrolling nodes and renewing certificates": the [enroll] table
is the code's (every key of EnrollConfig with its real default, nothing else), and the
example loads with the real config loader."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import tomllib

from cloud_gateway import config as gateway_config
from cloud_gateway.trust.config import EnrollConfig

GUIDE = Path(__file__).resolve().parents[4] / "docs" / "operator-guide.md"
SECTION = "## Enrolling nodes and renewing certificates\n"
ROW = re.compile(r"^\| `(\w+)` \| `([^`]*)` \|", re.MULTILINE)


def section() -> str:
    text = GUIDE.read_text(encoding="utf-8")
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return text[start : end if end >= 0 else None]


def test_every_enroll_key_is_documented_with_its_default() -> None:
    documented = dict(ROW.findall(section()))
    assert set(documented) == {f.name for f in dataclasses.fields(EnrollConfig)}
    defaults = EnrollConfig()
    for key, shown in documented.items():
        value = getattr(defaults, key)
        if isinstance(value, bool):
            assert shown == str(value).lower(), key
        elif isinstance(value, str):
            assert shown == '""' and value == "", key
        else:
            assert int(shown) == value, key


def test_the_example_loads(tmp_path: Path) -> None:
    block = re.findall(r"```toml\n(.*?)```", section(), re.DOTALL)[0]
    config = tmp_path / "gateway.toml"
    config.write_text(block)
    enroll = gateway_config.load(config, {}).enroll
    assert enroll.enabled and enroll == EnrollConfig(**tomllib.loads(block)["enroll"])
