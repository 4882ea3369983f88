"""``canteen chaos``: greedy load through the gateway while faults are injected; then every
request is checked, and the KV pools must be whole again.

Before any fault, each distinct (prompt, max_tokens) of the plan runs once (``temperature=0``,
``ignore_eos``) as its reference. Then ``requests`` requests run, at most ``concurrency`` at
a time, each with its own ``x-request-id``, round-robin over the gateways. An attempt that is
refused before any token is retried on the next gateway (``attempts`` in all), as a client
behind a load balancer does and as a draining gateway asks. Refused: UNAVAILABLE, or
CANCELLED without response headers: a gRPC server that stops cancels the calls still queued
for a handler (grpc/grpc#41785), calls no Canteen code saw. Each request ends as:

* completed exactly: finish_reason ``length`` with exactly the reference tokens;
* failed retryably: a status in ``retryable`` (default UNAVAILABLE, RESOURCE_EXHAUSTED), or
  a refusal while UNAVAILABLE is retryable, with a prefix of the reference as tokens:
  nothing repeated, nothing corrupted;
* lost: anything else: other tokens, another status (INTERNAL, CANCELLED, ...), a stream
  that ends without finish_reason, a response id that is not the request's x-request-id.
  DEADLINE_EXCEEDED is lost by default: the services bound their own waits
  (``--scheduler-retry``, ``--failover-wait``), so a request past a deadline well above
  them hung. ``--retryable`` changes the set.

The faults run in order, spread evenly through the plan: the plan is cut in m+2 equal parts
for m faults; each part starts with a burst of ``concurrency`` requests and paces the rest
``duration / requests`` seconds apart. Fault k fires right after the burst of part k+1 (so
``concurrency`` requests are in flight), and part k+2 starts only once fault k is done: every
fault meets load however long a restart takes, and the last part runs on the recovered
suite. After a restart chaos waits until the scheduler lists the worker ready, the new
scheduler has its workers back, or the gateway is SERVING.

A :class:`FaultInjector` performs the faults: :class:`UpInjector` signals the children of a
running ``canteen up`` (found in its state file), whose supervisor starts each again, so there
a killed worker or a drained gateway is waited for like a restarted one; :class:`ShellInjector`
runs one shell command per kind (``--on``); the tests also drive ``Suite`` processes. With a
supervisor the report also counts its restarts of each service. After the load, every worker in
the scheduler's ``GetStats`` must reach ``num_free_blocks == num_total_blocks`` with nothing
running or waiting within ``settle`` seconds.
"""

from canteen.tools.chaos.faults import (
    FAULT_KINDS,
    Fault,
    FaultInjector,
    FaultRecord,
    ShellInjector,
    inject,
    parse_faults,
)
from canteen.tools.chaos.report import RETRYABLE, Outcome, Report, classify
from canteen.tools.chaos.runner import PROMPTS, ChaosConfig, ChaosError, run_chaos
from canteen.tools.chaos.up import UpInjector

__all__ = [
    "FAULT_KINDS",
    "PROMPTS",
    "RETRYABLE",
    "ChaosConfig",
    "ChaosError",
    "Fault",
    "FaultInjector",
    "FaultRecord",
    "Outcome",
    "Report",
    "ShellInjector",
    "UpInjector",
    "classify",
    "inject",
    "parse_faults",
    "run_chaos",
]
