"""Per-key rate limits: token buckets on requests per minute and tokens per minute.

Each key has up to two buckets. A bucket holds at most its per-minute limit and refills
continuously at limit/60 per second, so a key may burst up to a minute's allowance and then
proceeds at the steady rate. A refused request is told exactly when it would fit:
``retry_after = missing / rate``.

A request takes 1 from the request bucket and ``prompt tokens + max_tokens`` from the token
bucket, both or neither. When it finishes, ``Reservation.settle`` gives back the tokens it
did not use. A limit of 0 means unlimited. The limiter is plain synchronous code: call it from
the event loop's thread (it never awaits, so each call is atomic there).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

SECONDS_PER_MINUTE = 60.0
# Float slack, relative to the bucket's capacity, so that waiting exactly retry_after is
# enough even after the clock's rounding.
_SLACK = 1e-6


class RateLimitError(Exception):
    """Base of the limiter's refusals."""

    def __init__(self, message: str, key_id: str) -> None:
        super().__init__(message)
        self.key_id = key_id


class RateLimitedError(RateLimitError):
    """Over a limit now; retrying after ``retry_after`` seconds will fit.

    gRPC RESOURCE_EXHAUSTED, HTTP 429 with ``Retry-After: ceil(retry_after)``.
    """

    def __init__(self, key_id: str, unit: str, limit: int, retry_after: float) -> None:
        shown = math.ceil(round(retry_after * 10, 6)) / 10  # round up, but not float noise
        super().__init__(
            f"rate limit: {limit} {unit} per minute for key {key_id}; retry after {shown:.1f} s",
            key_id,
        )
        self.unit = unit
        """``"requests"`` or ``"tokens"``: the limit that binds longest."""
        self.limit = limit
        self.retry_after = retry_after
        """Seconds until both buckets hold enough for this request."""


class NeverFitsError(RateLimitError):
    """The request needs more tokens than the key's whole tokens-per-minute limit.

    Retrying cannot help: gRPC INVALID_ARGUMENT, HTTP 400 (or 429 without Retry-After).
    """

    def __init__(self, key_id: str, num_tokens: int, tpm: int) -> None:
        super().__init__(
            f"request needs {num_tokens} tokens (prompt plus max_tokens) but key {key_id} is "
            f"limited to {tpm} tokens per minute, so it can never fit; lower max_tokens or "
            "shorten the prompt",
            key_id,
        )
        self.num_tokens = num_tokens
        self.tpm = tpm


class _Bucket:
    __slots__ = ("capacity", "level", "rate", "updated")

    def __init__(self, capacity: int, now: float) -> None:
        self.capacity = float(capacity)
        self.rate = capacity / SECONDS_PER_MINUTE
        self.level = float(capacity)
        self.updated = now

    def refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
            self.updated = now

    def resize(self, capacity: int) -> None:
        self.capacity = float(capacity)
        self.rate = capacity / SECONDS_PER_MINUTE
        self.level = min(self.level, self.capacity)

    def wait_for(self, amount: int) -> float:
        """Seconds until the bucket holds ``amount``, 0 when it does now (after refill)."""
        missing = amount - self.level
        if missing <= _SLACK * self.capacity:
            return 0.0
        return missing / self.rate

    def is_full(self) -> bool:
        return self.level >= self.capacity


class Reservation:
    """What one admitted request took; ``settle`` gives back the tokens it did not use."""

    def __init__(
        self,
        key_id: str,
        num_tokens: int,
        bucket: _Bucket | None,
        clock: Callable[[], float],
    ) -> None:
        self.key_id = key_id
        self.num_tokens = num_tokens
        """Tokens taken from the key's tokens-per-minute bucket (prompt plus max_tokens)."""
        self._bucket = bucket
        self._clock = clock
        self.is_settled = False

    def settle(self, actual_tokens: int) -> int:
        """Refunds ``num_tokens - actual_tokens``; returns the tokens refunded.

        Only the first call counts. ``settle(0)`` gives back everything (a request that
        never ran). Using more than reserved charges the excess, so the key waits for it.
        """
        if actual_tokens < 0:
            raise ValueError(f"actual_tokens={actual_tokens}: must be >= 0")
        if self.is_settled:
            return 0
        self.is_settled = True
        refund = self.num_tokens - actual_tokens
        if self._bucket is not None and refund:
            self._bucket.refill(self._clock())
            self._bucket.level = min(self._bucket.capacity, self._bucket.level + refund)
        return max(refund, 0)

    def resize(self, num_tokens: int) -> None:
        """Takes ``num_tokens`` in all instead of the estimate taken so far (the bucket may
        go below zero: the key then waits for the difference)."""
        if self._bucket is not None and not self.is_settled:
            self._bucket.refill(self._clock())
            self._bucket.level -= num_tokens - self.num_tokens
        self.num_tokens = num_tokens


class RateLimiter:
    """Requests-per-minute and tokens-per-minute buckets for each key id."""

    def __init__(self, rpm: int, tpm: int, clock: Callable[[], float] = time.monotonic) -> None:
        _check_limit("rpm", rpm)
        _check_limit("tpm", tpm)
        self.rpm = rpm
        """Default requests per minute for a key; 0 for unlimited."""
        self.tpm = tpm
        """Default tokens per minute for a key; 0 for unlimited."""
        self._clock = clock
        self._requests: dict[str, _Bucket] = {}
        self._tokens: dict[str, _Bucket] = {}
        self._last_sweep = clock()

    @property
    def num_keys(self) -> int:
        """Keys that hold a bucket now (idle full buckets are dropped)."""
        return len(self._requests.keys() | self._tokens.keys())

    def reserve(
        self, key_id: str, tokens: int, *, rpm: int | None = None, tpm: int | None = None
    ) -> Reservation:
        """Takes 1 request and ``tokens`` tokens for ``key_id``, or raises.

        ``rpm`` and ``tpm`` override the defaults for this key (None: the default; 0:
        unlimited). Raises RateLimitedError when over a limit now and NeverFitsError when
        ``tokens`` exceeds the whole tokens-per-minute limit. A refused request takes nothing.
        """
        if tokens < 0:
            raise ValueError(f"tokens={tokens}: must be >= 0")
        rpm = self.rpm if rpm is None else rpm
        tpm = self.tpm if tpm is None else tpm
        _check_limit("rpm", rpm)
        _check_limit("tpm", tpm)
        if tpm and tokens > tpm:
            raise NeverFitsError(key_id, tokens, tpm)
        now = self._clock()
        self._maybe_sweep(now)
        requests = self._bucket(self._requests, key_id, rpm, now)
        token_bucket = self._bucket(self._tokens, key_id, tpm, now)
        waits: list[tuple[float, str, int]] = []
        if requests is not None:
            waits.append((requests.wait_for(1), "requests", rpm))
        if token_bucket is not None:
            waits.append((token_bucket.wait_for(tokens), "tokens", tpm))
        wait, unit, limit = max(waits, default=(0.0, "", 0))
        if wait > 0:
            raise RateLimitedError(key_id, unit, limit, wait)
        if requests is not None:
            requests.level -= 1
        if token_bucket is not None:
            token_bucket.level -= tokens
        return Reservation(key_id, tokens, token_bucket, self._clock)

    def true_up(self, reservation: Reservation, tokens: int, *, tpm: int | None = None) -> None:
        """Resizes ``reservation``, taken on an estimate, to the request's real ``tokens``;
        raises NeverFitsError when they exceed the key's whole tokens-per-minute limit."""
        tpm = self.tpm if tpm is None else tpm
        if tpm and tokens > tpm:
            raise NeverFitsError(reservation.key_id, tokens, tpm)
        reservation.resize(tokens)

    def sweep(self) -> int:
        """Drops the buckets that are full, which behave as new ones; returns how many."""
        now = self._clock()
        self._last_sweep = now
        dropped = 0
        for buckets in (self._requests, self._tokens):
            for key in list(buckets):
                bucket = buckets[key]
                bucket.refill(now)
                if bucket.is_full():
                    del buckets[key]
                    dropped += 1
        return dropped

    def _maybe_sweep(self, now: float) -> None:
        # A bucket refills from empty in one minute, so sweeping once a minute keeps only
        # the keys seen in about the last two minutes.
        if now - self._last_sweep >= SECONDS_PER_MINUTE:
            self.sweep()

    @staticmethod
    def _bucket(buckets: dict[str, _Bucket], key_id: str, limit: int, now: float) -> _Bucket | None:
        if limit == 0:
            buckets.pop(key_id, None)
            return None
        bucket = buckets.get(key_id)
        if bucket is None:
            bucket = buckets[key_id] = _Bucket(limit, now)
        else:
            bucket.refill(now)
            if bucket.capacity != limit:
                bucket.resize(limit)
        return bucket


def _check_limit(name: str, value: int) -> None:
    if value < 0:
        raise ValueError(f"{name}={value}: must be >= 0 (0 = unlimited)")
