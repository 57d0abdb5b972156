#!/usr/bin/env bash
# Regenerates specwire/v1/*_pb2*.py{,i} from proto/specwire/v1/*.proto; the output is checked in.
#
# Generated *_grpc.py refuses to import on a grpcio older than the grpcio-tools that wrote it, so we
# generate with the oldest grpcio we support (the GPU machines run grpcio 1.84):
#   python -m venv /tmp/codegen && /tmp/codegen/bin/pip install "grpcio-tools==1.84.0"
#   PYTHON=/tmp/codegen/bin/python proto/generate.sh
# tests/test_proto_codegen.py checks the checked-in files match the .proto files.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
WANT_TOOLS=1.84.0
HAVE_TOOLS=$("$PYTHON" -c "from grpc_tools import grpc_version; print(grpc_version.VERSION)")
if [[ "$HAVE_TOOLS" != "$WANT_TOOLS" ]]; then
  echo "proto/generate.sh: grpcio-tools $HAVE_TOOLS found, want $WANT_TOOLS (see the comment at the top)" >&2
  exit 1
fi
"$PYTHON" -m grpc_tools.protoc -Iproto --python_out=. --grpc_python_out=. --pyi_out=. proto/specwire/v1/*.proto
echo "generated specwire/v1 with grpcio-tools $HAVE_TOOLS"
