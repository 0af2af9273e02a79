"""The stop rule (gapless.engine.stop) at its edges, checked once for every user of it.

Each case runs a token chain through the scheduler's check (`StopStrings`, which decides where the
request ends), a stream fed token by token (the server's detokenizer, the chat), and the whole output
at once (`Engine.output_text`), and asserts they agree on the token the request stops at, the stop
string and the text. The real engine and server run the same cases in tests/server/test_streaming_text.py.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from gapless.engine.detokenize import IncrementalDetokenizer, StopStrings, detokenize
from gapless.engine.request import Req
from gapless.sampling_params import SamplingParams
from gapless.testing import build_tokenizer
from gapless.testing.scripted import byte_token_ids


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """The test tokenizer as the engine loads it: saved to disk and read back by AutoTokenizer."""
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(save_dir=path)
    return AutoTokenizer.from_pretrained(str(path))


def ends(tok, ids: list[int], stop: list[str], skip: bool = True) -> tuple[int, str | None, str]:
    """Generate `ids` (the request ends at the last one anyway: EOS or length) with stop strings `stop`;
    return (tokens kept, stop string hit, text) once every user of the rule agreed on them."""
    req = Req("r", [1], SamplingParams(stop=stop, skip_special_tokens=skip), seed=0, arrival=0)
    check, hit = StopStrings(tok), None
    for i, t in enumerate(ids):
        req.output_ids.append(t)
        hit = check.check(req, t, last=i == len(ids) - 1)
        if hit is not None:
            break
    kept = req.output_ids
    det = IncrementalDetokenizer(tok, skip_special_tokens=skip, stop=stop)
    deltas = [det.update([t]) for t in kept]
    stopped_on_a_token = det.stopped
    deltas.append(det.finish())
    text = "".join(deltas)
    assert det.stop_str_hit == hit
    assert not any("\ufffd" in d for d in deltas), deltas  # characters arrive whole
    assert not any(s in d for s in stop for d in deltas)  # a stop string is never shown
    assert detokenize(tok, kept, stop=stop, skip_special_tokens=skip) == text  # at once: output_text
    if stopped_on_a_token:  # tokens past the stop (never generated) would change nothing
        assert detokenize(tok, ids + tok.encode(" more"), stop=stop, skip_special_tokens=skip) == text
    return len(kept), hit, text


def test_stop_string_spanning_tokens(tok):
    ids = tok.encode("Hello world, the end")  # Hello| wor|ld|,| the| e|nd
    assert ends(tok, ids, ["lo wo"]) == (2, "lo wo", "Hel")
    assert ends(tok, ids, ["the end"]) == (7, "the end", "Hello world, ")
    assert ends(tok, ids, ["nd!"]) == (7, None, "Hello world, the end")  # "nd" held, then shown at the end


def test_multibyte_characters(tok):
    ids = [*tok.encode("x"), *byte_token_ids("€".encode()), *tok.encode("y")]  # € is three byte tokens
    assert ends(tok, ids, ["y"]) == (5, "y", "x€")  # a character completed over several tokens
    assert ends(tok, ids, ["€"]) == (4, "€", "x")  # a stop string that is one: stops at its last byte
    assert ends(tok, ids, ["€y"]) == (5, "€y", "x")  # ... or contains one
    assert ends(tok, ids, ["x€"]) == (4, "x€", "")
    assert ends(tok, ids, ["é"]) == (5, None, "x€y")  # no byte of "€" is part of "é"
    spelled = byte_token_ids("é".encode())  # the tokenizer merges "é"; spelled byte by byte it is two
    assert ends(tok, spelled + tok.encode("b"), ["é"]) == (2, "é", "")


def test_several_stop_strings_the_earliest_wins(tok):
    ids = tok.encode("one two three")  # one| two| th|ree
    assert ends(tok, ids, ["three", "two", "e t"]) == (2, "e t", "on")  # "e t" and "two" come together
    xabc = tok.encode("xabc")  # one token per letter
    assert ends(tok, xabc, ["c", "abc"]) == (4, "abc", "x")  # a longer one starting earlier wins
    assert ends(tok, xabc, ["bc", "abc", "zz"]) == (4, "abc", "x")
    # ...but the request stops at the first token whose text holds a stop string: "abc" never comes
    assert ends(tok, xabc, ["b", "abc"]) == (3, "b", "xa")


def test_stop_at_the_first_token(tok):
    assert ends(tok, tok.encode("hi there"), ["h"]) == (1, "h", "")
    assert ends(tok, tok.encode("hi there"), ["hi"]) == (1, "hi", "")
    assert ends(tok, tok.encode("ab#"), ["a", "#"]) == (1, "a", "")


def test_stop_string_that_is_a_prefix_of_another(tok):
    xabc = tok.encode("xabc")
    assert ends(tok, xabc, ["abc", "ab"]) == (3, "ab", "x")
    assert ends(tok, xabc, ["ab", "abc"]) == (3, "ab", "x")
    assert ends(tok, xabc, ["abcd", "abc"]) == (4, "abc", "x")


def test_a_possible_stop_string_is_held_until_settled(tok):
    a, hash_, c = tok.encode("ab"), tok.encode("#"), tok.encode("c")
    det = IncrementalDetokenizer(tok, stop=["###"])
    assert det.update(a + hash_) == "ab"  # "#" may begin "###"
    assert det.update(hash_) == ""
    assert det.update(c) == "##c"  # it did not
    assert det.update(hash_ + hash_) == ""
    assert det.update(hash_) == ""  # "###": stop
    assert det.stopped and det.stop_str_hit == "###"
    assert det.update(c) == ""  # nothing after a stop string is ever shown
    assert det.finish() == ""
    assert det.text == "ab##c"
    # the request ends (EOS, length, abort) while a tail is held: it is shown after all
    assert ends(tok, tok.encode("ab#"), ["###"]) == (3, None, "ab#")


def test_special_tokens_are_matched_as_shown(tok):
    end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok.encode("hi") + [end] + tok.encode(" there")
    assert ends(tok, ids, ["<|im_end|>"]) == (len(ids), None, "hi there")  # skipped: never in the text
    assert ends(tok, ids, ["<|im_end|>"], skip=False) == (2, "<|im_end|>", "hi")
    assert ends(tok, ids, ["i t"]) == (
        3,
        "i t",
        "h",
    )  # hi|<|im_end|>| th|ere: the skipped one leaves no trace


def test_bad_stop_strings_rejected(tok):
    with pytest.raises(ValueError):
        IncrementalDetokenizer(tok, stop=[""])
    det = IncrementalDetokenizer(tok)
    det.finish()
    with pytest.raises(RuntimeError):
        det.update([5])
