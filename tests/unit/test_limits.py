"""Per-key token buckets on a fake clock: bursts, exact retry_after, refunds and overrides."""

from __future__ import annotations

import random

import pytest

from gateway.limits import NeverFitsError, RateLimitedError, RateLimiter


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_limiter(rpm: int, tpm: int) -> tuple[RateLimiter, FakeClock]:
    clock = FakeClock()
    return RateLimiter(rpm, tpm, clock=clock), clock


def test_request_burst_past_the_bucket_is_refused_until_exactly_retry_after() -> None:
    limiter, clock = make_limiter(rpm=60, tpm=0)
    for _ in range(60):
        limiter.reserve("abcd1234", 10)
    clock.advance(0.2)  # refilled 0.2 of a request: 0.8 s to go

    with pytest.raises(RateLimitedError) as info:
        limiter.reserve("abcd1234", 10)

    assert info.value.retry_after == pytest.approx(0.8)
    assert info.value.unit == "requests" and info.value.limit == 60
    assert str(info.value) == (
        "rate limit: 60 requests per minute for key abcd1234; retry after 0.8 s"
    )
    clock.advance(info.value.retry_after - 0.01)
    with pytest.raises(RateLimitedError):
        limiter.reserve("abcd1234", 10)
    clock.advance(0.01)
    limiter.reserve("abcd1234", 10)  # exactly retry_after after the refusal


def test_waiting_exactly_retry_after_always_succeeds() -> None:
    # Float rounding of clock + retry_after must never leave a bucket a hair short.
    rng = random.Random(1)
    for _ in range(300):
        clock = FakeClock(rng.uniform(0, 1e6))
        tpm = rng.randint(1, 100_000)
        limiter = RateLimiter(rng.randint(1, 1000), tpm, clock=clock)
        for _ in range(20):
            num_tokens = rng.randint(0, tpm)
            try:
                limiter.reserve("k", num_tokens)
            except RateLimitedError as exc:
                clock.advance(exc.retry_after)
                limiter.reserve("k", num_tokens)
            clock.advance(rng.uniform(0, 0.5))


def test_token_burst_is_refused_with_the_time_the_missing_tokens_take() -> None:
    limiter, clock = make_limiter(rpm=0, tpm=6000)  # refills 100 tokens a second
    limiter.reserve("k", 5000)

    with pytest.raises(RateLimitedError) as info:
        limiter.reserve("k", 1250)  # 1000 left, 250 missing

    assert info.value.retry_after == pytest.approx(2.5)
    assert str(info.value) == "rate limit: 6000 tokens per minute for key k; retry after 2.5 s"
    clock.advance(info.value.retry_after)
    reservation = limiter.reserve("k", 1250)
    assert reservation.num_tokens == 1250


def test_a_refused_request_takes_nothing() -> None:
    limiter, _ = make_limiter(rpm=2, tpm=100)
    limiter.reserve("k", 90)
    with pytest.raises(RateLimitedError) as info:
        limiter.reserve("k", 20)  # the request bucket had room, the token bucket not
    assert info.value.unit == "tokens"

    limiter.reserve("k", 10)  # the refused call did not spend the second request


def test_the_limit_that_binds_longest_is_named() -> None:
    limiter, _ = make_limiter(rpm=1, tpm=600)  # a request back in 60 s, 10 tokens in 1 s
    limiter.reserve("k", 590)

    with pytest.raises(RateLimitedError) as info:
        limiter.reserve("k", 20)

    assert info.value.unit == "requests"
    assert info.value.retry_after == pytest.approx(60.0)


def test_settle_refunds_the_unused_tokens_once() -> None:
    limiter, _ = make_limiter(rpm=0, tpm=1000)
    reservation = limiter.reserve("k", 800)  # prompt + max_tokens

    assert reservation.settle(300) == 500
    assert reservation.is_settled
    assert reservation.settle(0) == 0  # only the first settle counts
    limiter.reserve("k", 700)  # 200 left + 500 refunded
    with pytest.raises(RateLimitedError):
        limiter.reserve("k", 1)


def test_settle_zero_gives_everything_back_and_never_overfills() -> None:
    limiter, _ = make_limiter(rpm=0, tpm=1000)
    first = limiter.reserve("k", 600)
    assert first.settle(0) == 600
    limiter.reserve("k", 1000)  # full again, and no fuller than capacity
    with pytest.raises(RateLimitedError):
        limiter.reserve("k", 1)


def test_using_more_than_reserved_charges_the_excess() -> None:
    limiter, _ = make_limiter(rpm=0, tpm=600)
    assert limiter.reserve("k", 100).settle(500) == 0  # 500 used in all: 100 left

    with pytest.raises(RateLimitedError) as info:
        limiter.reserve("k", 200)  # 100 missing at 10 a second
    assert info.value.retry_after == pytest.approx(10.0)


def test_zero_means_unlimited() -> None:
    limiter, _ = make_limiter(rpm=0, tpm=0)
    for _ in range(10_000):
        limiter.reserve("k", 1_000_000).settle(5)
    assert limiter.num_keys == 0  # nothing is tracked for unlimited keys


def test_per_key_overrides_beat_the_defaults() -> None:
    limiter, _ = make_limiter(rpm=1, tpm=100)
    limiter.reserve("default", 100)
    with pytest.raises(RateLimitedError):
        limiter.reserve("default", 1)

    for _ in range(5):
        limiter.reserve("generous", 1000, rpm=5, tpm=10_000)
    with pytest.raises(RateLimitedError) as info:
        limiter.reserve("generous", 1, rpm=5, tpm=10_000)
    assert str(info.value).startswith("rate limit: 5 requests per minute for key generous;")

    for _ in range(100):
        limiter.reserve("unlimited", 50_000, rpm=0, tpm=0)


def test_a_request_larger_than_the_whole_tpm_can_never_fit() -> None:
    limiter, _ = make_limiter(rpm=60, tpm=4000)

    with pytest.raises(NeverFitsError) as info:
        limiter.reserve("abcd1234", 4001)

    assert str(info.value) == (
        "request needs 4001 tokens (prompt plus max_tokens) but key abcd1234 is limited to "
        "4000 tokens per minute, so it can never fit; lower max_tokens or shorten the prompt"
    )
    assert (info.value.num_tokens, info.value.tpm, info.value.key_id) == (4001, 4000, "abcd1234")
    limiter.reserve("abcd1234", 4000)  # exactly the capacity fits, and nothing was taken


def test_keys_have_separate_buckets() -> None:
    limiter, _ = make_limiter(rpm=1, tpm=0)
    limiter.reserve("a", 0)
    limiter.reserve("b", 0)
    with pytest.raises(RateLimitedError, match="for key a;"):
        limiter.reserve("a", 0)


def test_refill_is_continuous_and_capped_at_the_limit() -> None:
    limiter, clock = make_limiter(rpm=0, tpm=600)
    limiter.reserve("k", 600)
    clock.advance(3600)  # an hour idle still holds only one minute's worth
    limiter.reserve("k", 600)
    with pytest.raises(RateLimitedError) as info:
        limiter.reserve("k", 1)
    assert info.value.retry_after == pytest.approx(0.1)


def test_idle_full_buckets_are_dropped() -> None:
    limiter, clock = make_limiter(rpm=60, tpm=6000)
    for i in range(100):
        limiter.reserve(f"key-{i}", 6000)  # empties its token bucket: full again in 60 s
    clock.advance(30)
    limiter.reserve("busy", 6000)
    assert limiter.num_keys == 101

    clock.advance(30)  # the first 100 are full again; the once-a-minute sweep runs on its own
    limiter.reserve("late", 1)

    assert limiter.num_keys == 2  # busy (half refilled) and late
    assert limiter.sweep() == 0
    with pytest.raises(RateLimitedError):
        limiter.reserve("busy", 6000)  # its state survived the sweep


def test_a_changed_override_resizes_the_bucket() -> None:
    limiter, _ = make_limiter(rpm=0, tpm=1000)
    limiter.reserve("k", 200)  # 800 left
    limiter.reserve("k", 500, tpm=500)  # shrunk: holds at most 500, so 0 left
    with pytest.raises(RateLimitedError):
        limiter.reserve("k", 1, tpm=500)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: RateLimiter(-1, 0), "rpm=-1: must be >= 0"),
        (lambda: RateLimiter(0, -2), "tpm=-2: must be >= 0"),
        (lambda: RateLimiter(0, 0).reserve("k", -1), "tokens=-1: must be >= 0"),
        (lambda: RateLimiter(0, 0).reserve("k", 1, rpm=-3), "rpm=-3: must be >= 0"),
        (lambda: RateLimiter(0, 0).reserve("k", 1).settle(-1), "actual_tokens=-1: must be >= 0"),
    ],
)
def test_bad_arguments_name_the_field(call: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()  # type: ignore[operator]
