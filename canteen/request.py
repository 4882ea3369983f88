"""A request as the gateway hands it to the scheduler (``Scheduler/Generate``).

The gateway builds it after tokenizing; the scheduler decodes it, checks it, and makes its
``Sequence`` from it. Fields carry the names of ``ScheduleRequest``'s fields, so the codec
(canteen/codec/schedule.py) copies them by name.
"""

from __future__ import annotations

from dataclasses import dataclass

from canteen.adapters import AdapterRef
from canteen.plan import Sampling


@dataclass(frozen=True)
class Request:
    request_id: str  # the client's label (x-request-id): logged and echoed, never a key
    model: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    sampling: Sampling
    version: str = ""  # "" serves any version of the model
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    priority: int = 0
    cache_salt: str = ""  # prefix-cache tenant (the gateway's --cache-isolation key)
    disable_speculation: bool = False
    adapter: AdapterRef | None = None  # LoRA adapter over model:version; None: the base
    deadline: float | None = None  # monotonic time the caller stops waiting; not on the wire
