"""`LoRARequest`: which adapter a request runs with (vLLM's shape: name, int id, path)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter: its name (what a request's `model` names), its id (> 0, unique per adapter) and the
    directory of its PEFT files (`adapter_config.json`, `adapter_model.safetensors`)."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("lora_name must be non-empty")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(
                f"lora_int_id={self.lora_int_id!r}: must be an int >= 1 (0 and -1 mean the base model)"
            )
