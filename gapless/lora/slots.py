"""The host's side of the resident table: which adapter each device slot holds, least recently used out,
and each batch's per-token slot vector with the loads it must run first (`LoRALoad`, in stream order).

The scheduler admits no request whose adapter would make the adapters of the running requests more than
`max_loras` (`admits`), so every batch's adapters fit the slots at once; a slot whose adapter no batch
needs any more is reused, the least recently used first.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch

from gapless.lora.request import LoRARequest
from gapless.lora.table import LoRALoad


class BatchLoRA(NamedTuple):
    """A batch's slot per token ([T] int64, -1: the base model) and the loads it runs before its forward."""

    token_slots: torch.Tensor
    loads: list[LoRALoad]


class SlotAssigner:
    """Device slots of the resident adapters (host bookkeeping; the device follows the batches' loads)."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.slot_of: dict[int, int] = {}  # adapter id -> slot
        self.used: list[int] = []  # slots, least recently used first

    def admits(self, lora: LoRARequest | None, active: Iterable[LoRARequest | None]) -> bool:
        """Whether a request of adapter `lora` may join requests of the `active` adapters."""
        if lora is None:
            return True
        ids = {a.lora_int_id for a in active if a is not None}
        return lora.lora_int_id in ids or len(ids) < self.max_loras

    def assign(self, loras: list[LoRARequest | None], tokens: list[int]) -> BatchLoRA | None:
        """The batch of rows running `loras` (None: the base), `tokens[i]` tokens each; None when every row
        runs the base model."""
        if all(lo is None for lo in loras):
            return None
        batch_ids = {lo.lora_int_id for lo in loras if lo is not None}
        if len(batch_ids) > self.max_loras:
            raise RuntimeError(f"a batch of {len(batch_ids)} adapters, above max_loras={self.max_loras}")
        loads, row_slots = [], []
        for lo in loras:
            if lo is None:
                row_slots.append(-1)
                continue
            slot = self.slot_of.get(lo.lora_int_id)
            if slot is None:
                slot = self._free_slot(batch_ids)
                self.slot_of[lo.lora_int_id] = slot
                loads.append(LoRALoad(slot, lo.lora_int_id, lo.lora_name, lo.lora_path))
            if slot in self.used:
                self.used.remove(slot)
            self.used.append(slot)
            row_slots.append(slot)
        slots = torch.repeat_interleave(torch.tensor(row_slots, dtype=torch.int64), torch.tensor(tokens))
        return BatchLoRA(slots, loads)

    def _free_slot(self, keep: set[int]) -> int:
        """An empty slot, else the least recently used one whose adapter is not in this batch."""
        taken = set(self.slot_of.values())
        for s in range(self.max_loras):
            if s not in taken:
                return s
        for s in self.used:
            owner = next(i for i, slot in self.slot_of.items() if slot == s)
            if owner not in keep:
                del self.slot_of[owner]
                return s
        raise RuntimeError("no LoRA slot to reuse")  # (admission keeps a batch's adapters <= max_loras)
