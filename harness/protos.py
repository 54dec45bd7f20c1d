"""The pod-resources stubs, generated from ``edge_agent/podresources/api.proto``.

``make protos`` (``python -m harness.protos``) regenerates them in place with grpcio-tools;
``tests/unit/agent/test_podresources_protos.py`` generates them into a temporary directory and
fails when the committed files differ.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = Path("edge_agent/podresources/api.proto")
GENERATED = tuple(PROTO.with_name(n) for n in ("api_pb2.py", "api_pb2.pyi", "api_pb2_grpc.py"))


def generate(out: Path, root: Path = ROOT) -> tuple[Path, ...]:
    """Write the stubs of ``root``'s proto under ``out`` (same relative paths); return them."""
    from grpc_tools import protoc

    args = [
        "grpc_tools.protoc",
        f"-I{root}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        str(root / PROTO),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {root / PROTO}")
    return tuple(out / p for p in GENERATED)


if __name__ == "__main__":
    for path in generate(ROOT):
        print(f"wrote {path.relative_to(ROOT)}")
    sys.exit(0)
