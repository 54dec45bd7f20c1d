"""A real uplink for fault tests: the agent in its own network namespace, a router namespace
in the middle that can make the link silent or lossy, the gateway in the root namespace.

::

    edge ns (agent)            router ns (middlebox)              root ns (test, gateway)
    198.18.X.2/30 ──veth── 198.18.X.1/30 | 198.18.X.5/30 ──veth── 198.18.X.6/30 = gateway_host
    default via .1         ip_forward=1, iptables FORWARD         route X.0/30 via .5

:meth:`Uplink.silence`, :meth:`Uplink.lossy` and :meth:`Uplink.restore` change only the
router's FORWARD chain: packets vanish in the middle, in both directions, as on a dead
uplink. Neither endpoint sees an error (no EPERM from a local OUTPUT drop, no RST, no ICMP);
ARP still works; a connect attempt just times out and an established TCP connection
retransmits with a growing RTO. Needs root, ``ip`` (iproute2) and ``iptables`` with the
``statistic`` match; :func:`netns_unavailable` says why not where it cannot run.

Every name starts with ``grl<pid>n<k>`` (the owning process's pid, a counter): the context
manager and an atexit hook remove what an Uplink made, and :func:`sweep_stale` (called on
every setup) removes what a process that died without cleaning up left behind."""

from __future__ import annotations

import atexit
import contextlib
import functools
import ipaddress
import itertools
import logging
import os
import re
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType

from harness.process import HarnessError

log = logging.getLogger(__name__)

TIMEOUT = 10.0  # seconds, each ip / iptables command
RANGE = ipaddress.ip_network("198.18.0.0/15")  # RFC 2544 benchmarking range
_NAME = re.compile(r"grl(\d+)n(\d+)[a-z]")
_IFNAMSIZ = 15  # the longest interface name Linux takes
_counter = itertools.count()


class NetnsError(HarnessError):
    """An ``ip`` or ``iptables`` command failed or timed out."""


@dataclass(frozen=True)
class LinkCounters:
    """Packets the router saw going through (both directions) and those it dropped, since
    the last :meth:`Uplink.silence`, :meth:`Uplink.lossy` or :meth:`Uplink.restore`."""

    seen: int
    dropped: int


def _run(
    argv: Sequence[str], *, timeout: float = TIMEOUT, check: bool = True
) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise NetnsError(f"`{' '.join(argv)}` timed out after {timeout:g}s") from exc
    except OSError as exc:
        raise NetnsError(f"`{' '.join(argv)}` could not run: {exc}") from exc
    if check and proc.returncode != 0:
        why = proc.stderr.strip() or proc.stdout.strip() or "no output"
        raise NetnsError(f"`{' '.join(argv)}` exited with status {proc.returncode}: {why}")
    return proc


def _iptables(ns: str, *args: str) -> subprocess.CompletedProcess[str]:
    # -w: wait for the xtables lock (legacy iptables shares it across namespaces)
    return _run(["ip", "netns", "exec", ns, "iptables", "-w", "5", *args])


def _new_stem() -> str:
    return f"grl{os.getpid()}n{next(_counter) % 1000}"


@functools.cache
def netns_unavailable() -> str | None:
    """Why an :class:`Uplink` cannot be built here, or None when it can (probed once per
    process: a namespace with a veth pair and a ``-m statistic`` rule, then removed)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN and CAP_SYS_ADMIN)"
    for tool, package in (("ip", "iproute2"), ("iptables", "iptables")):
        try:
            _run([tool, "-V"], timeout=5, check=False)
        except NetnsError:
            return f"{tool} not found (Debian package `{package}`)"
    probe = _new_stem() + "p"
    try:
        _run(["ip", "netns", "add", probe])
    except NetnsError as exc:
        return f"cannot create a network namespace: {exc}"
    try:
        _run(["ip", "-n", probe, "link", "add", "name", "v0", "type", "veth", "peer", "name", "v1"])
        _iptables(
            probe, "-A", "FORWARD", "-m", "statistic", "--mode", "random",
            "--probability", "0.5", "-j", "DROP",
        )  # fmt: skip
    except NetnsError as exc:
        return f"veth or iptables `-m statistic` unusable: {exc}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _root_links() -> list[str]:
    """Interface names in the root namespace (``ip -o link``: ``7: name@peer: <...>``)."""
    out = _run(["ip", "-o", "link", "show"]).stdout
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]


def _ours(name: str, alive: bool) -> bool:
    match = _NAME.fullmatch(name)
    return match is not None and _pid_alive(int(match.group(1))) == alive


def leftovers(pid: int | None = None) -> list[str]:
    """Namespaces and root-namespace interfaces named ``grl<pid>...`` (``pid`` None: any)."""
    names = _namespaces() + _root_links()
    return [
        n for n in names if (m := _NAME.fullmatch(n)) and (pid is None or int(m.group(1)) == pid)
    ]


def sweep_stale() -> list[str]:
    """Remove the namespaces and interfaces left by Uplinks of processes no longer alive
    (a process killed before its cleanup ran); returns their names. A dead owner's pid
    that the kernel has since reused hides its leftovers until that process exits."""
    removed = []
    for ns in _namespaces():
        if _ours(ns, alive=False):
            _kill_inside(ns)
            _run(["ip", "netns", "del", ns], check=False)
            removed.append(ns)
    for link in _root_links():
        if _ours(link, alive=False):
            _run(["ip", "link", "del", link], check=False)
            removed.append(link)
    return removed


def _kill_inside(ns: str) -> None:
    """SIGKILL what still runs inside ``ns``: a process keeps its namespace alive after the
    name is deleted, and would go on dialling a gateway it can never reach."""
    proc = _run(["ip", "netns", "pids", ns], check=False)
    for word in proc.stdout.split():
        if word.isdigit() and int(word) != os.getpid():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(word), signal.SIGKILL)


def _used_subnets() -> set[int]:
    """The X of every 198.18.X.0/24 that an address or route here already touches."""
    used: set[int] = set()
    texts = [_run(["ip", "-4", "-o", "addr"]).stdout, _run(["ip", "-4", "route"]).stdout]
    for word in " ".join(texts).split():
        try:
            net = ipaddress.ip_network(word, strict=False)
        except ValueError:
            continue
        if not isinstance(net, ipaddress.IPv4Network) or net.prefixlen < 15:
            continue  # a default route, or a wide one that more specific routes override
        if not net.overlaps(RANGE):
            continue
        for x in range(256):
            if net.overlaps(ipaddress.ip_network(f"198.18.{x}.0/24")):
                used.add(x)
    return used


class Uplink:
    """The edge namespace behind a router namespace; see the module docstring.

    ``with Uplink() as link:`` builds it and removes it on every way out (also at interpreter
    exit). Start the agent with ``link.prefix`` before its argv and point it at
    ``link.gateway_host``, where the gateway's SSH listener binds."""

    def __init__(self) -> None:
        stem = _new_stem()
        self.edge = stem + "e"  # namespaces
        self.router = stem + "r"
        self._links = {k: stem + k for k in "abcd"}  # a: edge | b-c: router | d: root
        for name in self._links.values():
            if len(name) > _IFNAMSIZ:
                raise NetnsError(f"interface name {name} is longer than {_IFNAMSIZ}")
        self._subnet: int | None = None
        self._open = False

    @property
    def prefix(self) -> list[str]:
        """Put before an argv to run it inside the edge namespace (``ip netns exec`` execs
        it: the child's pid is the command's)."""
        return ["ip", "netns", "exec", self.edge]

    @property
    def gateway_host(self) -> str:
        """The root-namespace address of the test veth: the edge can reach this one only."""
        return self._addr(6)

    @property
    def edge_host(self) -> str:
        """The agent's address, as the gateway sees it."""
        return self._addr(2)

    @property
    def names(self) -> list[str]:
        """The namespaces and interfaces this uplink owns."""
        return [self.edge, self.router, *self._links.values()]

    def _addr(self, host: int) -> str:
        if self._subnet is None:
            raise NetnsError("the uplink is not set up (use it as a context manager)")
        return f"198.18.{self._subnet}.{host}"

    def __enter__(self) -> Uplink:
        self.open()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.close()
        except NetnsError:
            if exc is None:
                raise
            log.warning("uplink cleanup failed while handling %r", exc, exc_info=True)

    def open(self) -> None:
        if self._open:
            return
        reason = netns_unavailable()
        if reason is not None:
            raise NetnsError(f"no network namespaces here: {reason}")
        sweep_stale()
        free = sorted(set(range(256)) - _used_subnets())
        if not free:
            raise NetnsError(f"no free /24 left in {RANGE}")
        # another process's uplink would show up in the routes; where two start at once,
        # their pids most likely pick different subnets
        self._subnet = free[os.getpid() % len(free)]
        self._open = True
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        e, r = self.edge, self.router
        a, b, c, d = (self._links[k] for k in "abcd")
        net = self._addr
        _run(["ip", "netns", "add", e])
        _run(["ip", "netns", "add", r])
        _run(["ip", "link", "add", "name", a, "netns", e, "type", "veth",
              "peer", "name", b, "netns", r])  # fmt: skip
        _run(["ip", "link", "add", "name", c, "netns", r, "type", "veth", "peer", "name", d])
        for ns, dev, addr in ((e, a, 2), (r, b, 1), (r, c, 5)):
            _run(["ip", "-n", ns, "addr", "add", f"{net(addr)}/30", "dev", dev])
            _run(["ip", "-n", ns, "link", "set", dev, "up"])
        for ns in (e, r):
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        _run(["ip", "-n", e, "route", "add", "default", "via", net(1)])
        _run(["ip", "netns", "exec", r, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"])
        _run(["ip", "addr", "add", f"{net(6)}/30", "dev", d])
        _run(["ip", "link", "set", d, "up"])
        # the route goes with the interface
        _run(["ip", "route", "add", f"{net(0)}/30", "via", net(5), "dev", d])
        self.restore()

    def close(self) -> None:
        """Remove both namespaces (killing what still runs in them) and the root-side
        veth; idempotent. Raises NetnsError if something is still there afterwards."""
        if not self._open:
            return
        self._open = False
        atexit.unregister(self.close)
        for ns in (self.edge, self.router):
            if ns in _namespaces():
                _kill_inside(ns)
                _run(["ip", "netns", "del", ns], check=False)
        root_side = self._links["d"]
        # deleting the router namespace destroys the pair, but the root-side peer goes
        # asynchronously: give it a moment, then delete it ourselves
        deadline = time.monotonic() + 2.0
        while root_side in _root_links() and time.monotonic() < deadline:
            time.sleep(0.05)
        if root_side in _root_links():
            _run(["ip", "link", "del", root_side], check=False)
        left = [n for n in _namespaces() + _root_links() if n in self.names]
        if left:
            raise NetnsError(f"uplink cleanup left {left}")

    # The middlebox: rule 1 of the router's FORWARD chain counts every packet (no target),
    # rule 2, when present, drops.

    def _set(self, drop_match: Sequence[str] | None) -> None:
        """Flush the chain (zeroing the counters), put the counting rule back, and a rule
        dropping what ``drop_match`` matches (None: no drop rule; empty: everything)."""
        self._router_iptables("-F", "FORWARD")
        self._router_iptables("-A", "FORWARD")
        if drop_match is not None:
            self._router_iptables("-A", "FORWARD", *drop_match, "-j", "DROP")

    def _router_iptables(self, *args: str) -> str:
        if not self._open:
            raise NetnsError("the uplink is closed")
        return _iptables(self.router, *args).stdout

    def silence(self) -> None:
        """Drop every packet between the edge and the root namespace, both ways."""
        self._set(())

    def lossy(self, probability: float) -> None:
        """Drop each packet, either way, with ``probability`` (independently)."""
        if not 0.0 < probability <= 1.0:
            raise ValueError(f"probability {probability} is not in (0, 1]")
        self._set(("-m", "statistic", "--mode", "random", "--probability", f"{probability}"))

    def drop_every(self, n: int) -> None:
        """Drop every ``n``-th packet, either way (a share of 1/n, never two in a row):
        loss without the rare long runs of random loss, in which a retransmission is lost
        again and again and TCP's doubling timeout stalls the connection for many seconds
        (with 20 % random loss, a stall past a node's offline threshold now and then)."""
        if n < 2:
            raise ValueError(f"every {n}th packet is not a lossy link")
        self._set(("-m", "statistic", "--mode", "nth", "--every", str(n), "--packet", "0"))

    def restore(self) -> None:
        """Forward everything again."""
        self._set(None)

    def counters(self) -> LinkCounters:
        """Packets seen and dropped in the middle since the last change of mode."""
        out = self._router_iptables("-L", "FORWARD", "-n", "-v", "-x", "--line-numbers")
        packets = {}
        for line in out.splitlines():
            fields = line.split()
            if len(fields) >= 2 and fields[0].isdigit():
                packets[int(fields[0])] = int(fields[1])
        return LinkCounters(seen=packets.get(1, 0), dropped=packets.get(2, 0))

    def dropped(self) -> int:
        return self.counters().dropped
