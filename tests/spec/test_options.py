"""Speculation's options: the flags' names (vLLM's and SGLang's), bad values named (a draft model whose
tokenizer differs from the target's too); the switch-off above a batch size; the figures in get_stats.
(A verify job's host syncs are watched in tests/engine/test_no_sync.py, for both algorithms.)"""

from __future__ import annotations

import argparse
import shutil

import pytest
from transformers import AutoTokenizer

from gapless import LLM, SamplingParams
from gapless.cli import add_engine_args, config_from_args
from gapless.config import EngineConfig

from .conftest import ids


def test_flags():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    argv = [
        "m",
        "--speculative-algorithm",
        "ngram",
        "--speculative-num-draft-tokens",
        "6",
        "--ngram-min",
        "2",
    ]
    p.add_argument("model_arg")
    cfg = config_from_args(p.parse_args([*argv, "--speculative-ngram-max-match-window-size", "5"]))
    draft = config_from_args(
        p.parse_args(["m", "--speculative-algorithm", "draft", "--speculative-draft-model-path", "/d"])
    )
    assert (draft.speculative_algorithm, draft.speculative_draft_model) == ("draft", "/d")
    assert (cfg.speculative_algorithm, cfg.speculative_num_draft_tokens, cfg.ngram_min, cfg.ngram_max) == (
        "ngram",
        6,
        2,
        5,
    )


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"speculative_algorithm": "eagle"}, "speculative_algorithm"),
        ({"speculative_algorithm": "draft"}, "speculative_draft_model"),  # no draft model
        ({"speculative_algorithm": "ngram", "speculative_draft_model": "/m"}, "speculative_draft_model"),
        ({"speculative_num_draft_tokens": 0}, "speculative_num_draft_tokens"),
        ({"ngram_min": 3, "ngram_max": 2}, "ngram_min"),
        ({"speculative_disable_batch_size": -1}, "speculative_disable_batch_size"),
    ],
)
def test_bad_options_are_named(options, named):
    with pytest.raises(ValueError, match=named):
        EngineConfig(model="m", **options)


def test_switched_off_above_the_batch_size_and_counted(cyclic):
    """Two requests with speculative_disable_batch_size=1 draft nothing while both run (plain decode
    batches); one alone does. The figures are in get_stats."""
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    spec = dict(speculative_algorithm="ngram", speculative_disable_batch_size=1, overlap=False)
    with LLM(cyclic, device="cpu", kv_cache_tokens=2048, **spec) as llm:
        both = llm.generate([ids("xabcdeab"), ids("xbcdea")], params, use_tqdm=False)
        assert [o.text for o in both] == ["cdeab" * 6, "bcdea" * 6]
        stats = llm.get_stats()
        assert stats["spec_verifies"] == 0 and stats["decode_batches"] == 29  # plain decodes
        out = llm.generate([ids("xabcdeab")], params, use_tqdm=False)[0]
        stats = llm.get_stats()
        assert out.text == "cdeab" * 6
        assert (
            stats["spec_drafted_tokens"] > 0 and stats["spec_accepted_tokens"] == stats["spec_drafted_tokens"]
        )
        assert stats["spec_acceptance_rate"] == 1.0
        # 29 tokens after the prefill's, in a few verifies of up to 5 tokens
        assert stats["spec_verifies"] <= 10
        llm.check_integrity()


def test_logprobs_are_the_targets(cyclic):
    """A verify returns the target's logprobs of each accepted token (and its top alternatives): those
    decoding without speculation gives."""
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2)
    got = []
    for spec in ({}, {"speculative_algorithm": "ngram"}):
        with LLM(cyclic, device="cpu", kv_cache_tokens=2048, overlap=False, **spec) as llm:
            out = llm.generate([ids("xabcdeab")], params, use_tqdm=False)[0]
            got.append((out.token_ids, out.logprobs, out.top_logprobs))
            assert llm.get_stats()["spec_accepted_tokens"] > 0 or not spec
    (tokens, plain, plain_top), (spec_tokens, lps, top) = got
    assert spec_tokens == tokens and len(lps) == len(plain) == 12
    assert all(abs(a - b) < 1e-4 for a, b in zip(plain, lps))
    for a, b in zip(plain_top, top):
        assert [t for t, _ in a] == [t for t, _ in b]
        assert all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(a, b))


@pytest.mark.parametrize("change", ["vocabulary", "eos_token_id"])
def test_a_draft_with_another_tokenizer_is_refused(cyclic, tmp_path, change):
    """A draft model must tokenize as the target does (its ids are fed to the target as they are): a
    different vocabulary or special id is a ValueError naming the draft model and what differs."""
    draft = tmp_path / "draft"
    shutil.copytree(cyclic, draft)
    tok = AutoTokenizer.from_pretrained(str(draft))
    if change == "vocabulary":
        tok.add_tokens(["<not-in-the-target>"])
    else:
        tok.eos_token = "a"
    tok.save_pretrained(str(draft))
    with pytest.raises(ValueError, match=f"speculative_draft_model='{draft}'.*{change}"):
        LLM(cyclic, device="cpu", speculative_algorithm="draft", speculative_draft_model=str(draft))
