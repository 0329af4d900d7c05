"""The committed gRPC stubs match the .proto (regenerate: `python -m protos.generate`)."""

from __future__ import annotations

import re
from pathlib import Path

from protos.generate import PROTO_FILES, REPO_ROOT, generate

# Version stamps of the compiler that wrote the files; a different grpcio-tools may differ here
# without the stubs being stale.
VERSION_STAMPS = [
    re.compile(r"^# Protobuf Python Version: .*$", re.M),
    re.compile(r"^_runtime_version\.ValidateProtobufRuntimeVersion\([^)]*\)$", re.M),
    re.compile(r"^GRPC_GENERATED_VERSION = .*$", re.M),
]


def _normalized(text: str) -> str:
    for stamp in VERSION_STAMPS:
        text = stamp.sub("<version>", text)
    return text


def test_committed_stubs_are_up_to_date(tmp_path):
    written = generate(tmp_path)
    assert len(written) == 3 * len(PROTO_FILES)
    for fresh in written:
        committed = REPO_ROOT / fresh.relative_to(tmp_path)
        assert committed.exists(), f"{committed} is missing: run `python -m protos.generate`"
        assert _normalized(committed.read_text()) == _normalized(fresh.read_text()), (
            f"{committed} is stale: run `python -m protos.generate` and commit the result")


def test_stubs_import_as_a_package():
    from protos.splitserve.v1 import splitserve_pb2, splitserve_pb2_grpc

    assert splitserve_pb2.DESCRIPTOR.package == "splitserve.v1"
    assert hasattr(splitserve_pb2_grpc, "SplitServeStub")
    for parent in (Path(splitserve_pb2.__file__).parent, Path(splitserve_pb2.__file__).parent.parent):
        assert (parent / "__init__.py").exists()
