"""The adapters an engine knows: each checked once (`load_adapter`) when first named, by name and by id,
so a request's adapter is refused before it is queued and a name or id never means two adapters."""

from __future__ import annotations

from gapless.lora.adapter import LoRAError, load_adapter
from gapless.lora.request import LoRARequest
from gapless.model.config import ModelConfig


class AdapterRegistry:
    """Checked adapters by name (what a request's `model` names) and by id."""

    def __init__(self, cfg: ModelConfig, max_rank: int) -> None:
        self.cfg, self.max_rank = cfg, max_rank
        self.by_name: dict[str, LoRARequest] = {}
        self.by_id: dict[int, LoRARequest] = {}

    def add(self, lora: LoRARequest) -> LoRARequest:
        """`lora`, checked against the model (`LoRAError` naming what is wrong) unless already known; a
        name or id already given to another adapter is refused."""
        known = self.by_id.get(lora.lora_int_id)
        if known is not None and (known.lora_path, known.lora_name) == (lora.lora_path, lora.lora_name):
            return known
        if known is not None:
            raise LoRAError(
                f"LoRA adapter {lora.lora_name!r}: id {lora.lora_int_id} is already adapter "
                f"{known.lora_name!r} ({known.lora_path})"
            )
        if lora.lora_name in self.by_name:
            raise LoRAError(f"LoRA adapter {lora.lora_name!r} is already loaded (unload it first)")
        load_adapter(lora.lora_name, lora.lora_path, self.cfg, self.max_rank)
        self.by_name[lora.lora_name] = self.by_id[lora.lora_int_id] = lora
        return lora

    def remove(self, name: str) -> LoRARequest:
        """Forget adapter `name` (`LoRAError` if unknown)."""
        lora = self.by_name.pop(name, None)
        if lora is None:
            raise LoRAError(f"LoRA adapter {name!r} is not loaded")
        del self.by_id[lora.lora_int_id]
        return lora

    def next_id(self) -> int:
        """An id no known adapter has."""
        return max(self.by_id, default=0) + 1
