"""The built-in model that `gapless serve` and `gapless chat` run when given no `--model`: a tiny Qwen3
with random weights and a locally trained tokenizer, made on first use and kept in the cache
(`$GAPLESS_CACHE` or `~/.cache/gapless`), so a fresh machine serves without downloading anything.

`gapless.testing` builds its test checkpoints from the same pieces (`checkpoint`, `tokenizer`).
"""

from __future__ import annotations

from pathlib import Path

from transformers import Qwen3Config

from gapless.default_model.checkpoint import (
    QWEN3_TINY,
    build_atomically,
    cache_dir,
    random_config,
    write_checkpoint,
)

# Fixed so users can find it; bump its version whenever the recipe (config, init, tokenizer) changes.
NAME = "tiny-qwen3-v1"


def default_model_path() -> Path:
    """The default model's checkpoint directory, built on first use."""
    target = cache_dir() / "models" / NAME
    return build_atomically(target, lambda tmp: write_checkpoint(tmp, random_config(Qwen3Config, QWEN3_TINY)))
