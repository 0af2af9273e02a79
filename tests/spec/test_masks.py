"""Token masks with speculation: grammars and min_tokens give the tokens of decoding without speculation.

min_tokens: the stop tokens are masked at exactly the verify positions whose output step is under
min_tokens (read on the device, as the host knows only bounds under overlap), greedy and seeded, whether
EOS is drafted inside a run or not. Grammars: under n-gram speculation a request under one drafts, each
verify position masked with the grammar's state after the drafts before it (filled after the previous step
was processed, as a decode's, from the same lookup repeated on the host); under a draft model it drafts
nothing; the masks of both kinds meet in one deferred sampling job."""

from __future__ import annotations

import re

import pytest

from gapless import LLM, SamplingParams
from gapless.default_model.tokenizer import build_tokenizer

from .conftest import ids
from .test_greedy import LOOPS, _spec


def _outputs(
    path: str, prompts: list[list[int]], params: list[SamplingParams], **options
) -> tuple[list, dict]:
    with LLM(path, device="cpu", kv_cache_tokens=2048, **options) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        llm.check_integrity()
        return [(o.token_ids, o.finish_reason) for o in outs], llm.get_stats()


@pytest.mark.parametrize("algorithm", ["ngram", "draft"])
def test_min_tokens_with_speculation_is_decodings(cyclic, algorithm):
    """The scripted model writes g h i j EOS after f, and the prompt holds that chain, so n-gram drafts
    (and the model drafting for itself) put EOS inside accepted runs. Each min_tokens from 0 to 8 moves
    the first allowed EOS; with overlap several verifies are in flight, so the host's bound on a
    position's step is behind the truth: the output must still be exactly plain decoding's."""
    eos = build_tokenizer().eos_token_id
    prompt = ids("fghij") + [eos] + ids("f")
    greedy = [SamplingParams(max_tokens=12, temperature=0.0, min_tokens=m) for m in range(9)]
    seeded = [SamplingParams(max_tokens=12, temperature=0.7, seed=m, min_tokens=m) for m in (2, 5, 7)]
    prompts, params = [prompt] * 12, greedy + seeded
    plain, _ = _outputs(cyclic, prompts, params, overlap=False)
    assert [len(t) for t, _ in plain[:5]] == [5] * 5  # EOS at step 4: min_tokens <= 4 does not hold it back
    assert all(t[-1] != eos or len(t) > m for (t, _), m in zip(plain, range(9)))
    assert plain[8][0][:4] == ids("ghij") and plain[8][0][4] != eos  # held back: the runner-up instead
    for loop in LOOPS.values():
        spec, stats = _outputs(cyclic, prompts, params, **loop, **_spec(algorithm, cyclic))
        assert spec == plain
        assert stats["spec_accepted_tokens"] > 0


@pytest.mark.parametrize("algorithm", ["ngram", "draft"])
def test_grammars_with_speculation_are_decodings(cyclic, algorithm):
    """Requests under a regex (which the model's own continuation breaks, so the mask decides), a JSON
    object and min_tokens run beside requests that draft: every output is plain decoding's, the grammars'
    outputs match them, and the others still accept drafts."""
    eos = build_tokenizer().eos_token_id
    cycle = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [
        ids("xabcdeab"),
        ids("xabcdeab"),
        ids("xbcdea"),
        ids("fghij") + [eos] + ids("f"),
        ids("xcdeab"),
    ]
    params = [
        SamplingParams(max_tokens=10, temperature=0.0, regex="(ac|bd)+e"),
        cycle,
        SamplingParams(max_tokens=24, temperature=0.0, json_object=True),
        SamplingParams(max_tokens=12, temperature=0.0, min_tokens=7),
        cycle,
    ]
    plain, _ = _outputs(cyclic, prompts, params, overlap=False)
    text = build_tokenizer().decode(plain[0][0], skip_special_tokens=True)
    assert text.startswith(("ac", "bd")) and "e" in text and not text.startswith("cde")
    for loop in LOOPS.values():
        spec, stats = _outputs(cyclic, prompts, params, **loop, **_spec(algorithm, cyclic))
        assert spec == plain
        assert stats["spec_accepted_tokens"] > 0


# regexes over the cyclic model's continuation of "xabcdeab" (c d e a b c ...): one it follows (every
# draft allowed) to its end, and two that turn it off its script each lap (the first lap's drafts refused
# past the turn, later laps' drafts looked up in the grammar's own output), cut by max_tokens: the
# outputs, as plain decoding gives them; and a JSON object
GUIDED = {"(cdeab){3}": "cdeab" * 3, "(cdeaq){9}": ("cdeaq" * 5)[:23], "(cd){12}": ("cd" * 12)[:23]}


def test_grammar_requests_draft_up_to_the_first_draft_the_grammar_refuses(cyclic):
    """Requests under a grammar only: with n-gram speculation they draft (drafts accepted and refused), and
    their tokens are plain decoding's under the grammar, in both loops."""
    prompts = [ids("xabcdeab")] * (len(GUIDED) + 1)
    params = [SamplingParams(max_tokens=23, temperature=0.0, regex=r) for r in GUIDED]
    params.append(SamplingParams(max_tokens=20, temperature=0.0, json_object=True))
    plain, _ = _outputs(cyclic, prompts, params, overlap=False)
    tok = build_tokenizer()
    texts = [tok.decode(tokens, skip_special_tokens=True) for tokens, _ in plain[:3]]
    assert texts == list(GUIDED.values())
    assert re.fullmatch(next(iter(GUIDED)), texts[0]) and plain[0][1] == "stop"  # the grammar ended it
    for loop in LOOPS.values():
        spec, stats = _outputs(cyclic, prompts, params, **loop, **_spec("ngram", cyclic))
        assert spec == plain
        assert stats["spec_accepted_tokens"] >= 15, stats
        assert stats["spec_drafted_tokens"] > stats["spec_accepted_tokens"], "no draft was refused"


def test_seeded_grammar_requests_draft_and_keep_their_tokens(ckpt_factory):
    """Sampled, seeded requests under a grammar on a random-weight model: with n-gram drafts (some
    accepted) each gets the tokens it gets without speculation, and every output is complete and matches
    its regex."""
    path = str(ckpt_factory("qwen3"))
    prompts = [ids("xabcdeab")] * 3
    params = [SamplingParams(max_tokens=23, temperature=1.0, seed=s, regex="(ab|c)+") for s in (1, 2, 3)]
    plain, _ = _outputs(path, prompts, params, overlap=False)
    tok = build_tokenizer()
    for tokens, reason in plain:
        assert reason == "stop" and re.fullmatch("(ab|c)+", tok.decode(tokens, skip_special_tokens=True))
    spec, stats = _outputs(path, prompts, params, **LOOPS["overlap"], **_spec("ngram", path))
    assert spec == plain
    assert stats["spec_accepted_tokens"] > 0
