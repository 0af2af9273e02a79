"""logit_bias and min_tokens against transformers' own logits processors (greedy), in both loops."""

from __future__ import annotations

import pytest
import torch

from gapless import LLM, SamplingParams
from gapless.testing.hf_reference import load_hf_model

PROMPT = [5, 6, 7, 8]
MAX_NEW = 12


@pytest.fixture(scope="module")
def qwen3(ckpt_factory):
    return str(ckpt_factory("qwen3"))


@pytest.fixture(scope="module")
def hf(qwen3):
    return load_hf_model(qwen3)


def hf_generate(hf, **kw) -> list[int]:
    out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0, **kw)
    return out[0, len(PROMPT) :].tolist()


@pytest.fixture(scope="module")
def greedy(hf) -> list[int]:
    return hf_generate(hf, eos_token_id=None)


@pytest.mark.parametrize("overlap", [False, True])
def test_logit_bias_matches_transformers_sequence_bias(qwen3, hf, greedy, overlap):
    # push the first greedy token away, and pull a rare one in
    bias = {greedy[0]: -100.0, 321: 7.5, greedy[3]: 2.0}
    expected = hf_generate(hf, eos_token_id=None, sequence_bias={(t,): b for t, b in bias.items()})
    assert expected != greedy
    with LLM(qwen3, device="cpu", overlap=overlap, cpu_worker="thread", kv_cache_tokens=2048) as llm:
        free = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
        biased = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, logit_bias=bias)
        outs = llm.generate([PROMPT, PROMPT, PROMPT], [free, biased, free], use_tqdm=False)
        assert outs[1].token_ids == expected
        assert outs[0].token_ids == outs[2].token_ids == greedy  # the bias stays on its own row
        # a later request in the same row has no bias left over
        assert llm.generate([PROMPT], free, use_tqdm=False)[0].token_ids == greedy
        llm.check_integrity()


@pytest.mark.parametrize("overlap", [False, True])
def test_min_tokens_matches_transformers_min_new_tokens(qwen3, hf, greedy, overlap):
    stop = greedy[1]  # the second greedy token would end the request at once
    expected = hf_generate(hf, eos_token_id=[stop], min_new_tokens=5)
    assert len(expected) >= 5 and stop not in expected[:5]
    with LLM(qwen3, device="cpu", overlap=overlap, cpu_worker="thread", kv_cache_tokens=2048) as llm:
        plain = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, stop_token_ids=[stop])
        held = SamplingParams(
            max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, stop_token_ids=[stop], min_tokens=5
        )
        outs = llm.generate([PROMPT, PROMPT], [plain, held], use_tqdm=False)
        assert outs[0].token_ids == greedy[:2]
        assert outs[1].token_ids == expected
        assert outs[1].finish_reason == ("stop" if stop in expected else "length")
        llm.check_integrity()
