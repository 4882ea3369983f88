"""Client-side helpers for fault tests: a Generate stream on its own thread, and waiting."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc

from canteen.v1 import common_pb2, inference_pb2, inference_pb2_grpc


class Stream(threading.Thread):
    """One Generate call through a gateway, collecting its tokens as they come.

    Greedy unless ``seed`` is given (then temperature 1 with that seed); always ignore_eos,
    so a complete stream has exactly ``max_tokens`` tokens.
    """

    def __init__(
        self,
        address: str,
        prompt: str,
        max_tokens: int,
        seed: int | None = None,
        timeout: float = 120,
        constraint: common_pb2.Constraint | None = None,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:
        super().__init__(daemon=True)
        self.request = inference_pb2.GenerateRequest(
            prompt=prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0.0
        )
        if seed is not None:
            self.request.temperature, self.request.seed = 1.0, seed
        if constraint is not None:
            self.request.constraint.CopyFrom(constraint)
        self.seed, self.address, self.timeout = seed, address, timeout
        self.metadata = metadata  # e.g. an API key: (("authorization", "Bearer KEY"),)
        self.tokens: list[int] = []
        self.error: grpc.RpcError | None = None

    def run(self) -> None:
        with grpc.insecure_channel(self.address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            try:
                for msg in stub.Generate(
                    self.request, timeout=self.timeout, metadata=self.metadata
                ):
                    self.tokens.extend(msg.token_ids)
            except grpc.RpcError as exc:
                self.error = exc


def generate(
    address: str,
    prompt: str,
    max_tokens: int,
    seed: int | None = None,
    constraint: common_pb2.Constraint | None = None,
) -> list[int]:
    """The tokens of one fault-free call (it must succeed)."""
    stream = Stream(address, prompt, max_tokens, seed, constraint=constraint)
    stream.run()
    assert stream.error is None, stream.error
    return stream.tokens


def until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")
