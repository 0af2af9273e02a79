"""The CUDA path: CudaStream (forward stream, pinned copies, events) with the overlap loop; the Triton
backend and decode CUDA graphs (on and off agree, bf16 parity); the piecewise prefill graphs; no
synchronising call in the step loop;
the KV pool sized from GPU memory.

Skipped without a GPU; the same scheduler and future-token code runs on the CPU in test_parity.py and
test_overlap.py (inline, worker-thread and device-process streams), the graph runner's padded static
buffers in test_cuda_graph.py, the Triton kernels under the interpreter in test_backends.py and the
no-sync rule in test_no_sync.py, so CPU CI checks the logic and this file checks the CUDA plumbing when a
GPU is present.
"""

from __future__ import annotations

import gc

import pytest
import torch

from gapless import LLM, SamplingParams
from gapless.testing.hf_reference import (
    check_greedy,
    hf_greedy,
    load_hf_model,
    make_prompts,
    prompts_and_references,
)

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


# ---------------------------------------------------------------- attention backend, CUDA graphs, KV sizing

GRAPH_MAX_TOKENS = [4, 12, 6, 16, 9, 14, 5, 11, 8, 10, 7]  # batches shrink through several buckets


def _graph_run(path, max_tokens, prompts, **kw):
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
    with LLM(str(path), device="cuda", kv_cache_tokens=4096, max_running_requests=16, **kw) as llm:
        outs = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        runner = llm.engine.runner
        runs = dict(runner.graphs.runs) if runner.graphs is not None else {}
        padded = runner.graphs.padded_rows if runner.graphs is not None else 0
        llm.check_integrity()
    return outs, runs, padded


@pytest.mark.parametrize("overlap", [False, True])
def test_cuda_graphs_on_and_off_give_the_same_greedy_tokens_fp32(ckpt_factory, overlap):
    path = ckpt_factory("qwen3")
    hf = load_hf_model(path)
    prompts = make_prompts(hf.config.vocab_size, n=len(GRAPH_MAX_TOKENS), seed=4)
    refs = [hf_greedy(hf, p, n) for p, n in zip(prompts, GRAPH_MAX_TOKENS)]
    on, runs, padded = _graph_run(
        path, GRAPH_MAX_TOKENS, prompts, dtype="float32", overlap=overlap, cuda_graph_max_bs=8
    )
    off, no_runs, _ = _graph_run(
        path, GRAPH_MAX_TOKENS, prompts, dtype="float32", overlap=overlap, cuda_graph_max_bs=0
    )
    assert sum(runs.values()) > 0 and padded > 0, f"no padded graph replay: {runs}"
    assert no_runs == {}
    assert on == off
    for out, ref in zip(on, refs):
        check_greedy(out, ref, tol=1e-3)


def test_cuda_graphs_bf16_parity(ckpt_factory):
    """bf16 through the graphs against the fp32 reference: a divergence only where the reference's top-2
    logits are within bf16's error (tolerance 0.1 on logits of std ~2)."""
    path = ckpt_factory("llama")
    hf = load_hf_model(path)
    prompts = make_prompts(hf.config.vocab_size, n=len(GRAPH_MAX_TOKENS), seed=5)
    refs = [hf_greedy(hf, p, n) for p, n in zip(prompts, GRAPH_MAX_TOKENS)]
    outs, runs, _ = _graph_run(path, GRAPH_MAX_TOKENS, prompts, dtype="bfloat16", cuda_graph_max_bs=8)
    assert sum(runs.values()) > 0
    for out, ref in zip(outs, refs):
        check_greedy(out, ref, tol=0.1)


@pytest.mark.parametrize(("dtype", "tol"), [("float32", 1e-3), ("bfloat16", 0.1)])
def test_cuda_piecewise_prefill_graphs_give_the_reference_tokens(ckpt_factory, dtype, tol):
    """Prefills of up to 48 tokens replay their captured pieces (attention between them as it comes), with
    prefix hits and chunks; the tokens are transformers' (bf16: within its error), and K/V stays whole."""
    path = ckpt_factory("qwen3")
    prompts, refs = prompts_and_references(path, [6] * 8, seed=6, shared_prefix=20, max_len=70)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with LLM(
        str(path),
        device="cuda",
        dtype=dtype,
        kv_cache_tokens=4096,
        chunked_prefill_size=64,
        max_running_requests=3,
        piecewise_cuda_graph_max_tokens=48,
    ) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        pieces = llm.engine.runner.piecewise
        assert pieces is not None and sorted(pieces.graphs) == [16, 32, 48]
        assert sum(pieces.runs.values()) > 0 and pieces.padded_tokens > 0
        llm.check_integrity()
    for out, ref in zip(outs, refs):
        check_greedy(out.token_ids, ref, tol=tol)


def test_cuda_defaults_triton_backend_and_every_bucket_captured(ckpt_factory):
    from gapless.attention.triton_backend import TritonBackend
    from gapless.engine.cuda_graph import batch_size_buckets

    with LLM(str(ckpt_factory("qwen3")), device="cuda", kv_cache_tokens=2048, max_running_requests=16) as llm:
        runner = llm.engine.runner
        assert isinstance(runner.backend, TritonBackend)
        assert runner.graphs is not None and sorted(runner.graphs.graphs) == batch_size_buckets(16)


def test_cuda_step_loop_never_syncs(ckpt_factory):
    """The overlap loop on CUDA with every sampling stage, penalties and logprobs, under
    set_sync_debug_mode("error"): any synchronising call (a device read, a pageable copy) raises. The
    completion-event wait is not one of them."""
    params = [
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
        SamplingParams(
            max_tokens=8, temperature=0.9, top_k=12, top_p=0.8, min_p=0.05, seed=1, ignore_eos=True
        ),
        SamplingParams(
            max_tokens=8, temperature=1.0, repetition_penalty=1.2, frequency_penalty=0.2, logprobs=3
        ),
    ]
    path = ckpt_factory("llama")
    prompts = make_prompts(load_hf_model(path).config.vocab_size, n=9, seed=6)
    with LLM(str(path), device="cuda", kv_cache_tokens=4096, cuda_graph_max_bs=4) as llm:
        llm.generate(prompts[:3], params, use_tqdm=False)  # first use: pinned pools, penalty state
        torch.cuda.set_sync_debug_mode("error")
        try:
            outs = llm.generate(prompts, [params[i % 3] for i in range(len(prompts))], use_tqdm=False)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert all(len(o.token_ids) == 8 for o in outs)


def test_cuda_kv_cache_memory_gib_is_for_the_cpu(ckpt_factory):
    with pytest.raises(ValueError, match="mem_fraction_static"):
        LLM(str(ckpt_factory("llama")), device="cuda", kv_cache_memory_gib=0.5)


GiB = 2**30


@pytest.mark.whole_gpu
def test_cuda_kv_pool_sized_from_free_memory_fits(ckpt_factory):
    """With all but ~3 GiB of the GPU taken, the pool is sized from what is left after the measured
    activation peak and the graphs, and the largest steps (a full prefill chunk, a full decode batch
    through the graphs) then run without running out of memory."""
    path = str(ckpt_factory("llama", size="bench"))
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    blocker = torch.empty(free - 3 * GiB, dtype=torch.uint8, device="cuda")
    try:
        with LLM(path, device="cuda", chunked_prefill_size=2048, max_running_requests=64) as llm:
            runner = llm.engine.runner
            pool = runner.kv_pool.k_buffer.nbytes + runner.kv_pool.v_buffer.nbytes
            assert 0 < pool < 3 * GiB - 512 * 2**20  # the reserve and the activation peak stay free
            prompts = [[7 + i] * 1500 for i in range(64)]
            outs = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
            assert all(len(o.token_ids) == 16 for o in outs)
            assert runner.graphs is not None and runner.graphs.runs
            llm.check_integrity()
    finally:
        del blocker
        torch.cuda.empty_cache()


def test_cuda_too_little_memory_for_any_kv_is_a_clear_error(ckpt_factory):
    # a static share smaller than the weights themselves leaves nothing for the pool
    with pytest.raises(RuntimeError, match="no GPU memory left for the KV cache"):
        LLM(str(ckpt_factory("llama", size="bench")), device="cuda", mem_fraction_static=1e-4)


@pytest.mark.whole_gpu
def test_cuda_leaving_llm_gives_the_memory_back_at_once(ckpt_factory):
    """With the garbage collector off, leaving `with LLM(...)` (default pool: most of the GPU, CUDA graphs
    on) returns the allocated memory to its baseline and the cached blocks to the device; so a second
    LLM in the same process gets a pool as large as the first's."""
    path = str(ckpt_factory("llama", size="bench"))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    slack = 256 * 2**20  # cuBLAS workspaces the streams keep, a few MiB each
    kv_tokens = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(2):
            # 1024 rows of 4096 tokens could use 64 GiB: the pool is sized by the memory, not the rows
            with LLM(
                path, device="cuda", max_running_requests=1024, chunked_prefill_size=512, cuda_graph_max_bs=16
            ) as llm:
                out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
                assert len(out[0].token_ids) == 4 and llm.engine.runner.graphs is not None
                kv_tokens.append(llm.engine.info.kv_tokens)
                assert torch.cuda.memory_allocated() > allocated + GiB  # the pool really was taken
            assert torch.cuda.memory_allocated() <= allocated + slack
            assert torch.cuda.memory_reserved() <= reserved + slack
    finally:
        gc.enable()
    assert kv_tokens[1] >= 0.95 * kv_tokens[0], kv_tokens
