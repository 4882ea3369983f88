"""How long a worker's step takes, learned from its results, and the prefill it can afford.

A step's time is close to linear in the tokens it computes, plus the attention of its
prefill chunks over the context before them: ``t = a + b * n + c * w``, where ``w`` sums
``chunk * (context + chunk)`` over the step's prefill chunks (in thousands). The attention
term is what makes a late chunk of a long prompt cost several times an early one (on a CPU a
64-token chunk over 2,000 cached tokens spends ~8 ms a layer in attention). The fit is least
squares over exponentially decayed sums of the recent steps, so it follows the worker as load
and the machine change; until the steps' attention varies enough to tell ``c`` apart, it is
the line ``a + b * n``. While sequences decode, the prefill chunk riding
along is sized so the step takes at most ``max_stall`` times a decode-only step; that is what
keeps a long prompt from freezing the streams already running (Sarathi-style chunking, but
with the budget learned rather than configured).

The bound weighs both sides of the trade: holding a prompt back spares each decoding stream
a slower step, but costs each waiting stream a step of its time to first token. So when more
streams wait for their first token than decode, the bound stretches by that ratio (TGI's
``waiting_served_ratio`` makes the same trade): a burst of new requests next to one running
stream is prefilled together instead of a chunk per step, while a single arrival next to a
busy batch still takes its ``max_stall`` share.

Noise must not turn into a stall: a line that does not rise is not trusted, and the budget
at most doubles from one step to the next, so one bad fit costs one step of twice the
chunk, never a whole prompt at once.
"""

from __future__ import annotations

import math

DECAY = 0.97  # weight kept by the sums per step: about the last 30 steps count
MIN_SPREAD = 4.0  # tokens of standard deviation in n before the slope is trusted


def attention_work(chunk: int, context: int) -> float:
    """The attention term of a prefill chunk of ``chunk`` tokens after ``context`` ones."""
    return chunk * (context + chunk) / 1000


class StepCostModel:
    def __init__(self, max_stall: float, min_chunk: int) -> None:
        if max_stall < 1:
            raise ValueError(f"max_stall={max_stall}: must be >= 1")
        if min_chunk < 1:
            raise ValueError(f"min_chunk={min_chunk}: must be >= 1")
        self.max_stall = max_stall
        self.min_chunk = min_chunk
        self._w = self._n = self._t = self._nn = self._nt = 0.0
        self._a = self._aa = self._na = self._at = 0.0  # sums of the attention term
        self._last_budget = min_chunk

    def observe(self, num_tokens: int, seconds: float, attention: float = 0.0) -> None:
        d = DECAY
        self._w = self._w * d + 1
        self._n = self._n * d + num_tokens
        self._t = self._t * d + seconds
        self._nn = self._nn * d + num_tokens * num_tokens
        self._nt = self._nt * d + num_tokens * seconds
        self._a = self._a * d + attention
        self._aa = self._aa * d + attention * attention
        self._na = self._na * d + num_tokens * attention
        self._at = self._at * d + attention * seconds

    def fit_attention(self) -> tuple[float, float, float] | None:
        """(a, b, c) of t = a + b * n + c * w, or None while c cannot be told apart (then
        ``fit`` is the model)."""
        if self._w < 3:
            return None
        w = self._w
        mean_n, mean_a, mean_t = self._n / w, self._a / w, self._t / w
        var_n = self._nn / w - mean_n * mean_n
        var_a = self._aa / w - mean_a * mean_a
        cov_na = self._na / w - mean_n * mean_a
        cov_nt = self._nt / w - mean_n * mean_t
        cov_at = self._at / w - mean_a * mean_t
        det = var_n * var_a - cov_na * cov_na
        if var_n < MIN_SPREAD**2 or var_a <= 0 or det <= 1e-6 * var_n * var_a:
            return None
        b = (cov_nt * var_a - cov_at * cov_na) / det
        c = (cov_at * var_n - cov_nt * cov_na) / det
        if b <= 0 or c <= 0:
            return None
        return max(mean_t - b * mean_n - c * mean_a, 0.0), b, c

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

    def prefill_budget(self, num_decodes: int, num_waiting: int = 0, context: int = 0) -> int:
        """Prefill tokens a step with ``num_decodes`` decodes may add within the stall bound,
        stretched by ``num_waiting / num_decodes`` when more streams wait for prefill; the
        chunk follows ``context`` tokens of its sequence already computed."""
        ratio = max(1.0, num_waiting / num_decodes) if num_decodes else 1.0
        line = self.fit()
        if line is None:
            budget = int(self.min_chunk * ratio)  # small probes until the line is known
        else:
            a, b, c = self.fit_attention() or (*line, 0.0)
            target = self.max_stall * ratio * (a + b * num_decodes)
            room = target - a - b * num_decodes  # seconds the chunk may add
            budget = max(int(_largest_chunk(room, b, c / 1000, context)), self.min_chunk)
            budget = min(budget, int(2 * ratio * self._last_budget))
        # Noise may at most double the budget of the last step, whatever the ratio was.
        self._last_budget = max(int(budget / ratio), self.min_chunk)
        return budget


def _largest_chunk(room: float, b: float, c: float, context: int) -> float:
    """The largest n with b * n + c * n * (context + n) <= room."""
    if room <= 0:
        return 0.0
    linear = b + c * context
    # the positive root of c n^2 + linear n - room, in the form that stays exact as c -> 0
    return 2 * room / (linear + math.sqrt(linear * linear + 4 * c * room))
