"""How a sequence's events reach its caller: a reader that fell behind the steps gets the
tokens that queued up as one event, in order, logprobs with them, and a failure after them;
on a shared token stream, one entry per request and batch, and the end to the caller."""

from __future__ import annotations

import asyncio

import pytest

from canteen.finish import Finish
from scheduler.sequence import SeqEvent
from scheduler.service import _coalesce
from scheduler.subscriptions import SubscriptionError, Subscriptions
from tests.unit.test_batcher import make_seq


def _queue(events: list[SeqEvent]) -> asyncio.Queue[SeqEvent]:
    queue: asyncio.Queue[SeqEvent] = asyncio.Queue()
    for event in events:
        queue.put_nowait(event)
    return queue


def test_tokens_queued_behind_an_event_go_out_with_it() -> None:
    seq = make_seq("r", prompt_len=3, max_tokens=8)
    first = SeqEvent(seq.seq_id, (5,), (-0.5,), top_logprobs=(((5, -0.5),),))
    queue = _queue(
        [
            SeqEvent(seq.seq_id, (6, 7), (-0.25, -1.0), top_logprobs=(((6, -0.25),), ((7, -1.0),))),
            SeqEvent(seq.seq_id, (8,), (-2.0,), Finish.LENGTH, top_logprobs=(((8, -2.0),),)),
        ]
    )
    event, pending = _coalesce(first, queue)
    assert pending is None and queue.empty()
    assert event.token_ids == (5, 6, 7, 8) and event.logprobs == (-0.5, -0.25, -1.0, -2.0)
    assert [top[0][0] for top in event.top_logprobs] == [5, 6, 7, 8]
    assert event.finish is Finish.LENGTH


def test_a_failure_waits_behind_the_tokens_before_it_and_nothing_after_is_taken() -> None:
    seq = make_seq("r", prompt_len=3, max_tokens=8)
    failed = SeqEvent(seq.seq_id, (), (), Finish.FAILED)
    later = SeqEvent(seq.seq_id, (9,), (-1.0,))
    queue = _queue([SeqEvent(seq.seq_id, (6,), (-0.25,)), failed, later])
    event, pending = _coalesce(SeqEvent(seq.seq_id, (5,), (-0.5,)), queue)
    assert event.token_ids == (5, 6) and event.finish is None
    assert pending is failed and queue.get_nowait() is later


def test_an_event_that_ends_the_sequence_takes_nothing_more() -> None:
    seq = make_seq("r", prompt_len=3, max_tokens=8)
    done = SeqEvent(seq.seq_id, (5,), (-0.5,), Finish.STOP)
    queue = _queue([SeqEvent(seq.seq_id, (6,), (-0.25,))])
    assert _coalesce(done, queue) == (done, None) and queue.qsize() == 1


async def test_a_subscription_sends_each_request_once_a_batch_and_ends_go_to_the_caller() -> None:
    subscription = Subscriptions().open("ipv4:127.0.0.1:5000")
    a, b = make_seq("a", prompt_len=3, max_tokens=8), make_seq("b", prompt_len=2, max_tokens=2)
    own_a, own_b = asyncio.Queue[SeqEvent](), asyncio.Queue[SeqEvent]()
    sink_a, sink_b = subscription.attach(1, a, own_a), subscription.attach(2, b, own_b)
    sink_a.put_nowait(SeqEvent(a.seq_id, (5,), (-0.5,)))
    sink_b.put_nowait(SeqEvent(b.seq_id, (6,), (-0.25,)))
    sink_a.put_nowait(SeqEvent(a.seq_id, (7,), (-1.0,)))  # the stream fell behind a step
    sink_b.put_nowait(SeqEvent(b.seq_id, (8,), (-2.0,), Finish.LENGTH))
    batch = await subscription.next_batch()
    assert [(tag, e.token_ids, e.logprobs, e.finish, first) for tag, e, first in batch] == [
        (1, (5, 7), (-0.5, -1.0), None, True),
        (2, (6, 8), (-0.25, -2.0), Finish.LENGTH, True),
    ]
    # The caller's own queue: a token-less event at the first token, then only the end.
    for seq, own in ((a, own_a), (b, own_b)):
        started = own.get_nowait()
        assert (started.seq_id, started.token_ids, started.finish) == (seq.seq_id, (), None)
    assert own_a.empty() and own_b.get_nowait().finish is Finish.LENGTH and own_b.empty()
    sink_a.put_nowait(SeqEvent(a.seq_id, (9,), (-3.0,)))
    assert [(tag, first) for tag, _, first in await subscription.next_batch()] == [(1, False)]
    assert own_a.empty()  # once only
    c, own_c = make_seq("c", prompt_len=2, max_tokens=1), asyncio.Queue[SeqEvent]()
    subscription.attach(3, c, own_c).put_nowait(SeqEvent(c.seq_id, (4,), (-0.1,), Finish.LENGTH))
    assert own_c.get_nowait().finish is Finish.LENGTH and own_c.empty()  # first and last
    subscription.attach(2, b, own_b)  # b's tag is free again once b ended


def test_a_failure_goes_to_the_caller_only_and_a_closed_stream_cancels_the_rest() -> None:
    subscriptions = Subscriptions()
    subscription = subscriptions.open("ipv4:127.0.0.1:5000")
    assert subscriptions.get(subscription.id, "ipv4:127.0.0.1:5000") is subscription
    with pytest.raises(SubscriptionError, match="is not open on this scheduler"):
        subscriptions.get(subscription.id, "ipv4:127.0.0.1:5001")  # another connection
    a, b = make_seq("a", prompt_len=3, max_tokens=8), make_seq("b", prompt_len=2, max_tokens=8)
    own_a, own_b = asyncio.Queue[SeqEvent](), asyncio.Queue[SeqEvent]()
    subscription.attach(1, a, own_a).put_nowait(SeqEvent(a.seq_id, (), (), Finish.FAILED))
    assert own_a.get_nowait().finish is Finish.FAILED
    subscription.attach(2, b, own_b)
    with pytest.raises(SubscriptionError, match="stream_tag 2 is already in use"):
        subscription.attach(2, a, own_a)
    subscriptions.close(subscription)
    ended = own_b.get_nowait()
    assert (ended.seq_id, ended.finish) == (b.seq_id, Finish.CANCELLED)
    with pytest.raises(SubscriptionError, match="is not open on this scheduler"):
        subscriptions.get(subscription.id, "ipv4:127.0.0.1:5000")
    with pytest.raises(SubscriptionError, match="is closed"):
        subscription.attach(3, a, own_a)
