"""Which Jetson this is: the module's model, SoC and part number, the L4T release and the
JetPack it belongs to.

Sources (docs/jetson.md):

- the device tree, ``/sys/firmware/devicetree/base`` (``/proc/device-tree`` is an absolute
  symlink to it, which a pod that mounts the host's ``/`` elsewhere cannot follow as it
  is: :func:`~edge_agent.jetson.files.rooted` follows it under the host's root);
- ``/proc/device-tree/model``: the model string, NUL-terminated ("NVIDIA Jetson AGX Orin
  Developer Kit");
- ``/proc/device-tree/compatible``: NUL-separated, most specific first
  (``nvidia,p3737-0000+p3701-0005``, ``nvidia,tegra234``): carrier + module part numbers,
  then the SoC;
- ``/proc/device-tree/serial-number``: the module's serial number, NUL-terminated;
- ``/etc/nv_tegra_release``: ``# R35 (release), REVISION: 4.1, GCID: ..., BOARD: ...``, the
  L4T release 35.4.1 (R32.5 wrote ``REVISION: 5``: release 32.5).
- the nvpmodel power mode: ``/var/lib/nvpmodel/status`` (``pmode:0002 fmode:...``, what
  ``nvpmodel -m`` last set and keeps across boots), else ``< PM_CONFIG DEFAULT=2 >`` of
  ``/etc/nvpmodel.conf`` (the boot default, when no mode was ever set); the mode's name
  from that file's ``< POWER_MODEL ID=2 NAME=15W >``. ``nvpmodel -q`` prints the same
  two, but needs root on some releases and a binary in the container.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from edge_agent.jetson.files import Missing, read_bytes, read_text, rooted

# L4T release -> JetPack, as NVIDIA's release notes pair them (the releases an agent on
# Python >= 3.8 meets: JetPack 5 and later; JetPack 4 only to name older boards).
JETPACK: dict[str, str] = {
    "32.7.4": "4.6.4",
    "32.7.5": "4.6.5",
    "32.7.6": "4.6.6",
    "35.1.0": "5.0.2",
    "35.2.1": "5.1",
    "35.3.1": "5.1.1",
    "35.4.1": "5.1.2",
    "35.5.0": "5.1.3",
    "35.6.0": "5.1.4",
    "35.6.1": "5.1.5",
    "35.6.2": "5.1.5",
    "35.6.3": "5.1.5",
    "35.6.4": "5.1.6",
    "36.2.0": "6.0 DP",
    "36.3.0": "6.0",
    "36.4.0": "6.1",
    "36.4.3": "6.2",
    "36.4.4": "6.2.1",
    "36.4.7": "6.2.1",
    "36.5.0": "6.2.2",
}
# Module part number (compatible's "+p<module>") -> what NVIDIA sells it as
MODULES: dict[str, str] = {
    "p3701-0000": "Jetson AGX Orin",
    "p3701-0004": "Jetson AGX Orin 32GB",
    "p3701-0005": "Jetson AGX Orin 64GB",
    "p3767-0000": "Jetson Orin NX 16GB",
    "p3767-0001": "Jetson Orin NX 8GB",
    "p3767-0003": "Jetson Orin Nano 8GB",
    "p3767-0004": "Jetson Orin Nano 4GB",
    "p3767-0005": "Jetson Orin Nano Developer Kit",
    "p2888-0001": "Jetson AGX Xavier 16GB",
    "p2888-0004": "Jetson AGX Xavier 32GB",
    "p2888-0005": "Jetson AGX Xavier 64GB",
    "p3668-0000": "Jetson Xavier NX Developer Kit",
    "p3668-0001": "Jetson Xavier NX",
    "p3448-0000": "Jetson Nano 4GB",
}
# SoC (compatible's "nvidia,tegraNNN") -> family
SOCS: dict[str, str] = {
    "tegra234": "Orin",
    "tegra194": "Xavier",
    "tegra186": "TX2",
    "tegra210": "TX1/Nano",
}
_PMODE = re.compile(r"pmode:0*(\d+)")
_DEFAULT_MODE = re.compile(r"<\s*PM_CONFIG\s+DEFAULT=(\d+)\s*>")
_MODE_NAME = re.compile(r"<\s*POWER_MODEL\s+ID=(\d+)\s+NAME=([^\s>]+)")
_RELEASE = re.compile(r"#\s*R(\d+)\s*\(release\),\s*REVISION:\s*([\d.]+)")
_MODULE = re.compile(r"\+(p\d{4}-\d{4})")


@dataclass(frozen=True, slots=True)
class Board:
    model: str  # the device tree's model string ("" unknown)
    soc: str  # tegra234, ... ("" unknown)
    module: str  # the module's part number, p3701-0005 ("" unknown)
    l4t: str  # 35.4.1 ("" unknown)
    missing: tuple[Missing, ...] = field(default=())
    serial: str = ""  # the device tree's serial-number ("" unknown)

    @property
    def known(self) -> bool:
        """A Jetson this agent knows the SoC of (others are read, and said to be unknown)."""
        return self.soc in SOCS

    @property
    def jetpack(self) -> str:
        return JETPACK.get(self.l4t, "")

    @property
    def module_name(self) -> str:
        """What NVIDIA sells the module as, else the model string."""
        return MODULES.get(self.module, self.model)


def parse_release(text: str) -> str:
    """``# R35 (release), REVISION: 4.1, ...`` -> ``35.4.1`` ("" if not that format)."""
    m = _RELEASE.search(text)
    return f"{m.group(1)}.{m.group(2)}" if m else ""


def device_tree(proc_root: Path, sys_root: Path) -> Path:
    """Where the device tree is: the firmware's own directory, else ``/proc/device-tree``
    (older kernels), its symlink followed under the host's root."""
    firmware = sys_root / "firmware" / "devicetree" / "base"
    if firmware.is_dir():
        return firmware
    return rooted(proc_root.parent, proc_root / "device-tree")


def read_board(proc_root: Path, etc_root: Path, sys_root: Path | None = None) -> Board:
    """``sys_root``: default ``proc_root``'s sibling ``sys/`` (the host's, as
    :meth:`~edge_agent.jetson.files.JetsonRoots.under` lays them out)."""
    missing: list[Missing] = []
    tree = device_tree(proc_root, sys_root if sys_root is not None else proc_root.parent / "sys")
    model = read_text(tree / "model")
    if isinstance(model, Missing):
        missing.append(model)
        model = ""
    compatible_path = tree / "compatible"
    raw = read_bytes(compatible_path)
    compatible: list[str] = []
    if isinstance(raw, Missing):
        missing.append(raw)
    else:
        compatible = [c for c in raw.decode("utf-8", "replace").split("\x00") if c]
    soc = next((c.split(",", 1)[1] for c in compatible if c.startswith("nvidia,tegra")), "")
    module = next((m.group(1) for c in compatible if (m := _MODULE.search(c))), "")
    release_path = rooted(etc_root.parent, etc_root / "nv_tegra_release")
    release = read_text(release_path)
    if isinstance(release, Missing):
        missing.append(release)
        l4t = ""
    else:
        l4t = parse_release(release)
        if not l4t:
            missing.append(Missing(release_path, f"not an L4T release line: {release[:60]!r}"))
    serial = read_text(tree / "serial-number")
    if isinstance(serial, Missing):
        missing.append(serial)
        serial = ""
    return Board(model, soc, module, l4t, tuple(missing), serial)


@dataclass(frozen=True, slots=True)
class PowerMode:
    id: str  # "0"
    name: str  # "MAXN" ("" where nvpmodel.conf does not name it)
    source: str  # "status" (set by nvpmodel -m) or "default" (nvpmodel.conf's boot default)


def read_power_mode(etc_root: Path, var_root: Path) -> PowerMode | Missing:
    """The nvpmodel mode in force and its name, or why not known."""
    conf_path = rooted(etc_root.parent, etc_root / "nvpmodel.conf")  # L4T: a symlink
    conf = read_text(conf_path, first_line=False)
    names = {} if isinstance(conf, Missing) else dict(_MODE_NAME.findall(conf))
    status_path = rooted(var_root.parent, var_root / "lib" / "nvpmodel" / "status")
    status = read_text(status_path)
    if not isinstance(status, Missing) and (m := _PMODE.search(status)):
        mode, source = str(int(m.group(1))), "status"
    elif isinstance(conf, Missing):
        if isinstance(status, Missing):
            return conf
        return Missing(conf_path, f"{conf.reason}, and {status_path} has no pmode: {status[:40]!r}")
    elif m := _DEFAULT_MODE.search(conf):
        mode, source = m.group(1), "default"
    else:
        return Missing(conf_path, "no PM_CONFIG DEFAULT line, and no nvpmodel status")
    return PowerMode(mode, names.get(mode, ""), source)
