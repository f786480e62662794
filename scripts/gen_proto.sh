#!/usr/bin/env bash
# Regenerates the Python stubs next to the .proto files (proto/pdserve/v1/*_pb2*.py[i]).
# tests/proto/test_stubs_fresh.py fails when the committed stubs differ from what this writes.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-proto}
.venv/bin/python -m grpc_tools.protoc -I proto --python_out="$OUT" --pyi_out="$OUT" \
  --grpc_python_out="$OUT" proto/pdserve/v1/*.proto
