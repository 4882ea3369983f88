"""What a worker's step result teaches the batcher: what a step costs (scheduler/cost.py)
and whether drafts pay (scheduler/speculation.py)."""

from __future__ import annotations

from canteen.logging import get_logger
from canteen.plan import StepPlan, StepResult
from scheduler.cost import StepCostModel
from scheduler.speculation import SpeculationPolicy

log = get_logger(__name__)


def observe_step(
    cost: StepCostModel | None,
    speculation: SpeculationPolicy,
    plan: StepPlan,
    result: StepResult,
    since: float | None,
    num_keys: int = 0,
    is_decode_only: bool = False,
) -> None:
    """Feeds the cost model and the speculation rule; ``since``: seconds since the previous
    result arrived (None for the first); ``num_keys``: keys the step's queries read;
    ``is_decode_only``: every sequence computed its newest token, none a prompt's."""
    if result.total_ns <= 0 or not plan.scheduled:
        return
    seconds, computed = result.total_ns / 1e9, plan.num_tokens + result.num_draft_tokens
    if cost is not None:
        expected = cost.estimate(computed, num_keys)
        # what a stall shows up as: each step's tokens, its estimate and its time (DEBUG)
        log.debug(
            "step cost",
            step_id=plan.step_id,
            num_tokens=computed,
            num_sequences=len(plan.scheduled),
            num_keys=num_keys,
            estimated_ms=None if expected is None else round(expected * 1e3, 2),
            took_ms=round(seconds * 1e3, 2),
            # since the previous result: the step plus any wait of the worker before it
            since_ms=None if since is None else round(since * 1e3, 2),
            forward_ms=round(result.forward_ns / 1e6, 2),
        )
        plain = is_decode_only and not result.num_draft_tokens
        reanchored = cost.num_reanchored
        cost.observe(computed, seconds, num_keys, plain)
        if cost.num_reanchored != reanchored:
            log.debug("step cost re-anchored", step_id=plan.step_id, factor=cost.last_factor)
    drafted = any(s.num_draft_tokens for s in plan.scheduled)
    speculation.observe(
        len(plan.scheduled) if plan.kind == "decode" else 0,
        drafted,
        cycle_seconds(seconds, since),
        result.num_draft_tokens,
        result.num_accepted_tokens,
    )


def cycle_seconds(seconds: float, since: float | None) -> float:
    """What a step cost in wall time: where the worker waited for a round trip before it
    (its plan could not be sent ahead), that too; a pipelined step costs only its own time.
    A gap over the step's own time was idleness, not its cost."""
    return seconds if since is None else min(max(since, seconds), 2 * seconds)
