"""The adapters an engine or a server knows, each checked (`load_adapter`) once when first named: by id
(what the device's slots and the prefix cache key by) and by name (what a request's `model` names).
An id never means two adapters; a server also keeps names unique (`unique_names`) and hands out ids
that are never reused, so an adapter unloaded and loaded again is a new one everywhere."""

from __future__ import annotations

from pathlib import Path

from gapless.lora.adapter import LoRAError, load_adapter
from gapless.lora.request import LoRARequest
from gapless.model.config import ModelConfig


class AdapterRegistry:
    """Checked adapters by name and by id."""

    def __init__(self, cfg: ModelConfig, max_rank: int, unique_names: bool = False) -> None:
        self.cfg, self.max_rank, self.unique_names = cfg, max_rank, unique_names
        self.by_name: dict[str, LoRARequest] = {}
        self.by_id: dict[int, LoRARequest] = {}
        self._last_id = 0

    def add(self, lora: LoRARequest) -> LoRARequest:
        """`lora`, checked against the model (`LoRAError` naming what is wrong) unless already known; an
        id already given to another adapter is refused, and with `unique_names` a name too."""
        known = self.by_id.get(lora.lora_int_id)
        if known is not None and (known.lora_path, known.lora_name) == (lora.lora_path, lora.lora_name):
            return known
        if known is not None:
            raise LoRAError(
                f"LoRA adapter {lora.lora_name!r}: id {lora.lora_int_id} is already adapter "
                f"{known.lora_name!r} ({known.lora_path})"
            )
        if self.unique_names and lora.lora_name in self.by_name:
            raise LoRAError(f"LoRA adapter {lora.lora_name!r} is already loaded (unload it first)")
        load_adapter(lora.lora_name, lora.lora_path, self.cfg, self.max_rank)
        self.by_name[lora.lora_name] = self.by_id[lora.lora_int_id] = lora
        self._last_id = max(self._last_id, lora.lora_int_id)
        return lora

    def add_path(self, name: str, path: str | Path, base_model_name: str | None = None) -> LoRARequest:
        """The adapter at `path` under `name`, checked, with an id no adapter ever had here."""
        return self.add(LoRARequest(name, self._last_id + 1, str(path), base_model_name))

    def remove(self, name: str) -> LoRARequest:
        """Forget adapter `name` (`LoRAError` if unknown); its id is not handed out again."""
        lora = self.by_name.pop(name, None)
        if lora is None:
            raise LoRAError(f"LoRA adapter {name!r} is not loaded")
        del self.by_id[lora.lora_int_id]
        return lora
