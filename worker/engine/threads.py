"""How many torch threads a step computes on: one for a narrow step, all for a wide one.

A decode step of a row or two reads every weight once and does little arithmetic on it, and
Canteen's kernels split only calls worth a second thread's wake-up (worker/kernels/lowbit.cpp,
kMinTaskBytes). In the suite such a step shares the machine with the worker's own gRPC thread,
the scheduler and the gateway, which wake once per token: with two OpenMP threads, whichever
of them the OS takes away stalls every parallel region after it (the other one waits at the
region's end), and the idle one spins where the edge would run. On one thread the step never
waits for a second, and the other core serves the edge while the step runs (the scheduler
has the next plan in flight already, --pipeline-depth 2). The step's bigger linears still
take a second core when it is free: the kernels' step helper (worker/kernels/share.h) claims
chunks beside the step's thread while it is awake, and the step never waits for it to arrive.

A small step runs on one thread whatever its rows: one whose linears make fewer than
``--small-step-mmacs`` million multiply-adds (a model of a few million parameters, the tiny
models the edge benchmarks use to stand in for a GPU worker, or a draft). Its parallel
regions are too short to pay for a second thread's wake-up, and between them the idle OpenMP
thread spins, taking a core from the scheduler and the gateway: on the AMD EPYC Zen 4 (2
cores, 2026-12-06, `bench/suite_probe.py --tiny --streams 64 --tokens 256`, alternating with
the rule off) a worker of the tiny model used 1.4-1.8 s of CPU a run against 3.7-4.8 s, and
the suite made 4,561-5,751 tokens/s against 3,373-4,145.

The switch changes no bit: every kernel computes a row the same way at any thread count
(tests/unit/test_thread_invariance.py), so only speed depends on it.
"""

from __future__ import annotations

from typing import Any

import torch

from worker import kernels

# The worker's default (--narrow-step-rows): off. On a quiet AMD EPYC Zen 4 (2 cores,
# 2026-12-06 10:34, `bench/q4.py --streams 1,16,32 --tokens 64 --rounds 2 --variant
# "--narrow-step-rows 0"`) one thread for one-row steps lost at one stream (91.7 and 103.3
# tok/s against 100.0 and 116.2 with it off) and at 32 streams (470 and 452 against 483 and
# 505); it won only on a host loaded by other work (docs/speed-history.md).
NARROW_STEP_ROWS = 0

# The worker's default (--small-step-mmacs): steps whose linears do fewer multiply-adds run
# on one thread. 32 million is about half a millisecond on one Zen 4 core: SmolLM2-135M's one
# row is 134 million (so every SmolLM2 step keeps every thread), the tiny test model's 64
# rows about 7.
SMALL_STEP_MMACS = 32


def row_macs(config: Any) -> int:
    """Multiply-adds of one token row through a transformers config's linears: the attention
    projections, the gated MLP and the head (an estimate for families of other shapes); 0 for
    a config without these sizes (no step counts as small then)."""
    try:
        return _row_macs(config)
    except (AttributeError, TypeError, ZeroDivisionError):
        return 0


def _row_macs(config: Any) -> int:
    hidden = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    inter = int(getattr(config, "intermediate_size", None) or 4 * hidden)
    attention = hidden * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden
    return int(config.num_hidden_layers) * (attention + 3 * hidden * inter) + hidden * int(
        config.vocab_size
    )


class StepThreads:
    """Sets torch's thread count before each step from the step's number of token rows."""

    def __init__(
        self, narrow_rows: int, num_threads: int = 0, row_macs: int = 0, small_macs: int = 0
    ) -> None:
        """``narrow_rows``: steps of at most this many rows run on one thread (0: none);
        ``num_threads``: every other step's count (0: torch's count now); ``row_macs``: a
        token row's multiply-adds (``row_macs(config)``), and ``small_macs``: steps of fewer
        (rows times ``row_macs``) run on one thread (0 in either: none)."""
        if narrow_rows < 0:
            raise ValueError(f"narrow_rows must be >= 0, got {narrow_rows}")
        if row_macs < 0 or small_macs < 0:
            raise ValueError(f"row_macs and small_macs must be >= 0, got {row_macs}, {small_macs}")
        self.narrow_rows = narrow_rows
        self.num_threads = num_threads or torch.get_num_threads()
        # rows below this are a small step (0: none is)
        self._small_rows = -(-small_macs // row_macs) if row_macs and small_macs else 0
        # the helper lives in the CPU kernels: only where narrow steps can lend it a thread
        self._has_helper = narrow_rows > 0 and self.num_threads > 1 and kernels.available()

    def threads_for(self, num_rows: int) -> int:
        narrow = num_rows <= self.narrow_rows or num_rows < self._small_rows
        return 1 if narrow else self.num_threads

    def apply(self, num_rows: int) -> int:
        """Sets the count for a step of ``num_rows`` rows (a no-op when it is set already), and
        gives a narrow step the kernels' step helper when wider ones have more threads."""
        wanted = self.threads_for(num_rows)
        if torch.get_num_threads() != wanted:  # asked each time: a caller may have set it
            torch.set_num_threads(wanted)
        if self._has_helper:  # set every step: other runners in the process may change it
            torch.ops.canteen.set_step_helpers(int(wanted < self.num_threads))
        return wanted
