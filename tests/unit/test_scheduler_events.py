"""How a sequence's events reach its caller: a reader that fell behind the steps gets the
tokens that queued up as one event, in order, logprobs with them, and a failure after them."""

from __future__ import annotations

import asyncio

from scheduler.sequence import Finish, SeqEvent
from scheduler.service import _coalesce
from tests.unit.test_batcher import make_seq


def _queue(events: list[SeqEvent]) -> asyncio.Queue[SeqEvent]:
    queue: asyncio.Queue[SeqEvent] = asyncio.Queue()
    for event in events:
        queue.put_nowait(event)
    return queue


def test_tokens_queued_behind_an_event_go_out_with_it() -> None:
    seq = make_seq("r", prompt_len=3, max_tokens=8)
    first = SeqEvent(seq, (5,), (-0.5,), top_logprobs=(((5, -0.5),),))
    queue = _queue(
        [
            SeqEvent(seq, (6, 7), (-0.25, -1.0), top_logprobs=(((6, -0.25),), ((7, -1.0),))),
            SeqEvent(seq, (8,), (-2.0,), Finish.LENGTH, top_logprobs=(((8, -2.0),),)),
        ]
    )
    event, pending = _coalesce(first, queue)
    assert pending is None and queue.empty()
    assert event.token_ids == (5, 6, 7, 8) and event.logprobs == (-0.5, -0.25, -1.0, -2.0)
    assert [top[0][0] for top in event.top_logprobs] == [5, 6, 7, 8]
    assert event.finish is Finish.LENGTH


def test_a_failure_waits_behind_the_tokens_before_it_and_nothing_after_is_taken() -> None:
    seq = make_seq("r", prompt_len=3, max_tokens=8)
    failed = SeqEvent(seq, (), (), Finish.FAILED)
    later = SeqEvent(seq, (9,), (-1.0,))
    queue = _queue([SeqEvent(seq, (6,), (-0.25,)), failed, later])
    event, pending = _coalesce(SeqEvent(seq, (5,), (-0.5,)), queue)
    assert event.token_ids == (5, 6) and event.finish is None
    assert pending is failed and queue.get_nowait() is later


def test_an_event_that_ends_the_sequence_takes_nothing_more() -> None:
    seq = make_seq("r", prompt_len=3, max_tokens=8)
    done = SeqEvent(seq, (5,), (-0.5,), Finish.STOP)
    queue = _queue([SeqEvent(seq, (6,), (-0.25,))])
    assert _coalesce(done, queue) == (done, None) and queue.qsize() == 1
