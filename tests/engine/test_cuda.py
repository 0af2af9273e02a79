"""The CUDA path: CudaStream (forward stream, pinned copies, events) with the overlap loop.

Skipped without a GPU; the same scheduler and future-token code runs on the CPU in test_parity.py and
test_overlap.py (inline, worker-thread and device-process streams), so CPU CI checks the logic and this
file checks the CUDA plumbing when a GPU is present.
"""

from __future__ import annotations

import pytest
import torch

from gapless import LLM, SamplingParams
from gapless.testing.hf_reference import check_greedy, hf_greedy, load_hf_model, make_prompts

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (CPU streams are tested elsewhere)"
)


@pytest.mark.parametrize("overlap", [False, True])
def test_cuda_greedy_parity_fp32(ckpt_factory, overlap):
    path = ckpt_factory("qwen3")
    hf = load_hf_model(path)
    prompts = make_prompts(hf.config.vocab_size, n=8)
    refs = [hf_greedy(hf, p, 16) for p in prompts]
    with LLM(
        str(path),
        device="cuda",
        dtype="float32",
        overlap=overlap,
        kv_cache_tokens=4096,
        chunked_prefill_size=32,
    ) as llm:
        outs = llm.generate(
            prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False
        )
        for out, ref in zip(outs, refs):
            check_greedy(out.token_ids, ref, tol=1e-3)
        assert llm.get_stats()["device_busy_s"] > 0
        llm.check_integrity()


def test_cuda_seeded_sampling_matches_cpu(ckpt_factory):
    path = str(ckpt_factory("llama"))
    params = SamplingParams(max_tokens=8, temperature=1.0, top_k=20, seed=3, ignore_eos=True)
    prompts = [[5, 6, 7], [9] * 12]
    with LLM(path, device="cuda", dtype="float32", kv_cache_tokens=1024) as gpu:
        on_gpu = [o.token_ids for o in gpu.generate(prompts, params, use_tqdm=False)]
    with LLM(path, device="cpu", dtype="float32", kv_cache_tokens=1024) as cpu:
        on_cpu = [o.token_ids for o in cpu.generate(prompts, params, use_tqdm=False)]
    # same logits up to fp32 rounding, same noise: equal unless a near-tie flips (rare on these models)
    assert on_gpu == on_cpu
