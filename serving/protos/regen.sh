#!/usr/bin/env bash
# Regenerate strata_pb2.py / strata_pb2_grpc.py / strata_pb2.pyi from strata.proto.
# Run from anywhere; the proto is compiled relative to the repository root so the
# generated modules import each other as `serving.protos.strata_pb2`.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
python -m grpc_tools.protoc -I . \
  --python_out=. --pyi_out=. --grpc_python_out=. \
  serving/protos/strata.proto
