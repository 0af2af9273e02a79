"""The built-in tokenizer filled up to a model's vocabulary: every id decodes to text of its own, texts
encode as before, and a written checkpoint carries the filled tokenizer (so a random model's streams,
as the serving benchmark's, carry text for every token)."""

from __future__ import annotations

from transformers import AutoTokenizer

from gapless.default_model.tokenizer import CORPUS, FILLER_TEXT, VOCAB_SIZE, build_tokenizer
from gapless.testing import make_checkpoint


def test_every_id_of_the_filled_vocabulary_decodes_to_text():
    trained, filled = build_tokenizer(), build_tokenizer(vocab_size=VOCAB_SIZE + 3000)
    assert len(trained) == VOCAB_SIZE and len(filled) == VOCAB_SIZE + 3000
    assert build_tokenizer(vocab_size=VOCAB_SIZE - 1).vocab == trained.vocab  # never shrunk
    for i in range(VOCAB_SIZE, VOCAB_SIZE + 3000):
        assert filled.decode([i]) == FILLER_TEXT.format(i)
    for text in CORPUS:  # fillers have no merges: encoding never reaches them
        assert filled.encode(text) == trained.encode(text)
    assert filled.encode(FILLER_TEXT.format(VOCAB_SIZE)) == trained.encode(FILLER_TEXT.format(VOCAB_SIZE))


def test_a_checkpoint_gets_a_tokenizer_covering_its_vocabulary(tmp_path):
    path = make_checkpoint(tmp_path, "qwen3", vocab_size=4096)
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == 4096 and tok.decode([4095, 1000]) == " tok4095 tok1000"
