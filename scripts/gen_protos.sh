#!/usr/bin/env bash
# Regenerates the Python stubs of protos/canteen/v1 into OUT (default: the repo root),
# so they land in the package canteen.v1.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-.}"
PY="${PYTHON:-python}"
mkdir -p "$OUT/canteen/v1"
"$PY" -m grpc_tools.protoc -Iprotos \
  --python_out="$OUT" --grpc_python_out="$OUT" --mypy_out="$OUT" --mypy_grpc_out="$OUT" \
  protos/canteen/v1/*.proto
touch "$OUT/canteen/v1/__init__.py"
