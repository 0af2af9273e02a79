"""A scripted model that cycles through a few tokens (so n-gram drafts are mostly right) and runs a chain
into EOS, for the speculative-decoding tests."""

from __future__ import annotations

import pytest

from gapless.default_model.tokenizer import build_tokenizer
from gapless.testing.scripted import make_scripted_checkpoint

CYCLE = "abcde"  # after a comes b, ..., after e comes a again
CHAIN = "fghij"  # after j: EOS


def ids(text: str) -> list[int]:
    tok = build_tokenizer()
    return [tok.convert_tokens_to_ids(c) for c in text]


@pytest.fixture(scope="session")
def cyclic(tmp_path_factory):
    """Path of a model that greedily writes abcdeabcde... after any of a-e, and f g h i j EOS after f."""
    cycle, chain = ids(CYCLE), ids(CHAIN)
    script = dict(zip(cycle, cycle[1:] + cycle[:1])) | dict(zip(chain[:-1], chain[1:]))
    return str(make_scripted_checkpoint(tmp_path_factory.mktemp("cyclic"), script))
