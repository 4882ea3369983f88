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

Attention makes a prompt's late chunks dearer than its early ones: each of a chunk's tokens
reads every key before it. So the model also fits a cost per key read, ``t = a + b * n + c *
k`` (``k``: the keys the step's queries attend over, counted by the batcher), once steps with
different key counts were seen, and sizes a chunk at the prompt's position: the largest chunk
whose extra time stays within the bound. Without a trusted key term the plain line sizes it.

The bound is held against the decode step as measured, not as the line puts it: a step
that carries any chunk costs more than its tokens' share (the int4 kernel reads its weights
once more for each register tile of rows, and the attention runs a group more), so a line
fitted to chunk steps puts a decode-only step higher than it is (by ~10% on the Zen 4 of
README, Speed: 8 decodes plus one token at position 1,800 take 1.26x a decode step, each
further token ~0.25x), and a bound taken from the line let chunk steps run that much over
it. So the model keeps the recent decode-only steps' mean apart (moved to the step's decodes
and keys by the fitted slopes) and holds the step's whole estimate to ``max_stall`` times
the lower of the two, and of the median of the latest ``DECODE_WINDOW`` decode-only steps at
their own keys: what the streams' median gap was. The key slope, fitted mostly to chunk
steps, also carries what carrying any chunk costs, so moving the decode steps by it raised
the bound over a prefill (on the quiet Zen 4, bench/kv.py: bounds 1.73-1.77x the streams'
median gap at ``max_stall`` 1.5), and one slow decode step among the last three did too.

``min_chunk`` is the probe: the chunk a step carries while its cost is not known yet. Once it
is, the bound alone sizes the chunk, one token at least (the prompt always progresses). A
floor of ``min_chunk`` tokens would break the bound by itself: on the AMD EPYC (Zen 4) of
README, Speed (SmolLM2, bfloat16, one thread, ``bench/step_probe.py --interference 16``) 16
fresh tokens add ~0.9x a decode step of 8 streams, and 16 tokens after 1,800 cached ones
2.5-3.4x.

Noise must not turn into a stall, nor into a prompt that stops progressing: a line that does
not rise is not trusted; the budget at most doubles from one step to the next, so one bad
fit costs one step of twice the chunk, never a whole prompt at once; and a step that took
more than ``OUTLIER`` times what the model expects is not learned from unless the next ones
agree (a busy host stalls single steps by 10x: that is not what the step costs, and a key
term fitted to it would hold late chunks to a token a step).

The fit is slow to follow a machine whose steps all got faster or slower at once: a worker's
first steps build its kernels' shapes and run several times their warm cost, and a fit over
the last ~30 steps keeps chunk estimates that high for a while (on the loaded Zen 4, steps
that went from 40 to 18 ms of CPU left chunk steps at 2.3-2.9x the warm decode step). So the
first ``warmup_steps`` a worker runs are not learned from at all, and ``DRIFT_RUN`` steps in a
row that all ran more than ``DRIFT`` times faster or slower than estimated re-anchor the fit:
every time it holds is scaled by their geometric mean ratio, which keeps the shape it learned
(how a token and a key compare) and moves its scale to what the steps take now. The decode
steps the bound is held against are averaged over the last few (``DECODE_DECAY``), since they
say what a stream waits between tokens now.

A chunk is sized for the bound less what chunk steps recently ran over their estimate: the
mean, and once there were ``SPREAD_STEPS`` of them, one standard deviation more, since a
stream sees its worst gap: steps that run 10% over and under their estimate in turn keep
every step within the bound at the price of ~30% smaller chunks.
"""

from __future__ import annotations

import math
from collections import deque

from scheduler.sequence import Sequence

DECAY = 0.97  # weight kept by the sums per step: about the last 30 steps count
MIN_SPREAD = 4.0  # tokens of standard deviation in n before the slope is trusted
MIN_INDEPENDENCE = 0.1  # share of n's and k's variance not explained by each other
MIN_T = 2.0  # a key term within this many standard errors of zero is noise, not a cost
OUTLIER = 3.0  # a step this many times slower than expected is suspect
OUTLIER_RUN = 3  # ... unless this many in a row are: then the machine changed, learn them
DRIFT = 1.5  # a step this many times faster or slower than estimated has drifted ...
DRIFT_RUN = 3  # ... and this many in a row, on the same side, re-anchor the fit
DECODE_DECAY = 0.7  # weight kept by the decode-only steps' sums: about the last 3 count
DECODE_WINDOW = 9  # the latest decode-only steps whose median a stream's gap is held against
SPREAD_STEPS = 8  # chunk steps (decayed) before their spread around the estimate counts
WARMUP_STEPS = 4  # a worker's first steps, which build its kernels' shapes, are not learned


class StepCostModel:
    def __init__(self, max_stall: float, min_chunk: int, warmup_steps: int = 0) -> None:
        if max_stall < 1:
            raise ValueError(f"max_stall={max_stall}: must be >= 1")
        if min_chunk < 1:
            raise ValueError(f"min_chunk={min_chunk}: must be >= 1")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps}: must be >= 0")
        self.max_stall = max_stall
        self.warmup_steps = warmup_steps  # steps still to skip
        self.bound_seconds: float | None = None  # the last budget's step time bound
        self.min_chunk = min_chunk
        self._w = self._n = self._t = self._nn = self._nt = 0.0
        self._k = self._kk = self._nk = self._kt = 0.0
        self._tt = self._ww = 0.0  # for the key term's standard error
        self._last_budget = min_chunk
        self._slope: float | None = None  # b of the last trusted line
        self._key_slopes: tuple[float, float] | None = None  # b, c of the last trusted fit
        self._suspect: list[tuple[int, float, int]] = []
        # the latest steps that drifted (held back until they make a run), each with its
        # measured / estimated ratio
        self._drift: list[tuple[tuple[int, float, int, bool | None], float]] = []
        self.num_reanchored = 0
        self.last_factor = 1.0  # the last re-anchor's scale
        # decayed sums of the decode-only steps: weight, tokens, keys, seconds
        self._decodes = (0.0, 0.0, 0.0, 0.0)
        # the latest decode-only steps as they ran: tokens, seconds
        self._recent: deque[tuple[int, float]] = deque(maxlen=DECODE_WINDOW)
        # decayed sums of what steps with prompt tokens took over the line's estimate
        self._excess = (0.0, 0.0, 0.0)  # and their squares

    def observe(
        self,
        num_tokens: int,
        seconds: float,
        num_keys: int = 0,
        is_decode_only: bool | None = None,
    ) -> None:
        """One step's time: ``num_tokens`` computed, ``num_keys`` keys read by their queries;
        ``is_decode_only``: every sequence computed its one newest token (no prompt, no
        drafts), False: some prompt's tokens too, None: not told. A step over ``OUTLIER``
        times its estimate waits until ``OUTLIER_RUN`` in a row; ``DRIFT_RUN`` in a row off
        by ``DRIFT`` the same way re-anchor the fit first."""
        if self.warmup_steps > 0:
            self.warmup_steps -= 1
            return
        step = (num_tokens, seconds, num_keys, is_decode_only)
        expected = self.estimate(num_tokens, num_keys)
        ratio = 1.0 if expected is None or expected <= 0 else seconds / expected
        if 1 / DRIFT <= ratio <= DRIFT:
            self._flush_drift()
            self._take(*step)
            return
        if self._drift and (self._drift[-1][1] > 1) != (ratio > 1):
            self._flush_drift()  # drifted the other way: a new run
        self._drift.append((step, ratio))
        if len(self._drift) >= DRIFT_RUN:
            ratios = [r for _, r in self._drift]
            self._rescale(math.exp(sum(math.log(r) for r in ratios) / len(ratios)))
            self._flush_drift()

    def _flush_drift(self) -> None:
        """Learns the drifted steps held back (after a re-anchor, or as a run that broke)."""
        held, self._drift = self._drift, []
        for step, _ in held:
            self._take(*step)

    def _take(
        self, num_tokens: int, seconds: float, num_keys: int, is_decode_only: bool | None
    ) -> None:
        """observe's step, past the drift check: the outlier guard, then the sums."""
        expected = self.estimate(num_tokens, num_keys)
        if expected is None or seconds <= OUTLIER * expected:
            self._suspect.clear()  # the suspects before a step like this one were spikes
            self._learn(num_tokens, seconds, num_keys)
            if is_decode_only:
                d, (w, n, k, t) = DECODE_DECAY, self._decodes
                self._decodes = (w * d + 1, n * d + num_tokens, k * d + num_keys, t * d + seconds)
                self._recent.append((num_tokens, seconds))
            elif is_decode_only is not None and expected is not None:
                d, (w, excess, squares) = DECAY, self._excess
                over = seconds - expected
                self._excess = (w * d + 1, excess * d + over, squares * d + over * over)
            return
        self._suspect.append((num_tokens, seconds, num_keys))
        if len(self._suspect) >= OUTLIER_RUN:
            for suspect in self._suspect:
                self._learn(*suspect)
            self._suspect.clear()

    def _rescale(self, factor: float) -> None:
        """Every time the fit holds, times ``factor``: the same shape, another scale. What
        chunk steps ran over the old estimates is forgotten (the next ones say it anew). The
        decode steps measured stay as they were: the bound takes the lower of them and the
        fit's decode step, so steps that all ran faster lower it at once, and chunk steps
        that ran slower (maybe the chunks' cost alone: while a prompt is prefilled, no step
        is decode-only) do not raise it."""
        self._t *= factor
        self._nt *= factor
        self._kt *= factor
        self._tt *= factor * factor
        if self._slope is not None:
            self._slope *= factor
        if self._key_slopes is not None:
            self._key_slopes = (self._key_slopes[0] * factor, self._key_slopes[1] * factor)
        self._excess = (0.0, 0.0, 0.0)  # and their squares
        self._suspect.clear()
        self.num_reanchored += 1
        self.last_factor = round(factor, 3)

    def measured_decode(self, num_decodes: int, decode_keys: int, b: float, c: float) -> float:
        """A decode-only step of ``num_decodes`` over ``decode_keys`` keys as the recent ones
        took, moved to these counts by the slopes ``b`` and ``c``; infinite before any."""
        w, n, k, t = self._decodes
        if w == 0:
            return math.inf
        return (t + b * (num_decodes * w - n) + c * (decode_keys * w - k)) / w

    def median_decode(self, num_decodes: int, b: float) -> float:
        """The median of the latest ``DECODE_WINDOW`` decode-only steps, each moved to
        ``num_decodes`` rows by the slope ``b``, but not to today's keys: what a stream's
        median gap was; infinite before any."""
        if not self._recent:
            return math.inf
        moved = sorted(t + b * (num_decodes - n) for n, t in self._recent)
        middle = len(moved) // 2
        return moved[middle] if len(moved) % 2 else (moved[middle - 1] + moved[middle]) / 2

    def chunk_excess(self, room: float = math.inf) -> float:
        """Seconds a step with prompt tokens recently took beyond the line's estimate (at
        least 0): the fixed cost of carrying a chunk, which a line through decode-only and
        chunk steps alike spreads over its slopes; once ``SPREAD_STEPS`` were seen, plus one
        standard deviation of it, so that a chunk step that runs slow stays within the bound
        too (the streams see the worst gap, not the mean one). The deviation counts for at
        most half the ``room`` the bound leaves a chunk: on a busy host steps jitter by more
        than the room, and a prompt a token a step would wait for minutes."""
        w, excess, squares = self._excess
        if not w:
            return 0.0
        mean = excess / w
        spread = math.sqrt(max(squares / w - mean * mean, 0.0)) if w >= SPREAD_STEPS else 0.0
        return max(mean + min(spread, room / 2), 0.0)

    def estimate(self, num_tokens: int, num_keys: int = 0) -> float | None:
        """Seconds a step of ``num_tokens`` over ``num_keys`` keys should take, or None while
        no line is trusted."""
        with_keys, line = self._fits()
        if with_keys is not None:
            a, b, c = with_keys
            return a + b * num_tokens + c * num_keys
        return None if line is None else line[0] + line[1] * num_tokens

    def _fits(self) -> tuple[tuple[float, float, float] | None, tuple[float, float] | None]:
        """The key fit and the plain line to size chunks by. Steps of one size for a while
        (decode only, or late chunks all alike) make a slope unidentifiable, and noise may
        hide a key term that is there (a busy host): neither says the cost changed, so the
        last trusted slopes stand, with the intercept the recent steps' mean time gives,
        until the steps rule their key term out (falling back to the plain line, blind to
        keys, let late chunks double to 288 tokens, a 2.5 s step, on the loaded Zen 4)."""
        (with_keys, plausible), line = self._solve_keys(), self.fit()
        if with_keys is not None:
            self._key_slopes = with_keys[1:]
        elif self._key_slopes is not None and plausible is not None:
            if self._key_slopes[1] > plausible:
                self._key_slopes = None  # the steps now rule it out: it was noise
        if with_keys is None and self._key_slopes is not None:
            b, c = self._key_slopes
            a = (self._t - b * self._n - c * self._k) / self._w
            with_keys = max(a, 0.0), b, c
        if line is not None:
            self._slope = line[1]
        elif self._slope is not None:
            line = max((self._t - self._slope * self._n) / self._w, 0.0), self._slope
        return with_keys, line

    def _learn(self, num_tokens: int, seconds: float, num_keys: int) -> None:
        d = DECAY
        self._w = self._w * d + 1
        self._n = self._n * d + num_tokens
        self._t = self._t * d + seconds
        self._nn = self._nn * d + num_tokens * num_tokens
        self._nt = self._nt * d + num_tokens * seconds
        self._k = self._k * d + num_keys
        self._kk = self._kk * d + num_keys * num_keys
        self._nk = self._nk * d + num_tokens * num_keys
        self._kt = self._kt * d + num_keys * seconds
        self._tt = self._tt * d + seconds * seconds
        self._ww = self._ww * d * d + 1

    def fit_keys(self) -> tuple[float, float, float] | None:
        """(a, b, c) of t = a + b * n + c * k, or None while the key term is not trusted:
        too few steps, key counts that barely vary or move in step with n, a slope that
        does not rise, or a key term within ``MIN_T`` standard errors of zero."""
        return self._solve_keys()[0]

    def _solve_keys(self) -> tuple[tuple[float, float, float] | None, float | None]:
        """The key fit, and the largest cost per key the steps leave plausible (the fit's
        c plus ``MIN_T`` standard errors; None where the steps cannot tell)."""
        if self._w < 3:
            return None, None
        w = self._w
        mean_n, mean_k, mean_t = self._n / w, self._k / w, self._t / w
        var_n = self._nn / w - mean_n * mean_n
        var_k = self._kk / w - mean_k * mean_k
        cov_nk = self._nk / w - mean_n * mean_k
        det = var_n * var_k - cov_nk * cov_nk
        if var_n < MIN_SPREAD**2 or var_k < MIN_SPREAD**2 or det < MIN_INDEPENDENCE * var_n * var_k:
            return None, None
        cov_nt = self._nt / w - mean_n * mean_t
        cov_kt = self._kt / w - mean_k * mean_t
        b = (cov_nt * var_k - cov_kt * cov_nk) / det
        c = (cov_kt * var_n - cov_nt * cov_nk) / det
        # least squares' standard error of c over the decayed steps (w^2 / ww of them)
        residual = max(self._tt / w - mean_t * mean_t - b * cov_nt - c * cov_kt, 0.0)
        num_steps = w * w / self._ww
        stderr = math.sqrt(residual * var_n / (det * max(num_steps - 3, 1.0)))
        if b <= 0 or c <= MIN_T * stderr:
            return None, c + MIN_T * stderr
        return (max(mean_t - b * mean_n - c * mean_k, 0.0), b, c), c + MIN_T * stderr

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
        self,
        num_decodes: int,
        num_waiting: int = 0,
        num_protected: int | None = None,
        position: int = 0,
        decode_keys: int = 0,
    ) -> int:
        """Prefill tokens a step with ``num_decodes`` decodes may add within the stall bound,
        stretched by ``num_waiting / num_protected`` when more streams wait for prefill than
        the bound protects (``num_protected``: the decoding streams it holds prefill back
        for; all of them by default). ``position``: tokens of the prompt already computed,
        ``decode_keys``: keys the decodes read (both count only with a trusted key term)."""
        protected = num_decodes if num_protected is None else num_protected
        ratio = max(1.0, num_waiting / protected) if protected else 1.0
        with_keys, fitted = self._fits()
        if with_keys is not None:
            a, b, c = with_keys
            decode = a + b * num_decodes + c * decode_keys
            measured = self.measured_decode(num_decodes, decode_keys, b, c)
            reference = min(decode, measured, self.median_decode(num_decodes, b))
            self.bound_seconds = self.max_stall * ratio * reference
            room = self.bound_seconds - reference
            extra = self.bound_seconds - decode - self.chunk_excess(room)
            budget = largest_chunk(max(extra, 0.0), b, c, position)
            budget = min(budget, int(2 * ratio * self._last_budget))
        elif fitted is None:
            budget = int(self.min_chunk * ratio)  # small probes until the line is known
            self.bound_seconds = None
        else:
            a, b = fitted
            decode = a + b * num_decodes
            measured = self.measured_decode(num_decodes, decode_keys, b, 0.0)
            reference = min(decode, measured, self.median_decode(num_decodes, b))
            self.bound_seconds = self.max_stall * ratio * reference
            target = self.bound_seconds - self.chunk_excess(self.bound_seconds - reference)
            budget = max(int((target - a) / b) - num_decodes, 1)
            budget = min(budget, int(2 * ratio * self._last_budget))
        # Noise may at most double the budget of the last step, whatever the ratio was.
        self._last_budget = max(int(budget / ratio), self.min_chunk)
        return budget

    def budget(
        self,
        num_decodes: int,
        decoding: list[Sequence],
        held: list[Sequence],
        tick: int,
        position: int = 0,
    ) -> int:
        """The prefill budget of a step with ``num_decodes`` decodes, next to the
        ``decoding`` streams, for the ``held`` prompts (``tick``: results applied so far;
        ``position``: tokens of the first held prompt computed or in flight).
        Prompts are held back only for the streams that were streaming when the latest of
        them arrived: streams that started after (the first part of a burst, admitted a
        step before the rest) have no claim to be spared their prefill, so with none of the
        former the step is unbounded here (``max_batched_tokens`` still bounds it)."""
        latest = max((s.arrival_tick for s in held), default=tick)
        protected = sum(
            1 for s in decoding if s.first_token_tick is not None and s.first_token_tick <= latest
        )
        # Asked every step, so that the noise guard knows the last step's bound.
        keys = sum(s.num_computed + 1 for s in decoding)
        bound = self.prefill_budget(num_decodes, len(held), protected, position, keys)
        if not protected:
            self.bound_seconds = None  # no step time bound holds this step
            return UNBOUNDED
        return bound


def chunk_keys(num_tokens: int, position: int) -> int:
    """Keys a chunk of ``num_tokens`` after ``position`` computed ones reads: each token
    attends over every token before it and itself."""
    return num_tokens * position + num_tokens * (num_tokens + 1) // 2


def largest_chunk(seconds: float, b: float, c: float, position: int) -> int:
    """The most tokens, at least one, a chunk after ``position`` computed ones may have for
    ``b * n + c * chunk_keys(n, position) <= seconds``."""
    linear = b + c * (position + 0.5)
    n = int((-linear + math.sqrt(linear * linear + 2 * c * seconds)) / c)
    while n > 1 and b * n + c * chunk_keys(n, position) > seconds:
        n -= 1  # float rounding
    while b * (n + 1) + c * chunk_keys(n + 1, position) <= seconds:
        n += 1
    return max(n, 1)


UNBOUNDED = 1 << 62
