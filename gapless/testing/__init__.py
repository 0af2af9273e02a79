"""Tiny random-weight Hugging Face checkpoints and a locally trained tokenizer, for tests.

Depends only on torch, transformers and tokenizers, never on the rest of gapless, so that tests can
use it as an independent reference.
"""

from gapless.testing.checkpoints import ARCHS, cached_checkpoint, default_model_path, make_checkpoint
from gapless.testing.tokenizer import build_tokenizer

__all__ = ["ARCHS", "build_tokenizer", "cached_checkpoint", "default_model_path", "make_checkpoint"]
