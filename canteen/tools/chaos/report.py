"""How one request is judged against its reference, and the run's report."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from canteen.tools.chaos.faults import FaultRecord
from canteen.v1 import common_pb2

RETRYABLE = ("UNAVAILABLE", "RESOURCE_EXHAUSTED")
_LENGTH = common_pb2.FINISH_REASON_LENGTH


@dataclass
class Received:
    """What one attempt got: its tokens, finish_reason, and status code when it failed."""

    tokens: list[int] = field(default_factory=list)
    finish: int = 0
    code: str = ""
    details: str = ""
    foreign_id: str = ""  # a response id other than the request's x-request-id
    answered: bool = False  # the gateway sent response headers: a handler took the call

    @property
    def is_refused(self) -> bool:
        """Turned away before any handler ran: UNAVAILABLE, or the CANCELLED that a stopping
        gRPC server answers for calls still queued for a handler (grpc/grpc#41785), which
        never reached Canteen's code. Safe to send again."""
        return not self.tokens and (
            self.code == "UNAVAILABLE" or (self.code == "CANCELLED" and not self.answered)
        )


@dataclass
class Outcome:
    request_id: str
    result: str  # "exact", "retryable" or "lost"
    code: str = ""
    detail: str = ""
    tokens: int = 0
    attempts: int = 1
    seconds: float = 0.0
    # What the last attempt received and what a fault-free run gave (not in the JSON).
    token_ids: list[int] = field(default_factory=list, repr=False)
    finish: int = 0
    reference: list[int] = field(default_factory=list, repr=False)

    def summary(self) -> dict[str, Any]:
        return _rounded(
            {k: v for k, v in asdict(self).items() if k not in ("token_ids", "reference")}
        )


def classify(reference: list[int], got: Received, retryable: tuple[str, ...]) -> tuple[str, str]:
    """``(result, why)`` for a request's last attempt; see the package docstring."""
    n = len(got.tokens)
    if got.foreign_id:
        return "lost", f"answered as request {got.foreign_id}"
    if got.tokens != reference[:n]:
        pairs = enumerate(zip(got.tokens, reference, strict=False))
        at = next((i for i, (a, b) in pairs if a != b), len(reference))
        return "lost", f"{n} tokens, not a prefix of the reference (they differ at {at})"
    if got.code:
        if got.code in retryable or (got.is_refused and "UNAVAILABLE" in retryable):
            return "retryable", ""
        return "lost", got.details
    if got.finish != _LENGTH or n != len(reference):
        return "lost", f"ended with finish_reason {got.finish} after {n}/{len(reference)} tokens"
    return "exact", ""


def _rounded(record: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in record.items()}


@dataclass
class Report:
    requests: int
    faults: list[FaultRecord]
    outcomes: list[Outcome]
    leaks: list[str]
    durations: dict[str, float]
    restarts: dict[str, int] = field(default_factory=dict)  # by a supervisor, per service

    def count(self, result: str) -> int:
        return sum(o.result == result for o in self.outcomes)

    @property
    def lost(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.result == "lost"]

    @property
    def ok(self) -> bool:
        return not self.lost and not self.leaks and not any(f.error for f in self.faults)

    def to_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "faults_by_kind": dict(Counter(f.kind for f in self.faults)),
            "completed_exactly": self.count("exact"),
            "failed_retryably": self.count("retryable"),
            "failed_by_code": dict(Counter(o.code for o in self.outcomes if o.code)),
            "lost": len(self.lost),
            "client_retries": sum(o.attempts - 1 for o in self.outcomes),
            "restarts": self.restarts,
            "leaks": self.leaks,
            "ok": self.ok,
            "durations": _rounded(self.durations),
            "faults": [_rounded(asdict(f)) for f in self.faults],
            "lost_requests": [o.summary() for o in self.lost],
        }

    def format(self) -> str:
        d, s = self.to_dict(), self.durations
        kinds = ", ".join(f"{k} {v}" for k, v in d["faults_by_kind"].items()) or "none"
        codes = ", ".join(f"{k} {v}" for k, v in d["failed_by_code"].items())
        lines = [
            f"chaos: {self.requests} requests in {s['total_s']:.1f} s (references "
            f"{s['references_s']:.1f} s, load {s['load_s']:.1f} s, settle {s['settle_s']:.1f} s)",
            f"faults: {kinds}",
            *(
                f"  +{f.at:5.1f} s  {f.kind} {f.target}  {f.seconds:.1f} s, "
                f"{f.in_flight} in flight, {f.error or 'ok'}"
                for f in self.faults
            ),
            f"completed exactly {d['completed_exactly']}, failed retryably "
            f"{d['failed_retryably']}{f' ({codes})' if codes else ''}, lost {d['lost']}; "
            f"client retries {d['client_retries']}",
            *(
                [
                    "restarts by canteen up: "
                    + ", ".join(f"{k} {v}" for k, v in self.restarts.items())
                ]
                if self.restarts
                else []
            ),
            f"latency of exact requests: p50 {s['p50_s']:.2f} s, max {s['max_s']:.2f} s",
            *(f"  lost {o.request_id}: {o.code or 'OK'} {o.detail}" for o in self.lost),
            "blocks: " + ("; ".join(self.leaks) if self.leaks else "none leaked"),
        ]
        return "\n".join(lines)
