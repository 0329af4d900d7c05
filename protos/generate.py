"""Regenerate the Python stubs from the .proto files: `python -m protos.generate`.

The .proto files are compiled with the repository root as the include path, so the generated
modules import each other as `protos.splitserve.v1...` and work from an installed package.
The output is committed; tests/test_api_stubs.py fails when it is stale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_FILES = ["protos/splitserve/v1/splitserve.proto"]


def generate(out_dir: Path = REPO_ROOT) -> list[Path]:
    """Compile every proto into out_dir (mirroring its path); returns the files written."""
    import grpc_tools
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = ["grpc_tools.protoc", f"-I{REPO_ROOT}", f"-I{well_known}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *PROTO_FILES]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    written = []
    for proto in PROTO_FILES:
        stem = out_dir / proto[: -len(".proto")]
        written += [stem.with_name(stem.name + suffix) for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m protos.generate", description=__doc__)
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="output root (default: the repository)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
