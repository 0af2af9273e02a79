"""Teacher-forced logits of a prefill, and of a prefill on a cached prefix, match transformers (fp32)."""

from __future__ import annotations

import pytest
import torch

from gapless import LLM, SamplingParams
from gapless.tensors import dataclass_to_device
from gapless.testing import ARCHS
from gapless.testing.hf_reference import hf_logits, load_hf_model, make_prompts

TOL = 1e-4


def prefill_logits(llm: LLM, prompt: list[int]) -> tuple[torch.Tensor, int]:
    """Logits of every new position of the prompt's only extend batch, and its cached prefix length."""
    eng = llm.engine
    req = eng.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
    batch = eng.scheduler.schedule()
    assert batch is not None and batch.reqs == [req], "the prompt should be prefilled alone, in one batch"
    forward = dataclass_to_device(batch.forward, eng.runner.device)
    logits = eng.runner.model.logits(eng.runner.forward_hidden(forward))
    eng.scheduler.launch(batch)
    while eng.has_unfinished():
        eng.step()
    return logits, req.cached_tokens


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_and_cached_prefix_logits(ckpt_factory, arch, page_size):
    path = ckpt_factory(arch)
    hf = load_hf_model(path)
    base = make_prompts(hf.config.vocab_size, n=2, seed=7, shared_prefix=40, max_len=60)[0]
    # in-process device side (overlap off), so the test can call the model directly
    llm = LLM(
        str(path), device="cpu", dtype="float32", page_size=page_size, kv_cache_tokens=1024, overlap=False
    )

    ours, cached = prefill_logits(llm, base)
    assert cached == 0
    torch.testing.assert_close(ours, hf_logits(hf, base), atol=TOL, rtol=0)

    # same first 32 tokens, then different ones: the second prefill runs on the cached prefix
    other = base[:32] + [(t * 7 + 3) % hf.config.vocab_size for t in base[32:50]]
    ours, cached = prefill_logits(llm, other)
    assert cached == 32
    ref = hf_logits(hf, other)[cached:]
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=TOL, rtol=0)
    llm.check_integrity()


@pytest.mark.parametrize("overlap", [False, True])
def test_logprobs_match_transformers(ckpt_factory, overlap):
    """The logprob of each generated token and the top-k list are transformers' log_softmax of the same
    position, in a batch where requests ask for different k (and one for none)."""
    path = ckpt_factory("qwen3")
    hf = load_hf_model(path)
    prompts = make_prompts(hf.config.vocab_size, n=3, seed=3, shared_prefix=10, max_len=30)
    ks = [0, 5, None]
    params = [
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=k)
        if k != 5
        else SamplingParams(max_tokens=6, temperature=0.8, seed=1, ignore_eos=True, logprobs=k)
        for k in ks
    ]
    with LLM(str(path), device="cpu", dtype="float32", kv_cache_tokens=1024, overlap=overlap) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, k, out in zip(prompts, ks, outs):
        if k is None:
            assert out.logprobs is None and out.top_logprobs is None
            continue
        ref = hf_logits(hf, prompt + out.token_ids[:-1])[len(prompt) - 1 :].log_softmax(-1)
        assert len(out.logprobs) == len(out.token_ids) == len(out.top_logprobs) == 6
        chosen = ref.gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(out.logprobs), chosen, atol=TOL, rtol=0)
        for step, top in enumerate(out.top_logprobs):
            assert len(top) == k
            if k:
                values, ids = ref[step].topk(k)
                assert [t for t, _ in top] == ids.tolist()
                torch.testing.assert_close(torch.tensor([lp for _, lp in top]), values, atol=TOL, rtol=0)
