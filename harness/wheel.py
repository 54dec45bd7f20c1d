"""This repository as pip sees it, for tests that install it somewhere else (the installer,
a Python 3.10 venv): a copy of what the wheel ships (the checkout stays untouched by the
builds), and a wheel built from it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHIPPED = ("gpurelay", "edge_agent", "cloud_gateway")  # pyproject.toml's packages


def copy_source(dest: Path) -> Path:
    """``pyproject.toml``, ``README.md`` and the shipped packages, copied into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, dest / name)
    for package in SHIPPED:
        shutil.copytree(
            REPO / package, dest / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    return dest


def build_wheel(src: Path, out: Path) -> Path:
    """The wheel of ``src`` (a :func:`copy_source`), without dependencies, in ``out``."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, "building a wheel of the repository failed:\n" + proc.stderr
    (found,) = out.glob("edge_gpu_relay-*.whl")
    return found
