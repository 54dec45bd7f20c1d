"""``cloud-gateway``: not built yet. It says so and exits non-zero rather than pretend."""

from __future__ import annotations

import sys

NOT_BUILT = (
    "cloud-gateway: the cloud gateway (SSH tunnel server, node registry, unified /metrics, "
    "operator API) is not part of this release yet; only the edge agent is. "
    "Scrape an agent directly at http://<node>:9400/metrics in the meantime."
)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in ("--version", "-V"):
        from cloud_gateway import __version__

        print(f"cloud-gateway {__version__} (not built yet)")
        return 0
    print(NOT_BUILT, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
