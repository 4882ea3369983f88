"""Benchmark datasets: random prompts, a shared prefix with random suffixes, or a jsonl file.

Prompts are random English words. A word is more than one token on most tokenizers, so
the generators take ``tokens_per_word`` (measured with the server's own tokenizer by the
CLI) and pick the word count that lands near the asked token count.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from canteen.tools.bench.records import RequestSpec

WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force "
    "education foot boy age policy music market sense nation plan college interest death "
    "experience effect class control care field development role effort rate heart drug show "
    "leader light voice wife police mind price report decision son view relationship town "
    "road arm difference value building action model season society tax director position "
    "player record paper space ground form event official matter center couple site project "
    "activity star table need court oil situation cost industry figure street image phone "
    "data picture practice piece land product doctor wall patient worker news test movie"
).split()


class DatasetError(ValueError):
    """A dataset that cannot be read; the message names the file, line and field."""


@dataclass(frozen=True)
class Workload:
    """The requests of a benchmark, in sending order."""

    name: str
    requests: tuple[RequestSpec, ...]

    def take(self, num_requests: int) -> list[RequestSpec]:
        """The first ``num_requests``, cycling when the dataset is shorter."""
        if not self.requests:
            raise DatasetError(f"dataset {self.name!r} has no requests")
        return [self.requests[i % len(self.requests)] for i in range(num_requests)]


def _check(name: str, value: float, low: float, high: float = math.inf) -> None:
    if not low <= value <= high:
        raise ValueError(f"{name}={value}: must be in [{low}, {high}]")


def sample_lengths(rng: np.random.Generator, mean: int, range_ratio: float, num: int) -> list[int]:
    """Uniform integers in [mean*(1-r), mean*(1+r)], never below 1."""
    _check("range_ratio", range_ratio, 0.0, 0.999)
    low = max(1, math.floor(mean * (1 - range_ratio)))
    high = max(low, math.floor(mean * (1 + range_ratio)))
    return [int(n) for n in rng.integers(low, high + 1, size=num)]


def random_text(rng: np.random.Generator, num_tokens: int, tokens_per_word: float) -> str:
    num_words = max(1, round(num_tokens / tokens_per_word))
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), size=num_words))


def random_workload(
    num_requests: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    tokens_per_word: float = 1.0,
) -> Workload:
    """Random prompts of about ``input_len`` tokens asking for ``output_len`` tokens."""
    _check("input_len", input_len, 1)
    _check("output_len", output_len, 1)
    _check("tokens_per_word", tokens_per_word, 1e-3)
    rng = np.random.default_rng(seed)
    inputs = sample_lengths(rng, input_len, range_ratio, num_requests)
    outputs = sample_lengths(rng, output_len, range_ratio, num_requests)
    specs = tuple(
        RequestSpec(random_text(rng, n_in, tokens_per_word), n_out, n_in)
        for n_in, n_out in zip(inputs, outputs, strict=True)
    )
    return Workload("random", specs)


def shared_prefix_workload(
    num_requests: int,
    prefix_len: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    tokens_per_word: float = 1.0,
) -> Workload:
    """One system-like prefix of ``prefix_len`` tokens, then a random suffix per request."""
    _check("prefix_len", prefix_len, 1)
    rng = np.random.default_rng(seed + 1)
    prefix = "You are a helpful assistant. " + random_text(rng, prefix_len, tokens_per_word)
    suffixes = random_workload(
        num_requests, input_len, output_len, range_ratio, seed, tokens_per_word
    )
    specs = tuple(
        RequestSpec(f"{prefix}\n\n{s.prompt}", s.max_tokens, prefix_len + s.prompt_len)
        for s in suffixes.requests
    )
    return Workload("shared-prefix", specs)


def _parse_line(text: str, where: str, default_max_tokens: int) -> RequestSpec:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{where}: not JSON: {exc.msg}") from None
    if not isinstance(obj, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    prompt = obj.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise DatasetError(f"{where}: field 'prompt' must be a non-empty string")
    max_tokens = obj.get("max_tokens", default_max_tokens)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise DatasetError(f"{where}: field 'max_tokens' must be an integer >= 1")
    return RequestSpec(prompt, max_tokens)


def load_jsonl(path: str | Path, default_max_tokens: int) -> Workload:
    """One JSON object per line: ``prompt`` and optional ``max_tokens``; blank lines skipped."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise DatasetError(f"{path}: {exc.strerror}") from None
    specs = tuple(
        _parse_line(line, f"{path}:{number}", default_max_tokens)
        for number, line in enumerate(lines, start=1)
        if line.strip()
    )
    if not specs:
        raise DatasetError(f"{path}: no requests in the file")
    return Workload(f"jsonl:{Path(path).name}", specs)
