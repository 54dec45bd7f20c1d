"""One child process with its log: every test and bench that runs one of our binaries (or
Prometheus) for real starts, watches, measures and stops it the same way."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # children run here: `python -m edge_agent`
STOP_TIMEOUT = 20.0  # SIGTERM to SIGKILL; the gateway drains for drain_seconds first


class HarnessError(AssertionError):
    """A helper could not do what it was asked: a process exited, a wait ran out.

    An AssertionError, so that a test reports it as a failed check with this message; the
    benches print it and exit 1."""


@dataclass(frozen=True)
class ProcSample:
    cpu_seconds: float  # utime + stime, all threads
    rss_kib: int
    peak_rss_kib: int
    system_seconds: float = 0.0  # stime alone: in the kernel on the process's behalf


def clean_env(*prefixes: str) -> dict[str, str]:
    """This environment without the variables that start with ``prefixes`` (those that would
    change a binary's configuration behind its config file's back)."""
    return {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}


class Process:
    """One child process, run from the repository root with stdout and stderr appended to
    ``log``; restartable with the same arguments."""

    def __init__(
        self, name: str, argv: Sequence[str], log: Path, env: Mapping[str, str] | None = None
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log = log
        self.env = dict(os.environ if env is None else env)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                self.argv,
                cwd=ROOT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise HarnessError(f"{self.name} was never started")
        return self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check_alive(self) -> None:
        """Raise HarnessError, with the end of the log, when the process has exited."""
        if self.proc is None:
            raise HarnessError(f"{self.name} was never started")
        if self.proc.poll() is not None:
            raise HarnessError(
                f"{self.name} exited with status {self.proc.returncode}\n{self.tail()}"
            )

    def sample(self) -> ProcSample:
        """CPU time and memory so far, from /proc."""
        stat = Path(f"/proc/{self.pid}/stat").read_text()
        rest = stat[stat.rindex(")") + 2 :].split()  # fields from 3 on; comm may hold spaces
        utime, stime = int(rest[14 - 3]), int(rest[15 - 3])
        memory = {"VmRSS": 0, "VmHWM": 0}
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in memory:
                memory[key] = int(value.split()[0])
        tck = os.sysconf("SC_CLK_TCK")
        return ProcSample((utime + stime) / tck, memory["VmRSS"], memory["VmHWM"], stime / tck)

    stop_signal = signal.SIGTERM  # what asks this process to stop cleanly

    def stop(self, timeout: float = STOP_TIMEOUT) -> int | None:
        """``stop_signal``, wait up to ``timeout``, SIGKILL if it hangs; the exit status
        (None: never started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(self.stop_signal)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode

    def kill9(self) -> None:
        if self.proc is None:
            raise HarnessError(f"{self.name} was never started")
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def tail(self, lines: int = 40) -> str:
        """The last ``lines`` of the log, headed by the process name ("" when unreadable)."""
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return f"--- {self.name} log ({self.log}) ---\n" + "\n".join(text.splitlines()[-lines:])
