"""A tiny random-weight Qwen2.5-VL checkpoint for tests, written with transformers' own classes: its vision
transformer (window attention in two of three blocks, 2x2 merger), a tiny Qwen2 decoder with M-RoPE,
transformers' `Qwen2VLImageProcessor` and the built-in tokenizer with Qwen's vision tokens; all made
locally, nothing downloaded. (No `Qwen2_5_VLProcessor` is saved: it needs a video processor, hence
torchvision; gapless builds the processor from these parts, `gapless.model.vision.qwen2_5_vl`.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLImageProcessorPil,
)

from gapless.default_model.checkpoint import COMMON, TINY, save_tokenizer
from gapless.default_model.tokenizer import build_tokenizer
from gapless.testing.vision_checkpoints import _init

VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
PATCH, MERGE = 14, 2
# an image part is `<|vision_start|><|image_pad|><|vision_end|>`, as Qwen2.5-VL's own template writes it
QWEN_VL_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _tokenizer() -> Any:
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens(
        {"additional_special_tokens": VISION_TOKENS}, replace_extra_special_tokens=False
    )
    tokenizer.chat_template = QWEN_VL_CHAT_TEMPLATE
    return tokenizer


def tiny_qwen_vl_config() -> Qwen2_5_VLConfig:
    """A Qwen2.5-VL config: a 3-block vision transformer of width 32 (block 1 full attention, the others
    windows of 2x2 merged blocks) over the tiny Qwen2 decoder (head_dim 16: M-RoPE sections 2, 3, 3)."""
    tokenizer = _tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    text = dict(
        COMMON,
        **TINY,
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3]},
    )
    vision = dict(
        depth=3,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=TINY["hidden_size"],
        patch_size=PATCH,
        spatial_merge_size=MERGE,
        temporal_patch_size=2,
        window_size=2 * MERGE * PATCH,
        fullatt_block_indexes=[1],
    )
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )


def image_processor(max_pixels: int = 28 * 28 * 64) -> Qwen2VLImageProcessorPil:
    """transformers' Qwen2-VL image processor (its PIL backend: no torchvision), tiny images' bounds."""
    return Qwen2VLImageProcessorPil(
        min_pixels=28 * 28 * 4,
        max_pixels=max_pixels,
        patch_size=PATCH,
        merge_size=MERGE,
        temporal_patch_size=2,
    )


def make_qwen_vl_checkpoint(path: str | Path, seed: int = 0) -> Path:
    """Write a random tiny Qwen2.5-VL checkpoint with its image processor, tokenizer and chat template."""
    path = Path(path)
    config = tiny_qwen_vl_config()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config)
    _init(model, seed)
    model.eval().save_pretrained(str(path))
    image_processor().save_pretrained(str(path))
    save_tokenizer(_tokenizer(), path)
    return path
