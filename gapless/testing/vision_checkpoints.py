"""Tiny random-weight vision-language checkpoints for tests and benchmarks, written with transformers' own
classes: a LLaVA-1.5-style model (CLIP vision tower, two-layer projector, tiny Llama decoder) and its
`LlavaProcessor` (the built-in tokenizer with an `<image>` token, a `CLIPImageProcessor`), and a
LLaVA-NeXT one (the same parts over any-resolution tiles, its `LlavaNextProcessor` with the PIL
`LlavaNextImageProcessorPil`) and a LLaVA-OneVision one (a SigLIP tower over tiles; no processor class is
saved, `gapless.model.vision.llava_onevision`), all made locally, nothing downloaded.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from transformers import (
    CLIPImageProcessor,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaNextConfig,
    LlavaNextForConditionalGeneration,
    LlavaNextImageProcessorPil,
    LlavaNextProcessor,
    LlavaOnevisionConfig,
    LlavaOnevisionForConditionalGeneration,
    LlavaOnevisionImageProcessorPil,
    LlavaProcessor,
    PretrainedConfig,
    SiglipVisionConfig,
)

from gapless.default_model.checkpoint import TINY, random_config, save_tokenizer, shape
from gapless.default_model.tokenizer import build_tokenizer

IMAGE_TOKEN = "<image>"
PATCH = 14


def chat_template(image_part: str, bos: bool = False) -> str:
    """The tiny checkpoints' ChatML template: `{% for part in content %}` an image part is `image_part` (the
    family's placeholder, which its processor expands), a text part its text; `bos` opens with `bos_token`."""
    return (
        ("{{- bos_token }}" if bos else "") + "{%- for message in messages %}"
        "{{- '<|im_start|>' + message['role'] + '\\n' }}"
        "{%- if message['content'] is string %}{{- message['content'] }}"
        "{%- else %}{%- for part in message['content'] %}"
        "{%- if part['type'] == 'image' %}{{- '" + image_part + "' }}"
        "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
        "{%- endfor %}{%- endif %}"
        "{{- '<|im_end|>' + '\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )


LLAVA_CHAT_TEMPLATE = chat_template(IMAGE_TOKEN)


# the vision tower and decoder shapes per size: "tiny" for tests (16 image tokens), "bench" for
# `gapless.bench.vision` (CLIP at 224 px: 256 image tokens, a 6-layer tower of width 256, the bench decoder)
_VISION: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, image_size=56
    ),
    "bench": dict(
        hidden_size=256, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=4, image_size=224
    ),
}
_TEXT: dict[str, dict[str, Any]] = {
    "tiny": TINY,
    "bench": shape(512, 1536, 8, 8, 4, head_dim=64, max_position_embeddings=4096),
}


def tiny_llava_config(size: str = "tiny") -> LlavaConfig:
    """A LLaVA-1.5 config: CLIP (`_VISION[size]`, 14-px patches) feeding a Llama decoder (`_TEXT[size]`)
    through the gelu projector, the penultimate layer's patches (CLS dropped)."""
    tokenizer = _tokenizer()
    text = _llama(size, tokenizer)
    vision = CLIPVisionConfig(**_VISION[size], patch_size=PATCH, projection_dim=32, hidden_act="quick_gelu")
    return LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        image_seq_length=(_VISION[size]["image_size"] // PATCH) ** 2,
    )


def tokenizer_with(tokens: list[str]) -> Any:
    """The built-in tokenizer with a family's image `tokens` added as special tokens."""
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": tokens}, replace_extra_special_tokens=False)
    return tokenizer


def _tokenizer() -> Any:
    return tokenizer_with([IMAGE_TOKEN])


def _llama(size: str, tokenizer: Any) -> PretrainedConfig:
    """The `_TEXT[size]` Llama decoder, untied, over `tokenizer`'s vocabulary."""
    return random_config(
        LlamaConfig, dict(_TEXT[size], tie_word_embeddings=False), {"vocab_size": len(tokenizer)}
    )


def save_model(path: Path, model_class: Any, config: Any, seed: int) -> None:
    """Build `model_class(config)` under `seed` (the global RNG left as it was), spread its weights
    (`_init`) and save it to `path`."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    _init(model, seed)
    model.eval().save_pretrained(str(path))


def save_processor(path: Path, processor: Any, tokenizer: Any, template: str) -> Path:
    """Save `processor` (or an image processor) and `tokenizer` with the chat `template` to `path`."""
    processor.save_pretrained(str(path))
    tokenizer.chat_template = template
    save_tokenizer(tokenizer, path)
    return path


def _llava_processor(processor_class: Any, image_processor: Any, tokenizer: Any, patch: int) -> Any:
    """LLaVA-1.5's or NeXT's processor: `<image>` expanded to its patches (the class token dropped)."""
    return processor_class(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=patch,
        vision_feature_select_strategy="default",
        chat_template=LLAVA_CHAT_TEMPLATE,
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1,
    )


@torch.no_grad()
def _init(model: torch.nn.Module, seed: int) -> None:
    """Weights spread so greedy decoding has clear winners and every vision weight matters: linears
    variance-preserving (x1.5), norms 1 + noise, biases and embeddings noise, the LM head's logits std 2."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if "norm" in name and name.endswith("weight"):
            p.copy_(1.0 + 0.1 * noise)
        elif name.endswith("bias"):
            p.copy_(0.1 * noise)
        elif "lm_head" in name:
            p.copy_(noise * 2.0 / math.sqrt(p.shape[-1]))
        elif "embed" in name or p.dim() == 1:
            p.copy_(noise)
        else:  # a linear's [out, in], the patch conv's [out, c, k, k]
            p.copy_(noise * 1.5 / math.sqrt(p[0].numel()))


def make_llava_checkpoint(path: str | Path, seed: int = 0, size: str = "tiny") -> Path:
    """Write a random tiny LLaVA-1.5 checkpoint with its processor (tokenizer, image processor, chat
    template) to `path`."""
    path = Path(path)
    config = tiny_llava_config(size)
    image_size = _VISION[size]["image_size"]
    save_model(path, LlavaForConditionalGeneration, config, seed)
    tokenizer = _tokenizer()
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": image_size},
        crop_size={"height": image_size, "width": image_size},
    )
    processor = _llava_processor(LlavaProcessor, image_processor, tokenizer, PATCH)
    return save_processor(path, processor, tokenizer, LLAVA_CHAT_TEMPLATE)


# LLaVA-NeXT's tiny shapes: 28-px crops of 7-px patches (4 x 4 a crop), grids of up to 2 x 2 or 3 x 1 tiles
NEXT_TILE, NEXT_PATCH = 28, 7
NEXT_PINPOINTS = [[28, 56], [56, 28], [56, 56], [28, 84], [84, 28]]
# (tile, patch) per size: "bench" is LLaVA-1.5's bench tower at 224 px, 256 rows a crop, grids as above
_NEXT = {"tiny": (NEXT_TILE, NEXT_PATCH), "bench": (224, PATCH)}


def make_llava_next_checkpoint(path: str | Path, seed: int = 0, size: str = "tiny") -> Path:
    """Write a random LLaVA-NeXT checkpoint (CLIP over `_NEXT[size]` crops, `NEXT_PINPOINTS` grids scaled to
    that tile, the `_TEXT[size]` Llama decoder) with its processor to `path`."""
    path = Path(path)
    tile, patch = _NEXT[size]
    pinpoints = [[h * tile // NEXT_TILE, w * tile // NEXT_TILE] for h, w in NEXT_PINPOINTS]
    tokenizer = _tokenizer()
    text = _llama(size, tokenizer)
    vision = CLIPVisionConfig(**dict(_VISION[size], image_size=tile), patch_size=patch, projection_dim=32)
    config = LlavaNextConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        image_grid_pinpoints=pinpoints,
        image_seq_length=(tile // patch) ** 2,
    )
    save_model(path, LlavaNextForConditionalGeneration, config, seed)
    image_processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": tile},
        crop_size={"height": tile, "width": tile},
        image_grid_pinpoints=pinpoints,
    )
    processor = _llava_processor(LlavaNextProcessor, image_processor, tokenizer, patch)
    return save_processor(path, processor, tokenizer, LLAVA_CHAT_TEMPLATE)


# LLaVA-OneVision's tiny shapes: SigLIP over 28-px crops of 7-px patches, grids up to 3 x 3 tiles, and
# grids over 2 crops' worth of patches (by 10%) scaled down (`anyres_max_2`)
OV_PINPOINTS = [[28 * i, 28 * j] for i in range(1, 4) for j in range(1, 4)]


def make_llava_onevision_checkpoint(path: str | Path, seed: int = 0) -> Path:
    """Write a random tiny LLaVA-OneVision checkpoint (SigLIP over `NEXT_TILE`-px crops, `OV_PINPOINTS`
    grids, `anyres_max_2`, the tiny Llama decoder) with its image processor and tokenizer to `path`."""
    path = Path(path)
    tokenizer = _tokenizer()
    text = _llama("tiny", tokenizer)
    vision = SiglipVisionConfig(**dict(_VISION["tiny"], image_size=NEXT_TILE), patch_size=NEXT_PATCH)
    config = LlavaOnevisionConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        image_grid_pinpoints=OV_PINPOINTS,
        vision_aspect_ratio="anyres_max_2",
    )
    save_model(path, LlavaOnevisionForConditionalGeneration, config, seed)
    image_processor = LlavaOnevisionImageProcessorPil(
        size={"height": NEXT_TILE, "width": NEXT_TILE}, image_grid_pinpoints=OV_PINPOINTS
    )
    return save_processor(path, image_processor, tokenizer, LLAVA_CHAT_TEMPLATE)
