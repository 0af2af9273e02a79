"""Prompt logprobs (`SamplingParams.prompt_logprobs`) equal transformers' log-softmax of the same checkpoint
at every scored position (float32, 1e-4), for every parity architecture, under chunked prefill, page sizes
1 and 16, overlap on and off, a radix hit on half the prompt, and in a batch beside generating requests
whose output stays what it is alone."""

from __future__ import annotations

import re

import pytest
import torch

from gapless import LLM, SamplingParams
from gapless.engine.prompt_logprobs import prompt_logprobs_output
from gapless.testing import ARCHS
from gapless.testing.hf_reference import hf_logits, load_hf_model, make_prompts

TOL = 1e-4
K = 3
# (page_size, chunked_prefill_size, loop): chunks of 16 split every prompt; 48 splits the long ones
CONFIGS = [(1, 16, "overlap"), (16, 48, "plain")]
LOOPS = {"plain": {"overlap": False}, "overlap": {"overlap": True, "cpu_worker": "thread"}}


def check_prompt_logprobs(hf, prompt: list[int], got: list, start: int = 1, k: int = K) -> None:
    """`got` (RequestOutput.prompt_logprobs) against transformers: None before `start`, then the prompt
    token's logprob and rank and the top k of every position."""
    ref = hf_logits(hf, prompt).log_softmax(-1)  # ref[p - 1] is the distribution of position p
    assert len(got) == len(prompt)
    assert all(e is None for e in got[: max(1, start)])
    for pos in range(max(1, start), len(prompt)):
        entry, dist, tok = got[pos], ref[pos - 1], prompt[pos]
        torch.testing.assert_close(torch.tensor(entry[tok].logprob), dist[tok], atol=TOL, rtol=0)
        # rank: 1 + the tokens more likely than it (a near-tie may count either way)
        lo, hi = int((dist > dist[tok] + TOL).sum()) + 1, int((dist > dist[tok] - TOL).sum()) + 1
        assert lo <= entry[tok].rank <= hi, (pos, entry[tok].rank, lo, hi)
        if not k:
            assert list(entry) == [tok]
            continue
        top = {t: e.logprob for t, e in entry.items() if e.rank <= k}
        values = dist.topk(k).values
        assert len(top) == k and len(entry) in (k, k + 1)
        torch.testing.assert_close(torch.tensor(sorted(top.values(), reverse=True)), values, atol=TOL, rtol=0)
        assert all(float(dist[t]) >= float(values[-1]) - TOL for t in top)


@pytest.mark.parametrize(("page_size", "chunk", "loop"), CONFIGS)
@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logprobs_match_transformers(ckpt_factory, arch, page_size, chunk, loop):
    path = ckpt_factory(arch)
    hf = load_hf_model(path)
    vocab = hf.config.vocab_size
    base, short, gen = make_prompts(vocab, n=3, seed=11, shared_prefix=64, max_len=90)
    half = len(base) // 2 // 16 * 16  # a page-aligned half: the cached part of `other`
    other = base[:half] + [(t * 5 + 1) % vocab for t in base[half:]]
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=5, temperature=0.9, seed=4, ignore_eos=True)
    opts = dict(device="cpu", dtype="float32", page_size=page_size, chunked_prefill_size=chunk)
    with LLM(str(path), kv_cache_tokens=2048, **opts, **LOOPS[loop]) as llm:
        alone = llm.generate([gen, gen], [greedy, seeded], use_tqdm=False)
        llm.generate([base], greedy, use_tqdm=False)  # `base` is in the cache now
        score = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=K)
        tail = SamplingParams(max_tokens=2, prompt_logprobs=K, prompt_logprobs_start=half + 1, logprobs=1)
        outs = llm.generate(
            [base, other, gen, short, gen],
            [score, tail, greedy, SamplingParams(max_tokens=1, prompt_logprobs=0), seeded],
            use_tqdm=False,
        )
        llm.check_integrity()
    # scoring from position 1 must compute the whole prompt: nothing of `base` comes from the cache
    assert outs[0].cached_tokens == 0
    check_prompt_logprobs(hf, base, outs[0].prompt_logprobs)
    # scoring from half + 1 needs the hidden state of position `half`: the cached half is reused
    assert outs[1].cached_tokens == half
    check_prompt_logprobs(hf, other, outs[1].prompt_logprobs, start=half + 1)
    check_prompt_logprobs(hf, short, outs[3].prompt_logprobs, k=0)
    # the generating requests of the batch sample what they sample alone
    assert outs[2].token_ids == alone[0].token_ids and outs[4].token_ids == alone[1].token_ids
    assert outs[2].prompt_logprobs is None


def test_prompt_logprobs_of_one_token_prompt_and_bad_values(ckpt_factory):
    """A one-token prompt has only the first position (None); bad values are ValueErrors naming the field."""
    path = ckpt_factory("llama")
    with LLM(str(path), device="cpu", dtype="float32", kv_cache_tokens=256) as llm:
        (out,) = llm.generate([[5]], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)
        assert out.prompt_logprobs == [None]
    for bad in (1000, -1, 1.5, "3"):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
    with pytest.raises(ValueError, match="prompt_logprobs_start"):
        SamplingParams(prompt_logprobs=1, prompt_logprobs_start=-2)


@pytest.mark.parametrize("chaos_seed", [0, 1])
def test_prompt_logprobs_under_chaos_retraction_and_abort(ckpt_factory, chaos_seed):
    """Overlap under chaos (random delays on both sides), a KV pool small enough to retract, and a scoring
    request aborted mid chunked prefill: the other scoring requests' logprobs stay exact, the generating
    requests' tokens stay what they are alone, and nothing leaks."""
    path = ckpt_factory("qwen3")
    hf = load_hf_model(path)
    prompts = make_prompts(hf.config.vocab_size, n=6, seed=5, shared_prefix=40, max_len=70)
    gen = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    score = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    with LLM(str(path), device="cpu", overlap=False, kv_cache_tokens=2048) as llm:
        alone = [o.token_ids for o in llm.generate(prompts, gen, use_tqdm=False)]
    opts = dict(chunked_prefill_size=16, kv_cache_tokens=160, init_new_token_ratio=0.02)
    with LLM(
        str(path), device="cpu", overlap=True, cpu_worker="thread", chaos_seed=chaos_seed, **opts
    ) as llm:
        eng = llm.engine
        reqs = [eng.add_request(p, score if i % 2 else gen) for i, p in enumerate(prompts)]
        doomed = eng.add_request(list(range(200, 260)), score)
        while eng.has_unfinished():
            eng.step()
            if 16 < doomed.kv_len < 48 and not doomed.aborted:
                eng.abort(doomed.rid)
        assert eng.stats.retractions > 0
        assert doomed.finish_reason == "abort"
        llm.check_integrity()
    for i, (req, prompt) in enumerate(zip(reqs, prompts)):
        assert req.output_ids == alone[i]
        if i % 2:
            check_prompt_logprobs(hf, prompt, prompt_logprobs_output(req), k=2)


def test_prompt_logprobs_of_constrained_requests(ckpt_factory):
    """A request under a grammar scores its prompt like any other, admitted while a constrained request
    is decoding in the overlap loop (whose batches sample under deferred masks), and its output still
    follows its grammar."""
    path = ckpt_factory("qwen3")
    hf = load_hf_model(path)
    rng = torch.Generator().manual_seed(5)
    first, second, third = (
        torch.randint(3, hf.config.vocab_size, (n,), generator=rng).tolist() for n in (12, 30, 21)
    )
    long = SamplingParams(max_tokens=24, temperature=0.0, regex="[a-z]{24}")
    scored = SamplingParams(max_tokens=6, temperature=0.0, regex="[a-c]{6}", prompt_logprobs=K)
    with LLM(str(path), device="cpu", dtype="float32", kv_cache_tokens=2048, **LOOPS["overlap"]) as llm:
        eng = llm.engine
        eng.add_request(first, long)
        for _ in range(4):  # the first request decodes under its grammar
            eng.step()
        later = [eng.add_request(p, scored) for p in (second, third)]
        while eng.has_unfinished():
            eng.step()
        llm.check_integrity()
    for prompt, req in zip((second, third), later, strict=True):
        check_prompt_logprobs(hf, prompt, prompt_logprobs_output(req))
        assert re.fullmatch("[a-c]{1,6}", eng.output_text(req)), eng.output_text(req)
