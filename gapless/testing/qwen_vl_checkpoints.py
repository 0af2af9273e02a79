"""A tiny random-weight Qwen2.5-VL checkpoint for tests, written with transformers' own classes: its vision
transformer (window attention in two of three blocks, 2x2 merger), a tiny Qwen2 decoder with M-RoPE,
transformers' `Qwen2VLImageProcessor` and the built-in tokenizer with Qwen's vision tokens; all made
locally, nothing downloaded. (No `Qwen2_5_VLProcessor` is saved: it needs a video processor, hence
torchvision; gapless builds the processor from these parts, `gapless.model.vision.qwen2_5_vl`.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLImageProcessorPil,
)

from gapless.default_model.checkpoint import COMMON, TINY, shape
from gapless.testing.vision_checkpoints import chat_template, save_model, save_processor, tokenizer_with

VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
PATCH, MERGE = 14, 2
# an image part is `<|vision_start|><|image_pad|><|vision_end|>`, as Qwen2.5-VL's own template writes it
QWEN_VL_CHAT_TEMPLATE = chat_template("".join(VISION_TOKENS[:3]))


def _tokenizer() -> Any:
    tokenizer = tokenizer_with(VISION_TOKENS)
    tokenizer.chat_template = QWEN_VL_CHAT_TEMPLATE
    return tokenizer


# per size: the vision transformer, the decoder, its M-RoPE sections (summing to head_dim / 2) and the
# image processor's pixel ceiling. "tiny" for tests: 3 blocks of width 32 (block 1 full attention, the others
# windows of 2x2 merged blocks), the tiny Qwen2 decoder (head_dim 16); "bench" for `gapless.bench.vision`:
# 6 blocks of width 256 (windows of 4x4 merged blocks, as Qwen2.5-VL's 112 px), the bench decoder, images
# up to 448 x 448 px (256 rows)
_SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vision=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, fullatt_block_indexes=[1]),
        text=TINY,
        mrope=[2, 3, 3],
        window=2,
        max_pixels=28 * 28 * 64,
    ),
    "bench": dict(
        vision=dict(
            depth=6, hidden_size=256, intermediate_size=704, num_heads=4, fullatt_block_indexes=[2, 5]
        ),
        text=shape(512, 1536, 8, 8, 4, head_dim=64, max_position_embeddings=4096),
        mrope=[8, 12, 12],
        window=4,
        max_pixels=448 * 448,
    ),
}


def tiny_qwen_vl_config(size: str = "tiny") -> Qwen2_5_VLConfig:
    """A Qwen2.5-VL config of `_SIZES[size]`: its vision transformer over a Qwen2 decoder with M-RoPE."""
    tokenizer = _tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    shape_of = _SIZES[size]
    text = dict(
        COMMON,
        **shape_of["text"],
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        rope_scaling={"rope_type": "default", "mrope_section": shape_of["mrope"]},
    )
    vision = dict(
        shape_of["vision"],
        out_hidden_size=shape_of["text"]["hidden_size"],
        patch_size=PATCH,
        spatial_merge_size=MERGE,
        temporal_patch_size=2,
        window_size=shape_of["window"] * MERGE * PATCH,
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


def make_qwen_vl_checkpoint(path: str | Path, seed: int = 0, size: str = "tiny") -> Path:
    """Write a random Qwen2.5-VL checkpoint (`_SIZES[size]`) with its image processor, tokenizer and chat
    template to `path`."""
    path = Path(path)
    config = tiny_qwen_vl_config(size)
    save_model(path, Qwen2_5_VLForConditionalGeneration, config, seed)
    return save_processor(
        path, image_processor(_SIZES[size]["max_pixels"]), _tokenizer(), QWEN_VL_CHAT_TEMPLATE
    )
