"""A stream interval: the scheduler's sink gathers a request's tokens after its first into
entries of N (or fewer at the finish), and the gateway's output of such entries is the text,
token ids, logprobs and usage of one token at a time, a stop string inside an entry too."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from canteen.batching import BatchConfig
from canteen.finish import Finish
from canteen.v1 import common_pb2, scheduler_pb2
from gateway.config import GatewayConfig
from gateway.output import Output, TextDelta
from gateway.tokenizers import Tokenizer
from scheduler.link import LinkSettings, WorkerDescription, WorkerLink
from scheduler.sequence import SeqEvent, Status
from scheduler.subscriptions import Subscriptions
from tests.support.tiny_model import build_tokenizer
from tests.unit.test_batcher import BLOCK_SIZE, FakeWorker, make_seq, run_alone
from tests.unit.test_pipeline import _RunCall


def _event(seq_id: str, token: int, finish: Finish | None = None) -> SeqEvent:
    return SeqEvent(seq_id, (token,), (-token / 10,), finish)


async def test_tokens_after_the_first_go_in_entries_of_the_interval() -> None:
    subscription = Subscriptions().open("ipv4:127.0.0.1:5000")
    seq, own = make_seq("a", prompt_len=3, max_tokens=8), asyncio.Queue[SeqEvent]()
    sink = subscription.attach(1, seq, own, interval=3)
    sink.put_nowait(_event(seq.seq_id, 10))
    entries = [[e.token_ids for _, e, _ in await subscription.next_batch()]]
    for token in (11, 12):
        sink.put_nowait(_event(seq.seq_id, token))
    assert not subscription._ready.is_set()  # held: two of three
    sink.put_nowait(_event(seq.seq_id, 13))
    entries.append([e.token_ids for _, e, _ in await subscription.next_batch()])
    sink.put_nowait(_event(seq.seq_id, 14))
    sink.put_nowait(_event(seq.seq_id, 15, Finish.LENGTH))  # the finish goes at once
    batch = await subscription.next_batch()
    entries.append([e.token_ids for _, e, _ in batch])
    assert entries == [[(10,)], [(11, 12, 13)], [(14, 15)]]
    assert batch[0][1].logprobs == (-1.4, -1.5) and batch[0][1].finish is Finish.LENGTH
    assert own.get_nowait().token_ids == () and own.get_nowait().finish is Finish.LENGTH


async def test_a_failure_ends_the_caller_and_drops_the_held_tokens() -> None:
    subscription = Subscriptions().open("ipv4:127.0.0.1:5000")
    seq, own = make_seq("a", prompt_len=3, max_tokens=8), asyncio.Queue[SeqEvent]()
    sink = subscription.attach(1, seq, own, interval=4)
    sink.put_nowait(_event(seq.seq_id, 10))
    await subscription.next_batch()
    sink.put_nowait(_event(seq.seq_id, 11))
    sink.put_nowait(SeqEvent(seq.seq_id, (), (), Finish.FAILED, error="worker lost"))
    assert not subscription._ready.is_set()
    assert own.get_nowait().token_ids == () and own.get_nowait().error == "worker lost"


def _response(ids: list[int], finish: int = 0) -> scheduler_pb2.ScheduleResponse:
    return scheduler_pb2.ScheduleResponse(
        token_ids=ids,
        logprobs=[-i / 10 for i in ids],
        finish_reason=finish,  # type: ignore[arg-type]
        usage=common_pb2.Usage(prompt_tokens=3, completion_tokens=len(ids)),
    )


def _run(ids: list[int], interval: int, stop: list[str]) -> list[TextDelta]:
    output = Output(Tokenizer(build_tokenizer()), stop, None, "tiny:v1", 3)
    parts = [ids[:1]] + [ids[i : i + interval] for i in range(1, len(ids), interval)]
    deltas = []
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        deltas.append(output.push(_response(part, common_pb2.FINISH_REASON_LENGTH if last else 0)))
        if deltas[-1].finish_reason is not None:
            break
    return deltas


def test_a_stop_string_inside_an_entry_keeps_exactly_the_tokens_one_at_a_time_would() -> None:
    tokenizer = build_tokenizer()
    ids = tokenizer.encode(
        "Once upon a time there was a small bowl of noodles", add_special_tokens=False
    )
    assert len(ids) >= 8
    full = str(tokenizer.decode(ids))
    stop = full[len(full) // 2 : len(full) // 2 + 4]

    def seen(deltas: list[TextDelta]) -> tuple[str, list[int], list[float], object, object]:
        last = deltas[-1]
        joined = [t for d in deltas for t in d.token_ids]
        return (
            "".join(d.text for d in deltas),
            joined,
            [x for d in deltas for x in d.logprobs],
            last.finish_reason,
            last.usage,
        )

    one = seen(_run(ids, 1, [stop]))
    assert one[0] == full[: full.index(stop)] and one[3] is Finish.STOP
    assert len(one[1]) < len(ids)  # the stop string ended it before the last token
    for interval in (3, 4):
        assert seen(_run(ids, interval, [stop])) == one
    # Without a stop string every interval gives the whole text and every token.
    for interval in (1, 3, 4):
        text, joined, _, finish, _ = seen(_run(ids, interval, []))
        assert (text, joined, finish) == (full, ids, Finish.LENGTH)


def test_the_gateway_default_is_bounded_like_the_field() -> None:
    assert GatewayConfig(stream_interval=64).stream_interval == 64
    for bad in (0, 65):
        with pytest.raises(ValueError, match=f"^stream_interval={bad}: must be in 1..64$"):
            GatewayConfig(stream_interval=bad)


async def test_a_preempted_request_s_held_tokens_go_out_while_it_waits() -> None:
    """Two requests on a pool that holds one: the later is preempted mid-interval, and the
    tokens it made go out then, not when it resumes; every token arrives, as made alone."""
    desc = WorkerDescription(
        "w", "127.0.0.1:1", "m", "v1", 6, BLOCK_SIZE, 256, frozenset(), 64, 128
    )
    limits = BatchConfig(
        max_batched_tokens=64, max_num_seqs=16, watermark_blocks=1, max_step_stall=0
    )
    channel = grpc.aio.insecure_channel("127.0.0.1:1")  # never dialled: the call is fake
    link = WorkerLink(desc, channel, LinkSettings(batch=limits, enable_prefix_cache=False))
    subscription = Subscriptions().open("ipv4:127.0.0.1:5000")
    seqs = [make_seq(n, prompt_len=6, max_tokens=12, arrival_time=t) for t, n in enumerate("ab")]
    for tag, seq in enumerate(seqs):
        link.adopt(seq, subscription.attach(tag, seq, asyncio.Queue(), interval=16))
    runs = asyncio.create_task(link._loop(_RunCall(FakeWorker(6), [])))
    entries: dict[int, list[tuple[tuple[int, ...], bool]]] = {0: [], 1: []}  # ids, waiting
    num_finished = 0
    while num_finished < 2:
        for tag, event, _ in await subscription.next_batch():
            entries[tag].append((event.token_ids, seqs[tag].status is Status.WAITING))
            num_finished += event.finish is not None
    runs.cancel()
    await channel.close()
    assert link.core.num_preemptions == 1 and seqs[1].num_preemptions == 1
    assert [len(e) for e in entries.values()] == [2, 3]  # the first, (the held,) the rest
    _, (held, was_waiting), _ = entries[1]
    assert was_waiting and 1 <= len(held) < 11
    for tag, name in enumerate("ab"):
        assert [t for ids, _ in entries[tag] for t in ids] == run_alone(6, 12, name)
