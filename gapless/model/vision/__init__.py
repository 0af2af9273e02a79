"""Vision-language checkpoints: per family, how its config splits into the decoder's and the vision
side's, how its weight names do, and its encoder (`base.VisionEncoder`). LLaVA-1.5 (`llava.py`),
LLaVA-NeXT (`llava_next.py`), LLaVA-OneVision (`llava_onevision.py`), Gemma 3 (`gemma3.py`) and
Qwen2.5-VL (`qwen2_5_vl.py`) are built; a family is added by one module and a line in `_FAMILIES`."""

from __future__ import annotations

from typing import Any

import torch

from gapless.model.vision.base import VisionEncoder, VisionSpec
from gapless.model.vision.gemma3 import Gemma3Encoder, gemma3_spec, gemma3_text_config
from gapless.model.vision.llava import LlavaEncoder, llava_spec
from gapless.model.vision.llava_next import LlavaNextEncoder, llava_next_spec
from gapless.model.vision.llava_onevision import (
    LlavaOnevisionEncoder,
    OnevisionProcessor,
    llava_onevision_spec,
)
from gapless.model.vision.qwen2_5_vl import Qwen25VLEncoder, QwenVLProcessor, qwen2_5_vl_spec

# architecture -> (its VisionSpec from config.json, its encoder class)
_FAMILIES: dict[str, Any] = {
    "LlavaForConditionalGeneration": (llava_spec, LlavaEncoder),
    "LlavaNextForConditionalGeneration": (llava_next_spec, LlavaNextEncoder),
    "LlavaOnevisionForConditionalGeneration": (llava_onevision_spec, LlavaOnevisionEncoder),
    "Gemma3ForConditionalGeneration": (gemma3_spec, Gemma3Encoder),
    "Qwen2_5_VLForConditionalGeneration": (qwen2_5_vl_spec, Qwen25VLEncoder),
}
# families whose processor is not transformers' `AutoProcessor` -> the class that builds it from a path
_PROCESSORS: dict[str, Any] = {
    "Qwen2_5_VLForConditionalGeneration": QwenVLProcessor,
    "LlavaOnevisionForConditionalGeneration": OnevisionProcessor,
}
# a multimodal config's text_config `model_type` -> the decoder architecture that runs it
_TEXT_ARCHS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen2_5_vl_text": "Qwen2ForCausalLM",  # with M-RoPE (`ModelConfig.mrope_section`)
    "qwen2_5_vl": "Qwen2ForCausalLM",  # (v4's flat config: the text fields at the top)
    "gemma3_text": "Gemma3ForCausalLM",
}
# a text_config `model_type` -> how its config is filled first, where checkpoints save only non-defaults
_TEXT_FILL = {"gemma3_text": gemma3_text_config}
VISION_ARCHITECTURES = tuple(_FAMILIES)


def is_vision_config(cfg: dict[str, Any]) -> bool:
    return bool(cfg.get("architectures")) and cfg["architectures"][0] in _FAMILIES


def vision_spec(cfg: dict[str, Any]) -> VisionSpec:
    return _FAMILIES[cfg["architectures"][0]][0](cfg)


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The decoder's config of a vision-language config: its `text_config`, named as the decoder runs it."""
    text = dict(cfg.get("text_config") or {})
    if not text and cfg.get("model_type") == "qwen2_5_vl":  # v4 wrote Qwen2.5-VL's text fields flat
        text = {k: v for k, v in cfg.items() if k not in ("vision_config", "architectures")}
    kind = text.get("model_type", "llama")
    if kind in _TEXT_FILL:
        text = _TEXT_FILL[kind](text)
    if kind not in _TEXT_ARCHS:
        raise ValueError(
            f"{cfg['architectures'][0]} over a {kind!r} decoder is not supported "
            f"(supported: {sorted(_TEXT_ARCHS)})"
        )
    text["architectures"] = [_TEXT_ARCHS[kind]]
    for key in ("eos_token_id", "torch_dtype", "dtype"):
        text.setdefault(key, cfg.get(key))
    return text


def text_weight_name(name: str) -> str:
    """A vision-language checkpoint's decoder weight under the decoder's own name: `language_model.model.x`
    (and 5.x's `model.language_model.x`) is `model.x`; `language_model.lm_head.x` is `lm_head.x`."""
    for old, new in (
        ("language_model.model.", "model."),
        ("model.language_model.", "model."),
        ("language_model.", ""),
    ):
        if name.startswith(old):
            return new + name.removeprefix(old)
    return name


def new_encoder(
    spec: VisionSpec, text_hidden: int, dtype: torch.dtype, device: torch.device
) -> VisionEncoder:
    """The family's encoder, its weights to be loaded (`VisionEncoder.load_weight`)."""
    cls = _FAMILIES[spec.config["architectures"][0]][1]
    with torch.device(device):
        return cls(spec, text_hidden).to(dtype).eval()


def new_processor(model_path: str) -> Any:
    """The processor of the (local) vision-language checkpoint at `model_path`: the family's own
    (`_PROCESSORS`), else transformers' `AutoProcessor`."""
    import json
    from pathlib import Path

    from transformers import AutoProcessor

    arch = (json.loads((Path(model_path) / "config.json").read_text()).get("architectures") or [""])[0]
    return _PROCESSORS.get(arch, AutoProcessor.from_pretrained)(model_path)


__all__ = [
    "VISION_ARCHITECTURES",
    "VisionEncoder",
    "VisionSpec",
    "new_encoder",
    "new_processor",
    "text_config",
    "vision_spec",
]
