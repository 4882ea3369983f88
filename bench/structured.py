"""Structured output against real-world-style JSON schemas: accepted or refused (with the
engine's reason), valid JSON, valid against the schema (``jsonschema``), finished within
``max_tokens``, and the time per request.

The sample is bench/structured_schemas.json (small schemas written in the style of GitHub
configs, Kubernetes, Snowplow, JSON Schema Store and function signatures; its licence note
says where they come from). Each schema goes through ``response_format: json_schema`` with
the ``openai`` client, ``--concurrency`` at a time. ``--tiny`` runs the suite on the random
tiny test model (answers are the grammar's doing, not the model's); without it, SmolLM2.

Usage: python bench/structured.py [--tiny] [--max-tokens 256] [--concurrency 4] [--json out]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import jsonschema
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decode_step import cpu_model

SAMPLE = Path(__file__).with_name("structured_schemas.json")
ASK = "Answer with one JSON document for this schema: {}"


@dataclass
class Outcome:
    """One schema's request, as the client saw it."""

    id: str
    accepted: bool
    reason: str  # the refusal's message; "" when accepted
    finish_reason: str
    is_json: bool
    is_valid: bool  # against the schema as written
    seconds: float
    num_tokens: int


def run_one(client: openai.OpenAI, model: str, item: dict[str, Any], max_tokens: int) -> Outcome:
    schema = item["schema"]
    started = time.perf_counter()
    try:
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": ASK.format(json.dumps(schema))}],
            max_tokens=max_tokens,
            temperature=0,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": schema},
            },
        )
    except openai.BadRequestError as exc:
        seconds = time.perf_counter() - started
        body = exc.body if isinstance(exc.body, dict) else {}
        reason = str(body.get("message", exc.message))
        return Outcome(item["id"], False, reason, "", False, False, seconds, 0)
    seconds = time.perf_counter() - started
    (choice,) = reply.choices
    text = choice.message.content or ""
    is_json, is_valid = _check(text, schema)
    tokens = reply.usage.completion_tokens if reply.usage else 0
    return Outcome(
        item["id"], True, "", str(choice.finish_reason), is_json, is_valid, seconds, tokens
    )


def _check(text: str, schema: dict[str, Any]) -> tuple[bool, bool]:
    try:
        value = json.loads(text)
    except ValueError:
        return False, False
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return True, False
    return True, True


@contextmanager
def http_url(tiny: bool, workdir: Path) -> Iterator[tuple[str, str]]:
    """(the gateway's HTTP base URL, the model name) of a suite started for the run."""
    if tiny:
        from tests.integration.conftest import tiny_suite
        from tests.support.tiny_model import build_tiny_model

        model_dir = build_tiny_model(workdir / "tiny-model")
        (workdir / "suite").mkdir()
        with tiny_suite(workdir / "suite", model_dir, 256) as suite:
            yield suite.gateway.http_url, "tiny"
        return
    from canteen.models import DEFAULT_MODEL_NAME
    from tests.support.suite import default_model_stack

    with default_model_stack(workdir / "suite") as stack:
        yield stack.gateway.http_url, DEFAULT_MODEL_NAME


def report(outcomes: list[Outcome]) -> dict[str, Any]:
    """The summary the README table takes, and one line per schema on stdout."""
    for o in outcomes:
        status = (
            f"refused: {o.reason[:90]}"
            if not o.accepted
            else (f"{o.finish_reason:7} json={o.is_json} valid={o.is_valid} {o.num_tokens} tok")
        )
        print(f"{o.id:32} {o.seconds:7.2f}s  {status}")
    accepted = [o for o in outcomes if o.accepted]
    finished = [o for o in accepted if o.finish_reason == "stop"]
    summary = {
        "schemas": len(outcomes),
        "accepted": len(accepted),
        "refused": len(outcomes) - len(accepted),
        "finished": len(finished),
        "finished_valid": sum(o.is_valid for o in finished),
        "cut_by_max_tokens": sum(o.finish_reason == "length" for o in accepted),
        "median_s": statistics.median(o.seconds for o in accepted) if accepted else None,
        "max_s": max((o.seconds for o in accepted), default=None),
        "cpu": cpu_model(),
    }
    print(json.dumps(summary, indent=2))
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the random tiny test model")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    parser.add_argument("--json", type=Path, help="write outcomes and summary here")
    args = parser.parse_args()
    sample = json.loads(SAMPLE.read_text())["schemas"]
    with tempfile.TemporaryDirectory() as tmp, http_url(args.tiny, Path(tmp)) as (url, model):
        client = openai.OpenAI(
            base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=args.timeout
        )
        with ThreadPoolExecutor(args.concurrency) as pool:
            outcomes = list(pool.map(lambda i: run_one(client, model, i, args.max_tokens), sample))
    summary = report(outcomes)
    if args.json:
        args.json.write_text(
            json.dumps({"summary": summary, "outcomes": [asdict(o) for o in outcomes]})
        )


if __name__ == "__main__":
    main()
