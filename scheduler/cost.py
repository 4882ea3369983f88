"""How long a worker's step takes, learned from its results, and the prefill it can afford.

A step's time is close to linear in the tokens it computes: ``t(n) = a + b * n``. The fit is
a least-squares line over exponentially decayed sums of the recent steps, so it follows the
worker as load and the machine change. While sequences decode, the prefill chunk riding
along is sized so the step takes at most ``max_stall`` times a decode-only step; that is what
keeps a long prompt from freezing the streams already running (Sarathi-style chunking, but
with the budget learned rather than configured).

The bound weighs both sides of the trade: holding a prompt back spares each decoding stream
a slower step, but costs each waiting stream a step of its time to first token. So when more
streams wait for their first token than decode, the bound stretches by that ratio (TGI's
``waiting_served_ratio`` makes the same trade): a burst of new requests next to one running
stream is prefilled together instead of a chunk per step, while a single arrival next to a
busy batch still takes its ``max_stall`` share.

Only streams that were already streaming when the latest held prompt arrived are protected
(the scheduler counts them): the first part of a burst, admitted a step before the rest, has
no claim to be spared the rest's prefill, and with no protected stream the step is bounded
only by ``max_batched_tokens``. Otherwise a burst that arrives over a few milliseconds
would be prefilled a chunk per step behind its own first part, and every stream of it
that started late would finish that many steps late, in steps with fewer streams.

Noise must not turn into a stall: a line that does not rise is not trusted, and the budget
at most doubles from one step to the next, so one bad fit costs one step of twice the
chunk, never a whole prompt at once.
"""

from __future__ import annotations

from scheduler.sequence import Sequence

DECAY = 0.97  # weight kept by the sums per step: about the last 30 steps count
MIN_SPREAD = 4.0  # tokens of standard deviation in n before the slope is trusted


class StepCostModel:
    def __init__(self, max_stall: float, min_chunk: int) -> None:
        if max_stall < 1:
            raise ValueError(f"max_stall={max_stall}: must be >= 1")
        if min_chunk < 1:
            raise ValueError(f"min_chunk={min_chunk}: must be >= 1")
        self.max_stall = max_stall
        self.min_chunk = min_chunk
        self._w = self._n = self._t = self._nn = self._nt = 0.0
        self._last_budget = min_chunk

    def observe(self, num_tokens: int, seconds: float) -> None:
        d = DECAY
        self._w = self._w * d + 1
        self._n = self._n * d + num_tokens
        self._t = self._t * d + seconds
        self._nn = self._nn * d + num_tokens * num_tokens
        self._nt = self._nt * d + num_tokens * seconds

    def fit(self) -> tuple[float, float] | None:
        """(a, b) of t = a + b * n, or None until steps of different sizes were seen."""
        if self._w < 2:
            return None
        mean_n, mean_t = self._n / self._w, self._t / self._w
        var_n = self._nn / self._w - mean_n * mean_n
        if var_n < MIN_SPREAD**2:
            return None
        slope = (self._nt / self._w - mean_n * mean_t) / var_n
        if slope <= 0:
            return None
        return max(mean_t - slope * mean_n, 0.0), slope

    def prefill_budget(
        self, num_decodes: int, num_waiting: int = 0, num_protected: int | None = None
    ) -> int:
        """Prefill tokens a step with ``num_decodes`` decodes may add within the stall bound,
        stretched by ``num_waiting / num_protected`` when more streams wait for prefill than
        the bound protects (``num_protected``: the decoding streams it holds prefill back
        for; all of them by default)."""
        protected = num_decodes if num_protected is None else num_protected
        ratio = max(1.0, num_waiting / protected) if protected else 1.0
        fitted = self.fit()
        if fitted is None:
            budget = int(self.min_chunk * ratio)  # small probes until the line is known
        else:
            a, b = fitted
            target = self.max_stall * ratio * (a + b * num_decodes)
            budget = max(int((target - a) / b) - num_decodes, self.min_chunk)
            budget = min(budget, int(2 * ratio * self._last_budget))
        # Noise may at most double the budget of the last step, whatever the ratio was.
        self._last_budget = max(int(budget / ratio), self.min_chunk)
        return budget

    def budget(
        self, num_decodes: int, decoding: list[Sequence], held: list[Sequence], tick: int
    ) -> int:
        """The prefill budget of a step with ``num_decodes`` decodes, next to the
        ``decoding`` streams, for the ``held`` prompts (``tick``: results applied so far).
        Prompts are held back only for the streams that were streaming when the latest of
        them arrived: streams that started after (the first part of a burst, admitted a
        step before the rest) have no claim to be spared their prefill, so with none of the
        former the step is unbounded here (``max_batched_tokens`` still bounds it)."""
        latest = max((s.arrival_tick for s in held), default=tick)
        protected = sum(
            1 for s in decoding if s.first_token_tick is not None and s.first_token_tick <= latest
        )
        # Asked every step, so that the noise guard knows the last step's bound.
        bound = self.prefill_budget(num_decodes, len(held), protected)
        return bound if protected else UNBOUNDED


UNBOUNDED = 1 << 62
