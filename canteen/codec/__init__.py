"""Every protobuf <-> domain conversion between Canteen's services, one module per contract.

- ``fields``: the generic part, fields shared by name copied both ways.
- ``sampling``: ``SamplingParams`` / ``GenerateRequest`` <-> ``Sampling``.
- ``step``: the worker contract (``Worker/Run``): ``StepPlan`` and ``StepResult``.
- ``schedule``: the scheduler contract (``Scheduler/Generate``): ``ScheduleRequest`` and
  ``ScheduleResponse``.

The public API (the gateway's ``GenerateRequest`` and OpenAI JSON) is parsed in gateway/.
"""

from canteen.codec.sampling import (
    constraint_from_pb,
    constraint_to_pb,
    random_seed,
    sampling_from_pb,
    sampling_from_request,
    sampling_to_pb,
)
from canteen.codec.schedule import batch_to_pb, request_from_pb, request_to_pb, response_to_pb
from canteen.codec.step import PlanEncoder, plan_from_pb, plan_to_pb, result_from_pb, result_to_pb

__all__ = [
    "PlanEncoder",
    "batch_to_pb",
    "constraint_from_pb",
    "constraint_to_pb",
    "plan_from_pb",
    "plan_to_pb",
    "random_seed",
    "request_from_pb",
    "request_to_pb",
    "response_to_pb",
    "result_from_pb",
    "result_to_pb",
    "sampling_from_pb",
    "sampling_from_request",
    "sampling_to_pb",
]
