"""The checked-in specwire/v1 code is what proto/generate.sh makes from proto/specwire/v1/*.proto.

The installed grpcio-tools may be newer than the pinned one that generated the files (see proto/generate.sh).
The test stays pin-aware instead of skipping: the *_pb2 files depend only on protoc's version, so they are
compared byte for byte when it matches; the *_grpc files differ only in the recorded grpcio version, which is
normalised before comparing.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("grpc_tools", reason="grpcio-tools is a test dependency (pip install -e .[test])")

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ROOT / "specwire" / "v1"
PROTOS = sorted((ROOT / "proto" / "specwire" / "v1").glob("*.proto"))
_GRPC_VERSION = re.compile(r"GRPC_GENERATED_VERSION = '([^']+)'")
_PROTOBUF_VERSION = re.compile(r"# Protobuf Python Version: (\S+)")


def _regenerate(out: Path) -> None:
    cmd = [sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'proto'}", f"--python_out={out}",
           f"--grpc_python_out={out}", f"--pyi_out={out}", *map(str, PROTOS)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def test_generated_code_matches_protos(tmp_path):
    assert [p.name for p in PROTOS] == ["drafter.proto", "frontend.proto", "generation.proto"]
    _regenerate(tmp_path)
    fresh_dir = tmp_path / "specwire" / "v1"
    for proto in PROTOS:
        stem = proto.stem
        checked_pb2 = (GENERATED / f"{stem}_pb2.py").read_text()
        fresh_pb2 = (fresh_dir / f"{stem}_pb2.py").read_text()
        checked_protoc = _PROTOBUF_VERSION.search(checked_pb2).group(1)
        fresh_protoc = _PROTOBUF_VERSION.search(fresh_pb2).group(1)
        if checked_protoc != fresh_protoc:
            pytest.skip(f"installed grpcio-tools bundles protobuf {fresh_protoc}, the checked-in code's is "
                        f"{checked_protoc}: bytes cannot match; regenerate per proto/generate.sh")
        for suffix in ("_pb2.py", "_pb2.pyi"):
            fresh = (fresh_dir / f"{stem}{suffix}").read_text()
            assert (GENERATED / f"{stem}{suffix}").read_text() == fresh, \
                f"{stem}{suffix} is stale: run proto/generate.sh"
        checked_grpc = (GENERATED / f"{stem}_pb2_grpc.py").read_text()
        pinned = _GRPC_VERSION.search(checked_grpc).group(1)
        fresh_grpc = _GRPC_VERSION.sub(f"GRPC_GENERATED_VERSION = '{pinned}'",
                                       (fresh_dir / f"{stem}_pb2_grpc.py").read_text())
        assert checked_grpc == fresh_grpc, f"{stem}_pb2_grpc.py is stale: run proto/generate.sh"


def test_checked_in_code_is_generated_by_the_pinned_tools():
    """Generated *_grpc code refuses grpcio older than its generator; the pin must match generate.sh."""
    pin = re.search(r"^WANT_TOOLS=(\S+)$", (ROOT / "proto" / "generate.sh").read_text(), re.M).group(1)
    for proto in PROTOS:
        recorded = _GRPC_VERSION.search((GENERATED / f"{proto.stem}_pb2_grpc.py").read_text()).group(1)
        assert recorded == pin, f"{proto.stem}_pb2_grpc.py: made by grpcio-tools {recorded}, the pin is {pin}"
