"""Incremental detokenizer: whole characters only, bounded decode windows, any chunking.

The key property: the concatenation of all deltas equals a one-shot decode of all the ids, cut by the
stop rule (the first token whose text, less a trailing U+FFFD run, holds a stop string; cut at the
earliest one), however the ids are grouped into updates. It is checked with hypothesis and with seeded
random sequences built from real text, multi-byte characters spelled byte by byte, arbitrary bytes and
special tokens, fed in random chunk sizes. The stop rule's edges are tested in test_stop.py.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from gapless.engine.detokenize import MAX_PENDING_TOKENS, Decoder, IncrementalDetokenizer, update_many
from gapless.engine.stop import find_stop
from gapless.testing import build_tokenizer

FFFD = "\ufffd"


def _byte_to_char() -> dict[int, str]:
    """Byte-level BPE's byte -> vocabulary character table (printable bytes are themselves)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in keep}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """The test tokenizer as the engine loads it: saved to disk and read back by AutoTokenizer."""
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(save_dir=path)
    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def byte_ids(tok):
    """byte value -> the id of its single-byte token, to spell any bytes one token per byte."""
    vocab = tok.get_vocab()
    table = {b: vocab[c] for b, c in _byte_to_char().items()}
    assert tok.decode([table[0xC3], table[0xA9]]) == "é"  # the table is right
    return table


def spell(byte_ids: dict[int, str], data: bytes) -> list[int]:
    return [byte_ids[b] for b in data]


def expected(tok, ids, stop=(), skip_special_tokens=True) -> str:
    """The stop rule, spelled out: at the first token whose decoded text (less the trailing U+FFFD
    run of a character still arriving) holds a stop string, cut before the earliest; else the
    whole decode, cut the same way."""
    for i in range(1, len(ids) + 1) if stop else ():
        text = tok.decode(ids[:i], skip_special_tokens=skip_special_tokens).rstrip(FFFD)
        if (found := find_stop(text, stop)) is not None:
            return text[: found[0]]
    text = tok.decode(ids, skip_special_tokens=skip_special_tokens)
    found = find_stop(text, stop)
    return text if found is None else text[: found[0]]


def stream(tok, ids, chunks, stop=(), skip_special_tokens=True):
    """Feed `ids` in chunks of the given sizes (cycled); return (deltas, final delta, detokenizer)."""
    det = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens, stop=list(stop))
    deltas, i, c = [], 0, 0
    while i < len(ids):
        n = chunks[c % len(chunks)] if chunks else 1
        deltas.append(det.update(ids[i : i + n]))
        i, c = i + n, c + 1
    return deltas, det.finish(), det


# ---------------------------------------------------------------------- multi-byte characters


def test_euro_split_across_tokens_arrives_whole(tok):
    ids = tok.encode("a€b")
    assert len(tok.encode("€")) == 3  # the test tokenizer really splits it (one token per byte)
    det = IncrementalDetokenizer(tok)
    deltas = [det.update([t]) for t in ids]
    assert "".join(deltas) + det.finish() == "a€b"
    assert all(FFFD not in d for d in deltas)
    assert "€" in deltas  # one delta, the whole character, exactly when its last byte came
    assert deltas.index("€") == ids.index(tok.encode("€")[-1])


@pytest.mark.parametrize("text", ["é", "naïve café", "€", "中文", "😀🚀", "👨‍👩‍👧", "𝄞", "Ω ≈ π"])
def test_multibyte_spelled_byte_by_byte(tok, byte_ids, text):
    """Even characters the BPE merged ("é") come out whole when fed one byte token at a time."""
    ids = spell(byte_ids, text.encode())
    det = IncrementalDetokenizer(tok)
    deltas = [det.update([t]) for t in ids]
    assert "".join(deltas) + det.finish() == text
    assert all(FFFD not in d for d in deltas)
    shown = [d for d in deltas if d]
    assert shown == [ch for ch in text]  # every character in exactly one delta, as soon as complete


def test_several_tokens_per_update(tok, byte_ids):
    ids = spell(byte_ids, "x€".encode()) + tok.encode(" done")
    det = IncrementalDetokenizer(tok)
    assert det.update(ids[:2]) == "x"  # "x" and the first byte of "€"
    assert det.update(ids[2:3]) == ""
    assert det.update(ids[3:]) == "€ done"
    assert det.finish() == ""


def test_invalid_bytes_flushed_at_finish(tok, byte_ids):
    det = IncrementalDetokenizer(tok)
    assert det.update(spell(byte_ids, b"ok\xe2\x82")) == "ok"
    assert det.finish() == FFFD  # never completed: shown as the one-shot decode shows it
    assert det.text == "ok" + FFFD


class CountingTokenizer:
    def __init__(self, tok) -> None:
        self.tok, self.sizes = tok, []

    def decode(self, ids, **kw):
        self.sizes.append(len(ids))
        return self.tok.decode(ids, **kw)


def test_long_run_of_invalid_bytes_then_valid_character(tok, byte_ids):
    """Past MAX_PENDING_TOKENS undecided tokens the window is forced forward, without breaking a
    character whose first byte is among the last ones (a premature U+FFFD would break the equality)."""
    for n in (MAX_PENDING_TOKENS - 1, MAX_PENDING_TOKENS, MAX_PENDING_TOKENS + 1, 100):
        data = b"\x80" * n + "é€😀".encode() + b"\xff" * n + b"\xe2\x82\xac" + b"\xf0" * n + "😀".encode()
        ids = spell(byte_ids, data)
        counting = CountingTokenizer(tok)
        det = IncrementalDetokenizer(counting)
        deltas = [det.update([t]) for t in ids]
        text = "".join(deltas) + det.finish()
        assert text == tok.decode(ids) == data.decode("utf-8", "replace")
        assert deltas[-1].endswith("😀")
        # garbage is shown as it settles: before the last emoji, at most a few U+FFFD were held
        assert len("".join(deltas[:-4])) >= len(text) - 1 - MAX_PENDING_TOKENS
        assert max(counting.sizes) <= 2 * MAX_PENDING_TOKENS + 2  # and not re-decoded forever


def test_decode_window_is_bounded(tok, byte_ids):
    rng = random.Random(0)
    pieces = [tok.encode("The quick brown fox, café €5 中文 😀. ")] + [
        spell(byte_ids, b"\x80\x80\xe2"),
        spell(byte_ids, "ü".encode()),
        [1, 2],
    ]
    ids = [t for _ in range(150) for t in rng.choice(pieces)]
    counting = CountingTokenizer(tok)
    det = IncrementalDetokenizer(counting, skip_special_tokens=False, stop=["never appears"])
    text = "".join(det.update([t]) for t in ids) + det.finish()
    assert text == tok.decode(ids, skip_special_tokens=False)
    assert len(ids) > 1000
    # context + undecided + new tokens, never the whole output
    assert max(counting.sizes) <= 2 * MAX_PENDING_TOKENS + 2
    assert len(counting.sizes) < 4 * len(ids)  # a few decodes per token, not one per earlier token


# ---------------------------------------------------------------------- the key property

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Le café est très bon ### crème brûlée",
    "中文文本用于测试 😀 🚀 ✨ 👨‍👩‍👧",
    "def f(x):\n\n    return x # done\n",
    "€100 ≈ ¥15000; π ≈ 3.14 ###",
    "ab#c##d###e",
]
STOPS = ["###", "#", "€", "é", "\n\n", "the", "ab", "😀 ", "文", "<|im_end|>", FFFD, "o", "x):"]
MULTIBYTE = ["é", "€", "😀", "中", "𝄞", "ü", "👨‍👩‍👧", "ñ"]


def _segments(tok, byte_ids):
    n = len(tok)
    return st.one_of(
        st.integers(0, n - 1).map(lambda i: [i]),  # any id: specials (0-2), bytes, merges
        st.sampled_from(TEXTS).map(lambda s: tok.encode(s)),  # real text, stop strings inside
        st.sampled_from(MULTIBYTE).map(lambda s: spell(byte_ids, s.encode())),  # split characters
        st.binary(max_size=5).map(lambda b: spell(byte_ids, b)),  # arbitrary bytes, invalid ones too
        st.tuples(st.sampled_from([b"\x80", b"\xf0", b"\xe2\x82", b"\xff"]), st.integers(1, 12)).map(
            lambda t: spell(byte_ids, t[0] * t[1])  # long runs of invalid bytes: the forced window moves
        ),
    )


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_deltas_concatenate_to_the_stop_cut_one_shot_decode(tok, byte_ids, data):
    segments = data.draw(st.lists(_segments(tok, byte_ids), max_size=12))
    ids = [t for seg in segments for t in seg]
    skip = data.draw(st.booleans())
    full = tok.decode(ids, skip_special_tokens=skip)
    stop = data.draw(st.lists(st.sampled_from(STOPS), max_size=3))
    if full and data.draw(st.booleans()):  # a stop string taken from the text itself
        i = data.draw(st.integers(0, len(full) - 1))
        stop.append(full[i : i + data.draw(st.integers(1, 4))])
    chunks = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=5))

    det = IncrementalDetokenizer(tok, skip_special_tokens=skip, stop=stop)
    want = expected(tok, ids, stop, skip)
    shown, i, c = "", 0, 0
    while i < len(ids):
        n = chunks[c % len(chunks)]
        i, c = i + n, c + 1
        shown += det.update(ids[i - n : i])
        so_far = tok.decode(ids[:i], skip_special_tokens=skip)
        assert want.startswith(shown)  # nothing is ever taken back, nothing past a stop is shown
        # ...and nothing is held without reason: only an undecided character and a possible stop prefix
        settled = expected(tok, ids[:i], stop, skip) if det.stopped else so_far.rstrip(FFFD)
        hold = 0 if det.stopped else max((len(s) - 1 for s in stop), default=0)
        assert len(shown) >= len(settled) - hold
    shown += det.finish()
    assert shown == want
    assert det.text == want
    assert det.stopped == any(s in full for s in stop)


def test_random_sequences_against_one_shot_decode(tok, byte_ids):
    rng = random.Random(1234)
    pieces = (
        [tok.encode(s) for s in TEXTS]
        + [spell(byte_ids, s.encode()) for s in MULTIBYTE]
        + [[i] for i in range(len(tok))]
    )
    for _ in range(1000):
        ids = [t for _ in range(rng.randint(0, 40)) for t in rng.choice(pieces)]
        if rng.random() < 0.3:  # a split multi-byte character at the very end
            ids += spell(byte_ids, rng.choice(MULTIBYTE).encode())[:-1]
        stop = rng.sample(STOPS, rng.randint(0, 3))
        skip = rng.random() < 0.5
        chunks = [rng.randint(1, 6) for _ in range(rng.randint(1, 4))]
        deltas, last, _ = stream(tok, ids, chunks, stop, skip)
        assert "".join(deltas) + last == expected(tok, ids, stop, skip), (ids, stop, skip, chunks)


# ---------------------------------------------------------------------- a whole step at once


class CountingBackend:
    """Counts the calls into a Rust decoder (and the windows they carry)."""

    def __init__(self, backend) -> None:
        self.backend, self.batches, self.singles = backend, [], 0

    def decode(self, ids, skip_special_tokens):
        self.singles += 1
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_batch(self, seqs, skip_special_tokens):
        self.batches.append(len(seqs))
        return self.backend.decode_batch(seqs, skip_special_tokens=skip_special_tokens)


def test_update_many_gives_each_requests_update_deltas(tok, byte_ids):
    """Many requests stepped together (`update_many`, as the server's detokenizer does) get exactly the
    deltas each gets alone, and the text the stop rule gives the one-shot decode: random streams of text,
    split characters, invalid bytes and special tokens; with and without stop strings and special tokens;
    chunks of 0-4 tokens; requests that finish at different steps. Each round of the step (a stop-string
    request's tokens take one each) decodes its windows in one batch call per skip setting, and the
    windows that move up in one more."""
    rng = random.Random(7)
    pieces = (
        [tok.encode(s) for s in TEXTS]
        + [spell(byte_ids, s.encode()) for s in MULTIBYTE]
        + [spell(byte_ids, b"\x80" * 11), spell(byte_ids, b"\xe2\x82")]
        + [[i] for i in range(len(tok))]
    )
    n = 24
    streams = [[t for _ in range(rng.randint(0, 60)) for t in rng.choice(pieces)] for _ in range(n)]
    opts = [
        {"skip_special_tokens": rng.random() < 0.5, "stop": rng.sample(STOPS, 2) if i % 4 == 0 else None}
        for i in range(n)
    ]
    alone = [IncrementalDetokenizer(tok, **o) for o in opts]
    together = [IncrementalDetokenizer(tok, **o) for o in opts]
    counting = CountingBackend(together[0].decoder.backend)
    for det in together:  # every detokenizer of this tokenizer shares one Decoder
        assert det.decoder is together[0].decoder
    together[0].decoder.backend = counting
    try:
        pos, want, got, calls = [0] * n, [""] * n, [""] * n, 0
        live = list(range(n))
        while live:
            chunks = {i: rng.randint(0, 4) for i in live}
            new = [streams[i][pos[i] : pos[i] + chunks[i]] for i in live]
            counting.batches.clear()
            deltas = update_many([together[i] for i in live], new)
            # per round (a stop-string request's tokens take one each): windows, and windows moving up,
            # per skip setting
            rounds = max([chunks[i] for i in live if opts[i]["stop"]] + [1])
            assert len(counting.batches) <= 4 * rounds
            calls += len(counting.batches)
            for i, ids, delta in zip(live, new, deltas):
                want[i] += alone[i].update(ids)
                got[i] += delta
                pos[i] += len(ids)
            for i in [i for i in live if pos[i] >= len(streams[i])]:
                want[i] += alone[i].finish()
                got[i] += together[i].finish()
                live.remove(i)
            assert got == want
        assert calls > 0
    finally:
        together[0].decoder.backend = counting.backend
    for i in range(n):
        assert got[i] == expected(tok, streams[i], opts[i]["stop"] or (), opts[i]["skip_special_tokens"])
    with pytest.raises(RuntimeError, match="after finish"):
        update_many(together[:1], [[1]])


def test_decoder_calls_the_rust_decoder_where_it_is_the_same(tok, tmp_path):
    """The test tokenizer (byte-level BPE, no clean-up of spaces) decodes through its Rust decoder, with
    the same text as `tokenizer.decode`; a tokenizer whose decode cleans up spaces, and one that is no
    Hugging Face tokenizer, keep their own `decode`."""
    decoder = Decoder.of(tok)
    assert decoder.backend is tok.backend_tokenizer and Decoder.of(tok) is decoder
    seqs = [tok.encode(s) for s in TEXTS] + [[0, 1, 2], []]
    for skip in (True, False):
        assert decoder.many(seqs, skip) == [tok.decode(s, skip_special_tokens=skip) for s in seqs]
        assert [decoder.one(s, skip) for s in seqs] == decoder.many(seqs, skip)

    build_tokenizer(save_dir=tmp_path)
    cleaning = AutoTokenizer.from_pretrained(str(tmp_path), clean_up_tokenization_spaces=True)
    assert cleaning.clean_up_tokenization_spaces and Decoder.of(cleaning).backend is None
    counting = CountingTokenizer(tok)
    assert Decoder.of(counting).backend is None
    assert Decoder.of(counting).many(seqs[:2], True) == [tok.decode(s) for s in seqs[:2]]
    assert counting.sizes == [len(seqs[0]), len(seqs[1])]

    class Unhashable(CountingTokenizer):
        __hash__ = None  # type: ignore[assignment]  # cannot key the weak cache

    det = IncrementalDetokenizer(Unhashable(tok))
    assert det.decoder.backend is None and det.update(tok.encode("café")) + det.finish() == "café"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_update_many_is_update_for_any_streams(tok, byte_ids, data):
    """Three requests stepped together give, step by step, the deltas `update` gives each alone, for the
    property test's streams (stop strings taken from the text, split and invalid bytes, chunks of 1-4)."""
    n = 3
    streams, opts = [], []
    for _ in range(n):
        ids = [t for seg in data.draw(st.lists(_segments(tok, byte_ids), max_size=8)) for t in seg]
        stop = data.draw(st.lists(st.sampled_from(STOPS), max_size=2))
        full = tok.decode(ids)
        if full and data.draw(st.booleans()):
            i = data.draw(st.integers(0, len(full) - 1))
            stop.append(full[i : i + data.draw(st.integers(1, 4))])
        streams.append(ids)
        opts.append({"skip_special_tokens": data.draw(st.booleans()), "stop": stop})
    alone = [IncrementalDetokenizer(tok, **o) for o in opts]
    together = [IncrementalDetokenizer(tok, **o) for o in opts]
    pos = [0] * n
    while any(p < len(s) for p, s in zip(pos, streams)):
        new = []
        for i in range(n):
            k = data.draw(st.integers(1, 4))
            new.append(streams[i][pos[i] : pos[i] + k])
            pos[i] += k
        assert update_many(together, new) == [det.update(ids) for det, ids in zip(alone, new)]
    assert [d.finish() for d in together] == [d.finish() for d in alone]
