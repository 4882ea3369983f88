"""Fuzzes the gateway's pure edge functions with atheris (libFuzzer), no sockets.

Targets (``--target=NAME``, default ``all``: the first byte picks one):

    parse_request  gateway.openai_api.parse_request on a JSON body decoded from the bytes
                   (or, when they are not JSON, a body built from them), then check_shape
                   and the SamplingParams the request path would build from what passed
    check_shape    InferenceService.check_shape on GenerateInputs of the shapes the gRPC
                   and HTTP edges produce, with extreme numbers and strings
    tokenizer      the chat template rendering, encode and decode of gateway/tokenizers.py
                   on the tiny test tokenizer

Any exception other than the intended ones (InvalidInputError, TemplateError) is a finding,
and so is a failed invariant (an AssertionError)::

    python tests/fuzz/fuzz_edge.py -atheris_runs=20000
    python tests/fuzz/fuzz_edge.py --target=parse_request -max_total_time=60 CORPUS_DIR

A few seed inputs (request bodies) are always added with ``-seed_inputs``. The
``check_*`` functions are plain Python: tests/unit/test_fuzz_edge.py calls them on
regression inputs without atheris.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

try:
    import atheris  # type: ignore[import-untyped, import-not-found, unused-ignore]
except ImportError:  # the check_* functions still work; fuzzing needs atheris
    atheris = None


def _instrumented() -> contextlib.AbstractContextManager[object]:
    """Coverage instrumentation of the gateway's modules, when run as the fuzzer."""
    if atheris is not None and __name__ == "__main__":
        return atheris.instrument_imports(include=["gateway"])  # type: ignore[no-any-return]
    return contextlib.nullcontext()


with _instrumented():
    from canteen.codec import sampling_to_pb
    from canteen.plan import MAX_TOP_LOGPROBS, Sampling
    from gateway.config import GatewayConfig
    from gateway.errors import InvalidInputError
    from gateway.openai_api import MAX_N, parse_request
    from gateway.service import GenerateInput, InferenceService
    from gateway.tokenizers import TemplateError, Tokenizer
    from gateway.tools import ROLES, ChatMessage

from tests.support.hostile import FIELDS  # noqa: E402  (after the path setup above)

CONFIG = GatewayConfig()
WORDS = (*ROLES, "text", "image_url", "include_usage", "", "tiny", "tiny:v1", *FIELDS)
SEEDS: dict[str, list[bytes]] = {
    "parse_request": [
        json.dumps(b).encode()
        for b in (
            {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0},
            {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2, "n": 2},
            {
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                ],
                "stop": ["\n", "END"],
                "seed": 7,
                "top_p": 0.9,
                "logprobs": True,
                "top_logprobs": 3,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
            {"prompt": ["one"], "logprobs": 2, "max_completion_tokens": 3, "user": "u"},
        )
    ],
    "check_shape": [b"\x00" * 64, bytes(range(256))],
    "tokenizer": [b"\x01user\x00Hello there", bytes(range(256))],
}


# -- checks: plain functions on Python values; a raised exception is a finding ---------------


def service() -> InferenceService:
    """The least InferenceService check_shape needs: its config."""
    svc = InferenceService.__new__(InferenceService)
    svc.config = CONFIG
    return svc


SERVICE = service()


def check_parse_request(kind: str, body: object) -> None:
    try:
        req = parse_request(kind, body, "req-fuzz")
    except InvalidInputError as exc:
        assert str(exc), "an InvalidInputError without a message"
        return
    assert 1 <= len(req.inputs) <= MAX_N
    assert 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS
    for inp in req.inputs:
        assert (inp.prompt is None) != (inp.messages is None)
        for text in [inp.prompt or "", *inp.stop]:
            text.encode("utf-8")  # a lone surrogate here would crash the tokenizer
        for m in inp.messages or []:
            assert isinstance(m["role"], str) and isinstance(m["content"], str), m
            m["content"].encode("utf-8")
        s = inp.sampling
        assert isinstance(s.temperature, float) and 0 <= s.temperature <= 2
        assert isinstance(s.top_p, float)
        check_shape(inp)


def check_shape(inp: GenerateInput) -> None:
    """check_shape refuses with a message, or what it lets through fits the wire."""
    try:
        SERVICE.check_shape(inp)
    except InvalidInputError as exc:
        assert str(exc), "an InvalidInputError without a message"
        return
    s = inp.sampling
    assert s.temperature >= 0 and 0 < s.top_p <= 1 and s.top_k >= 0
    assert 0 <= s.top_logprobs <= MAX_TOP_LOGPROBS
    assert inp.max_tokens is None or inp.max_tokens >= 1
    assert len(inp.stop) <= CONFIG.max_stop_strings
    # What gateway.service builds upstream from an accepted input must not raise.
    sampling_to_pb(s)


_TOKENIZER: list[Tokenizer] = []


def tokenizer() -> Tokenizer:
    if not _TOKENIZER:
        from tests.support.tiny_model import build_tokenizer

        _TOKENIZER.append(Tokenizer(build_tokenizer()))
    return _TOKENIZER[0]


def check_tokenizer(messages: list[ChatMessage], prompt: str, ids: list[int]) -> None:
    tok = tokenizer()
    renders: list[Callable[[], list[int]]] = [
        lambda: tok.render_chat(messages),
        lambda: tok.encode(prompt),
    ]
    for render in renders:
        try:
            out = render()
        except TemplateError as exc:
            assert str(exc), "a TemplateError without a message"
            continue
        assert all(isinstance(t, int) and 0 <= t < tok.vocab_size for t in out), out
    text = tok.decode([t % tok.vocab_size for t in ids])
    assert isinstance(text, str)
    text.encode("utf-8")


# -- fuzz targets: bytes to values --------------------------------------------------------


def _text(fdp: Any, limit: int = 40) -> str:
    n = fdp.ConsumeIntInRange(0, limit)
    choice = fdp.ConsumeIntInRange(0, 3)
    if choice == 0:
        return str(fdp.PickValueInList(list(WORDS)))
    if choice == 1:  # any code point, lone surrogates included (JSON escapes allow them)
        return str(fdp.ConsumeUnicode(n))
    return str(fdp.ConsumeUnicodeNoSurrogates(n))


def _int(fdp: Any) -> int:
    """Any integer, as JSON carries them: small, edge values, or up to 384 bits."""
    choice = fdp.ConsumeIntInRange(0, 3)
    if choice == 0:
        return int(fdp.ConsumeIntInRange(-8, 8))
    if choice == 1:
        return int(fdp.PickValueInList([0, 1, 4, 5, 20, 21, 2**31 - 1, -(2**31), 2**63, 2**64]))
    return int(fdp.ConsumeInt(fdp.ConsumeIntInRange(1, 48)))


def _int32(fdp: Any) -> int:
    """An integer a proto int32 field carries (the gRPC edge's top_k, priority, ...)."""
    if fdp.ConsumeBool():
        return int(fdp.PickValueInList([0, 1, 4, 5, 20, 21, 2**31 - 1, -(2**31), -1]))
    return int(fdp.ConsumeIntInRange(-(2**31), 2**31 - 1))


def _float(fdp: Any) -> float:
    choice = fdp.ConsumeIntInRange(0, 2)
    if choice == 0:
        return float(
            fdp.PickValueInList([0.0, -0.0, 1.0, 2.0, 1e-45, 1e-320, math.inf, -math.inf, math.nan])
        )
    if choice == 1:
        return float(fdp.ConsumeProbability())
    return float(fdp.ConsumeFloat())


def _json(fdp: Any, depth: int = 0) -> Any:
    """Any JSON value, nested up to a few levels."""
    kind = fdp.ConsumeIntInRange(0, 8 if depth < 4 else 5)
    if kind == 0:
        return None
    if kind == 1:
        return fdp.ConsumeBool()
    if kind == 2:
        return _int(fdp)
    if kind == 3:
        return _float(fdp)
    if kind in (4, 5):
        return _text(fdp)
    if kind == 6:
        return [_json(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 4))]
    if kind == 7:
        return {"role": _json(fdp, depth + 1), "content": _json(fdp, depth + 1)}
    return {_text(fdp, 12): _json(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 4))}


def _messages(fdp: Any) -> Any:
    out: list[Any] = []
    for _ in range(fdp.ConsumeIntInRange(0, 4)):
        if fdp.ConsumeIntInRange(0, 5) == 0:
            out.append(_json(fdp, 2))
            continue
        content: Any = _text(fdp)
        if fdp.ConsumeIntInRange(0, 3) == 0:
            content = [{"type": "text", "text": _text(fdp)}, _json(fdp, 3)][
                : fdp.ConsumeIntInRange(0, 2)
            ]
        role = fdp.PickValueInList(list(ROLES)) if fdp.ConsumeBool() else _json(fdp, 3)
        out.append({"role": role, "content": content})
    return out


_INTS = ("n", "max_tokens", "max_completion_tokens", "seed", "top_logprobs")
_BOOLS = ("stream", "echo", "ignore_eos")


def _field(fdp: Any, name: str) -> Any:
    """A value of the field's own type (extreme ones too), or any JSON value at all."""
    if fdp.ConsumeIntInRange(0, 2) == 0:
        return _json(fdp)
    if name == "messages":
        return _messages(fdp)
    if name in _INTS:
        return _int(fdp)
    if name in ("temperature", "top_p"):
        return _float(fdp) if fdp.ConsumeBool() else _int(fdp)
    if name in _BOOLS:
        return fdp.ConsumeBool()
    if name == "logprobs":  # a boolean for chat, an integer for completions
        return fdp.ConsumeBool() if fdp.ConsumeBool() else _int(fdp)
    if name == "stop":
        stops = [_text(fdp) for _ in range(fdp.ConsumeIntInRange(0, 5))]
        return stops[0] if len(stops) == 1 else stops
    if name == "stream_options":
        return {"include_usage": _json(fdp, 3)}
    return _text(fdp)  # model, prompt, user


def _body(fdp: Any) -> Any:
    if fdp.ConsumeIntInRange(0, 15) == 0:
        return _json(fdp)
    body: dict[str, Any] = {}
    for _ in range(fdp.ConsumeIntInRange(0, 10)):
        name = fdp.PickValueInList(list(FIELDS))
        body[name] = _field(fdp, name)
    if fdp.ConsumeBool():
        body.setdefault("prompt", _text(fdp))
    return body


def fuzz_parse_request(data: bytes) -> None:
    try:
        body = json.loads(data)
        kind = "chat" if len(data) % 2 else "completion"
    except (ValueError, RecursionError):  # not JSON: build a body from the bytes
        fdp = atheris.FuzzedDataProvider(data)
        kind = "chat" if fdp.ConsumeBool() else "completion"
        body = _body(fdp)
    check_parse_request(kind, body)


def fuzz_check_shape(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    has_prompt = fdp.ConsumeBool()
    messages: list[ChatMessage] = [
        {"role": str(fdp.PickValueInList([*ROLES, "wizard", ""])), "content": _text(fdp, 64)}
        for _ in range(fdp.ConsumeIntInRange(0, 300 if fdp.ConsumeIntInRange(0, 20) == 0 else 4))
    ]
    big = fdp.ConsumeIntInRange(0, 30) == 0
    inp = GenerateInput(
        request_id="req-fuzz",
        prompt=("x" * (CONFIG.max_prompt_chars + 1) if big else _text(fdp)) if has_prompt else None,
        messages=None if has_prompt and fdp.ConsumeIntInRange(0, 9) else messages,
        max_tokens=_int(fdp) if fdp.ConsumeBool() else None,
        sampling=Sampling(
            temperature=_float(fdp),
            top_p=_float(fdp),
            top_k=_int32(fdp),  # int32 on the gRPC edge
            seed=fdp.ConsumeIntInRange(0, 2**64 - 1),
            top_logprobs=_int(fdp),
        ),
        stop=[_text(fdp, 300) for _ in range(fdp.ConsumeIntInRange(0, 18))],
        stop_token_ids=[_int32(fdp) for _ in range(fdp.ConsumeIntInRange(0, 4))],
        priority=_int32(fdp),
    )
    check_shape(inp)


def fuzz_tokenizer(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    messages: list[ChatMessage] = [
        {
            "role": str(fdp.PickValueInList(list(ROLES))) if fdp.ConsumeBool() else _text(fdp, 12),
            "content": _text(fdp, 80),
        }
        for _ in range(fdp.ConsumeIntInRange(0, 6))
    ]
    prompt = _text(fdp, 80)
    ids = fdp.ConsumeIntListInRange(fdp.ConsumeIntInRange(0, 16), 0, 2**31 - 1)
    check_tokenizer(messages, prompt, ids)


TARGETS: dict[str, Callable[[bytes], None]] = {
    "parse_request": fuzz_parse_request,
    "check_shape": fuzz_check_shape,
    "tokenizer": fuzz_tokenizer,
}


def fuzz_all(data: bytes) -> None:
    if not data:
        return
    names = list(TARGETS)
    TARGETS[names[data[0] % len(names)]](data[1:])


def _seed_inputs(target: str) -> str:
    """Writes the seeds to a fixed temporary folder (libFuzzer exits without cleaning up)
    and returns them as a ``-seed_inputs`` list; libFuzzer never writes there."""
    folder = Path(tempfile.gettempdir()) / f"canteen-fuzz-seeds-{target}"
    folder.mkdir(exist_ok=True)
    names, files = list(TARGETS), []
    for name, seeds in SEEDS.items():
        if target not in ("all", name):
            continue
        prefix = bytes([names.index(name)]) if target == "all" else b""
        for i, seed in enumerate(seeds):
            path = folder / f"{name}-{i}"
            path.write_bytes(prefix + seed)
            files.append(str(path))
    return ",".join(files)


def main(argv: list[str]) -> None:
    if atheris is None:
        sys.exit("atheris is not installed: pip install atheris")
    target = "all"
    args = [argv[0]]
    for arg in argv[1:]:
        if arg.startswith("--target="):
            target = arg.split("=", 1)[1]
        else:
            args.append(arg)
    if target not in ("all", *TARGETS):
        sys.exit(f"--target={target}: use all, {', '.join(TARGETS)}")
    fuzz = fuzz_all if target == "all" else TARGETS[target]
    if target in ("all", "tokenizer"):
        tokenizer()  # trained once, before the clock starts
    if not any(a.startswith("-seed_inputs=") for a in args):
        args.append(f"-seed_inputs={_seed_inputs(target)}")
    atheris.Setup(args, fuzz)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
