"""Vision-language checkpoints: per family, how its config splits into the decoder's and the vision
side's, how its weight names do, and its encoder (`base.VisionEncoder`). LLaVA-1.5 is built
(`llava.py`); a family is added by one module and a line in `_FAMILIES`."""

from __future__ import annotations

from typing import Any

import torch

from gapless.model.vision.base import VisionEncoder, VisionSpec
from gapless.model.vision.gemma3 import Gemma3Encoder, gemma3_spec, gemma3_text_config
from gapless.model.vision.llava import LlavaEncoder, llava_spec

# architecture -> (its VisionSpec from config.json, its encoder class)
_FAMILIES: dict[str, Any] = {"LlavaForConditionalGeneration": (llava_spec, LlavaEncoder)}
_FAMILIES["Gemma3ForConditionalGeneration"] = (gemma3_spec, Gemma3Encoder)
# a multimodal config's text_config `model_type` -> the decoder architecture that runs it
_TEXT_ARCHS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
_TEXT_ARCHS["gemma3_text"] = "Gemma3ForCausalLM"
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


__all__ = ["VISION_ARCHITECTURES", "VisionEncoder", "VisionSpec", "new_encoder", "text_config", "vision_spec"]
