"""A tiny random-weight Gemma 3 vision-language checkpoint for tests, written with transformers' own
classes: `Gemma3ForConditionalGeneration` (a SigLIP tower, the avg-pool + RMSNorm + linear projector, a
tiny Gemma 3 text decoder with a sliding-window layer) and its `Gemma3Processor` (the built-in tokenizer
with Gemma's image tokens, the PIL `Gemma3ImageProcessorPil`), all made locally, nothing downloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import (
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3ImageProcessorPil,
    Gemma3Processor,
    SiglipVisionConfig,
)

from gapless.testing.checkpoints import model_config
from gapless.testing.vision_checkpoints import chat_template, save_model, save_processor, tokenizer_with

BOI, EOI, IMAGE = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
IMAGE_SIZE, PATCH, TOKENS_PER_IMAGE = 32, 4, 16  # 8 x 8 patches, pooled 2 x 2 into 4 x 4 tokens

# Gemma 3's layout: an image part is `<start_of_image>`, which the processor expands into the image's run
GEMMA3_CHAT_TEMPLATE = chat_template(BOI, bos=True)


def _tokenizer() -> Any:
    tokenizer = tokenizer_with([BOI, EOI, IMAGE])
    # the names Gemma3Processor reads (`tokenizer.boi_token`, `.image_token_id`, ...), as Gemma's
    # tokenizer_config.json names them (saved with the tokenizer); transformers has no public setter
    tokenizer._set_model_specific_special_tokens({"boi_token": BOI, "eoi_token": EOI, "image_token": IMAGE})
    return tokenizer


def tiny_gemma3_config(**text_overrides: Any) -> Gemma3Config:
    """SigLIP (32 px, 4-px patches, 3 layers) into a 2-layer Gemma 3 decoder whose first layer slides over
    24 tokens, 16 tokens an image; `text_overrides`: the decoder's config fields changed."""
    tokenizer = _tokenizer()
    # the text-only tests' tiny Gemma 3 decoder (its sliding and global RoPE), with Gemma 3 VLM's activation
    # and no logit soft-cap
    text = model_config(
        "gemma3_text",
        final_logit_softcapping=None,
        hidden_activation="gelu_pytorch_tanh",
        vocab_size=len(tokenizer),
        **text_overrides,
    )
    vision = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=PATCH,
        vision_use_head=False,
    )
    ids = tokenizer.convert_tokens_to_ids
    return Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=TOKENS_PER_IMAGE,
        boi_token_index=ids(BOI),
        eoi_token_index=ids(EOI),
        image_token_index=ids(IMAGE),
        tie_word_embeddings=False,
    )


def make_gemma3_checkpoint(path: str | Path, seed: int = 0, **text_overrides: Any) -> Path:
    """Write a random tiny Gemma 3 vision-language checkpoint with its processor to `path`
    (`text_overrides`: as `tiny_gemma3_config`'s)."""
    path = Path(path)
    save_model(path, Gemma3ForConditionalGeneration, tiny_gemma3_config(**text_overrides), seed)
    tokenizer = _tokenizer()
    image_processor = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=GEMMA3_CHAT_TEMPLATE,
        image_seq_length=TOKENS_PER_IMAGE,
    )
    return save_processor(path, processor, tokenizer, GEMMA3_CHAT_TEMPLATE)
