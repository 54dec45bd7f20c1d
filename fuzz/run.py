"""Run the fuzz targets one after another and report, per target: executions, coverage
(libFuzzer's ``cov`` and ``ft``), corpus size, crashes, slowest input and peak RSS.

    python fuzz/run.py [--seconds N] [--workdir DIR] [TARGET ...]

``make fuzz`` runs every target for ``FUZZ_SECONDS`` (600) each, keeping what it learns in
``build/fuzz/<target>/corpus`` for the next run; ``tests/test_fuzz_short.py`` runs each for
a few seconds from the seeds alone. The seeds (``seeds.py``) are written afresh each run. A
crash stops its target (libFuzzer's default): the input is left as
``DIR/<target>/crash-*`` (or ``oom-*``, ``timeout-*``), the traceback is printed, and the
exit status is 1. Replay one with ``python fuzz/<target>.py DIR/<target>/crash-...``.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
TARGETS = ("frames", "records", "proxy_http", "ingest", "agent_http")
ARTIFACTS = ("crash-", "oom-", "timeout-", "leak-")
# An input slower than this is a finding (a timeout-* artifact): the gateway decodes on
# its event loop. Memory beyond this is one too: nothing may allocate without bound.
TIMEOUT_SECONDS = 10
RSS_LIMIT_MB = 1024
_STATUS = re.compile(r"#(\d+)\s+\w+\s+cov: (\d+) ft: (\d+) corp: (\d+)/")
_STAT = re.compile(r"stat::(\w+):\s+(\d+)")


@dataclass(frozen=True, slots=True)
class Result:
    target: str
    seconds: float
    executions: int
    cov: int
    ft: int
    corpus: int
    crashes: list[Path]
    slowest_seconds: int
    peak_rss_mb: int
    returncode: int
    log: Path

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.crashes

    def line(self) -> str:
        rate = self.executions / self.seconds if self.seconds else 0.0
        return (
            f"{self.target:<11} {self.executions:>10} executions in {self.seconds:4.0f} s "
            f"({rate:6.0f}/s)  cov {self.cov:>5}  ft {self.ft:>6}  corpus {self.corpus:>5}  "
            f"crashes {len(self.crashes)}  slowest {self.slowest_seconds} s  "
            f"peak RSS {self.peak_rss_mb} MB"
        )


def fuzz(target: str, seconds: int, workdir: Path, seeds: Path) -> Result:
    folder = workdir / target
    corpus = folder / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    before = set(folder.iterdir())
    log = folder / "fuzz.log"
    command = [
        sys.executable,
        str(HERE / f"{target}.py"),
        f"-max_total_time={seconds}",
        f"-timeout={TIMEOUT_SECONDS}",
        f"-rss_limit_mb={RSS_LIMIT_MB}",
        "-print_final_stats=1",
        f"-artifact_prefix={folder}/",
        str(corpus),
        str(seeds / target),
    ]
    started = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False)
    elapsed = time.monotonic() - started
    text = log.read_text(errors="replace")
    status = _STATUS.findall(text)
    stats = {name: int(value) for name, value in _STAT.findall(text)}
    executions, cov, ft, units = (int(v) for v in status[-1]) if status else (0, 0, 0, 0)
    crashes = sorted(p for p in set(folder.iterdir()) - before if p.name.startswith(ARTIFACTS))
    return Result(
        target=target,
        seconds=elapsed,
        executions=stats.get("number_of_executed_units", executions),
        cov=cov,
        ft=ft,
        corpus=units,
        crashes=crashes,
        slowest_seconds=stats.get("slowest_unit_time_sec", 0),
        peak_rss_mb=stats.get("peak_rss_mb", 0),
        returncode=proc.returncode,
        log=log,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("targets", nargs="*", default=list(TARGETS), metavar="TARGET")
    parser.add_argument("--seconds", type=int, default=600, help="per target (default 600)")
    parser.add_argument("--workdir", type=Path, default=Path("build/fuzz"))
    args = parser.parse_args(argv)
    unknown = sorted(set(args.targets) - set(TARGETS))
    if unknown:
        parser.error(f"unknown target(s) {unknown}; known: {', '.join(TARGETS)}")
    workdir: Path = args.workdir.resolve()
    seeds = workdir / "seeds"
    shutil.rmtree(seeds, ignore_errors=True)
    subprocess.run(
        [sys.executable, str(HERE / "seeds.py"), str(seeds)], check=True, stdout=subprocess.DEVNULL
    )
    results = []
    for target in args.targets:
        print(f"fuzzing {target} for {args.seconds} s ...", flush=True)
        result = fuzz(target, args.seconds, workdir, seeds)
        results.append(result)
        if not result.ok:
            tail = result.log.read_text(errors="replace").splitlines()[-60:]
            print("\n".join(tail), flush=True)
            found = ", ".join(str(p) for p in result.crashes) or "none written"
            print(f"{target} FAILED (exit {result.returncode}); input: {found}", flush=True)
    print()
    for result in results:
        print(result.line())
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
