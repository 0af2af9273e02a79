"""gapless: an LLM inference and serving engine whose device never waits for the host."""

from typing import Any

__all__ = ["LLM", "LoRARequest", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Lazy so that importing a sub-package (memory, sampling, ...) never drags the whole engine in.
    if name in ("LLM", "RequestOutput"):
        from gapless import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from gapless.sampling_params import SamplingParams

        return SamplingParams
    if name == "LoRARequest":
        from gapless.lora.request import LoRARequest

        return LoRARequest
    raise AttributeError(name)
