"""Test machinery: tiny random-weight checkpoints of every family, the `transformers` reference, a
scripted checkpoint, and a server in a child process. Imported by tests, benchmarks and test helpers,
never by the engine or the server (their default model comes from `gapless.default_model`). Like
`gapless.default_model`, whose pieces it reuses, it imports nothing of the engine, so tests can use it
as an independent reference.
"""

from gapless.default_model.tokenizer import build_tokenizer
from gapless.testing.checkpoints import ARCHS, cached_checkpoint, make_checkpoint

__all__ = ["ARCHS", "build_tokenizer", "cached_checkpoint", "make_checkpoint"]
