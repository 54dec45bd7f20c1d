"""A hostile node declaring one series per DECLARE frame: cost per declaration, and /metrics.

Issue 12 measured 4k one-series DECLAREs in 1.0 s and 12k in 8.0 s (an index of the node's
series was rebuilt for every frame: quadratic). This feeds K one-series DECLAREs (and one
value each) through the gateway's ingest in process, for two K, and prints the time per
declaration and the ratio of the totals: 3.0 for K tripled is linear, 9.0 quadratic. Then
the time to build /metrics with that node in it, beside an honest node's 508 series.
"""

from __future__ import annotations

import argparse
import time

from cloud_gateway.exposition.body import Exposition
from cloud_gateway.ingest.session import Ingest
from cloud_gateway.registry.store import Registry
from gpurelay.wire import Batch, Declare, Hello, SeriesDecl


def declare_one_by_one(count: int) -> tuple[float, float]:
    """Seconds for ``count`` one-series DECLAREs (+ a value each), then for one body."""
    ingest = Ingest(Registry(), clock=time.time)
    session = ingest.open_session("evil", "10.0.0.9:1", lambda reason: None)
    session.handle(Hello(agent_version="0", node="evil"))
    started = time.perf_counter()
    for sid in range(count):
        labels = (("gpu", str(sid % 8)), ("i", str(sid)))
        session.handle(
            Declare(series=(SeriesDecl(id=sid, name="m", type="gauge", help="h", labels=labels),))
        )
        session.handle(Batch(seq=sid + 1, timestamp=1.0 + sid, values=((sid, float(sid)),)))
    declared = time.perf_counter() - started
    exposition = Exposition(ingest.registry)
    started = time.perf_counter()
    body = exposition.body(openmetrics=False, gzip=False)
    rendered = time.perf_counter() - started
    assert body.count(b"\nm{") + body.startswith(b"m{") >= count  # every series exposed
    return declared, rendered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=4000)
    parser.add_argument("--factor", type=int, default=3)
    args = parser.parse_args()
    small, large = args.small, args.small * args.factor
    t_small, r_small = declare_one_by_one(small)
    t_large, r_large = declare_one_by_one(large)
    for k, t, r in ((small, t_small, r_small), (large, t_large, r_large)):
        print(
            f"{k:>7} one-series DECLAREs: {t:7.3f} s ({t / k * 1e6:6.1f} us each); "
            f"/metrics then {r * 1000:7.1f} ms"
        )
    ratio = t_large / t_small
    verdict = "linear" if ratio < 1.5 * args.factor else "worse than linear"
    quadratic = args.factor**2
    print(
        f"total x{ratio:.1f} for x{args.factor} the declarations "
        f"({verdict}; quadratic: x{quadratic})"
    )


if __name__ == "__main__":
    main()
