#!/usr/bin/env bash
# Fails when the committed stubs in canteen/v1 differ from what the protos generate.
set -euo pipefail
cd "$(dirname "$0")/.."
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
scripts/gen_protos.sh "$TMP" >/dev/null 2>&1
if ! diff -r -x __pycache__ "$TMP/canteen/v1" canteen/v1 >/dev/null; then
  echo "canteen/v1 stubs are stale: run 'make protos' and commit the result" >&2
  diff -r -x __pycache__ "$TMP/canteen/v1" canteen/v1 | head -20 >&2
  exit 1
fi
echo "stubs are up to date"
