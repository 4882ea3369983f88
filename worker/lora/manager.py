"""The runner's view of LoRA: which sequences' adapters load, and each step's adapter rows.

A sequence names its adapter once (``NewSequence.adapter``); the adapter is loaded then,
digest checked, and again whenever a step needs it after the store evicted it. A step's
distinct adapters (at most --max-loras, the scheduler's rule) go in the forward's slots, and
its rows are grouped by adapter once, into one index tensor, adapter after adapter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from canteen.adapters import AdapterRef
from canteen.plan import FailedSequence, StepResult
from worker.lora.adapter import BaseShape, LoraError
from worker.lora.slots import LoraSlots, StepLora
from worker.lora.store import AdapterStore, LoraMetrics, LoraOptions


class LoraManager:
    def __init__(
        self,
        options: LoraOptions,
        config: object,
        dtype: torch.dtype,
        device: torch.device,
        refusal: str = "",
    ) -> None:
        """``refusal``: why this worker's forward cannot apply adapters ("" when it can)."""
        if options.max_loras and options.max_cpu_loras < options.max_loras:
            raise ValueError(
                f"max_cpu_loras={options.max_cpu_loras}: must be at least "
                f"max_loras={options.max_loras}"
            )
        self.options, self.dtype = options, dtype
        if not refusal and not options.max_loras:
            refusal = "this worker serves no LoRA adapters (--max-loras 0)"
        self.refusal = refusal
        shape = BaseShape.of(config)
        self.store = AdapterStore(options, shape, dtype, device)
        parts = {kind: list(sizes) for kind, sizes in shape.part_sizes.items()}
        self.slots = LoraSlots(max(options.max_loras, 1), shape.num_layers, parts)
        self._resident: tuple[str, ...] = ()

    @property
    def max_loras(self) -> int:
        """Distinct adapters a step may apply (0: adapters refused), as GetInfo reports it."""
        return 0 if self.refusal else self.options.max_loras

    def observe(self, metrics: LoraMetrics) -> None:
        self.store.metrics = metrics

    def check(self, adapter: AdapterRef) -> None:
        """Loads ``adapter`` (a new sequence's); LoraError says why it cannot be served."""
        if self.refusal:
            raise LoraError(self.refusal)
        self.store.get(adapter)

    def place(self, entries: Sequence[tuple[str, AdapterRef | None]]) -> list[FailedSequence]:
        """Puts the step's adapters (``entries``: seq id and adapter, in plan order) in the
        forward's slots; the sequences that cannot run this step, with why."""
        failed: list[FailedSequence] = []
        distinct: dict[str, AdapterRef] = {}
        for seq_id, ref in entries:
            if ref is None or ref.id in distinct:
                continue
            if len(distinct) == self.options.max_loras:
                failed.append(
                    FailedSequence(
                        seq_id,
                        f"sequence {seq_id}: adapter {ref.id} would make {len(distinct) + 1} "
                        f"distinct adapters in this step; --max-loras is {self.options.max_loras}",
                    )
                )
                continue
            distinct[ref.id] = ref
        weights = []
        for adapter_id, ref in list(distinct.items()):
            try:
                weights.append(self.store.get(ref))
            except LoraError as exc:  # its files changed or vanished since it was first loaded
                del distinct[adapter_id]
                failed += [
                    FailedSequence(s, f"sequence {s}: adapter {ref.id}: {exc}", True)
                    for s, r in entries
                    if r is not None and r.id == adapter_id
                ]
        for _ in self.slots.place(weights):
            if self.store.metrics is not None:
                self.store.metrics.evicted("step")
        return failed

    def step(
        self, row_adapters: list[tuple[AdapterRef | None, int]], device: torch.device
    ) -> StepLora | None:
        """The step's adapters for rows in flat order (adapter or None, its tokens); None
        when every row is the base model's."""
        starts: dict[str, list[int]] = {}
        flat = 0
        for adapter, num_tokens in row_adapters:
            if adapter is not None:
                starts.setdefault(adapter.id, []).extend(range(flat, flat + num_tokens))
            flat += num_tokens
        if not starts:
            return None
        return self.slots.step(starts, device)

    def annotate(self, result: StepResult) -> StepResult:
        """``result`` naming the adapters held in memory, when they changed since the last."""
        now = self.store.ids()
        if now == self._resident:
            return result
        self._resident = now
        return dataclasses.replace(result, resident_adapters=now, adapters_changed=True)
