"""The piecewise prefill graphs on the CPU, where capture is a no-op and each piece runs eagerly on the
same padded static buffers: token buckets, padding (a batch of 37 tokens in bucket 64, batches that shrink
and leave live tokens in the buffers' tail), prefix-cache hits and chunked prompts, the attention of the
real tokens between the pieces, in the plain and overlap loops, against transformers. The CUDA graphs
themselves are tested in test_cuda.py."""

from __future__ import annotations

import pytest
import torch

from gapless import LLM, SamplingParams
from gapless.config import EngineConfig
from gapless.engine.piecewise_graph import token_buckets
from gapless.engine.runner import ModelRunner
from gapless.testing.hf_reference import check_greedy, prompts_and_references

MAX_TOKENS = [3, 9, 5, 16, 7, 10, 4, 8]
LOOPS = {"plain": {"overlap": False}, "overlap": {"overlap": True, "cpu_worker": "thread", "chaos_seed": 1}}


@pytest.fixture(scope="module")
def workload(ckpt_factory):
    path = ckpt_factory("qwen3")
    # prompts sharing a prefix (cache hits: extends after a prefix) of lengths up to 70 (chunks of 48)
    prompts, refs = prompts_and_references(path, MAX_TOKENS, seed=5, shared_prefix=20, max_len=70)
    return str(path), prompts, refs


def test_token_buckets():
    assert token_buckets(1) == [1]
    assert token_buckets(16) == [16]
    assert token_buckets(64) == [16, 32, 64]
    assert token_buckets(100) == [16, 32, 64, 100]
    with pytest.raises(ValueError):
        token_buckets(0)


@pytest.mark.parametrize("loop", LOOPS)
def test_prefill_pieces_match_reference(workload, loop):
    path, prompts, refs = workload
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    with LLM(
        path,
        device="cpu",
        page_size=4,
        kv_cache_tokens=4096,
        max_running_requests=3,
        chunked_prefill_size=48,
        piecewise_cuda_graph_max_tokens=40,
        **LOOPS[loop],
    ) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        for out, ref in zip(outs, refs):
            check_greedy(out.token_ids, ref)
        pieces = llm.engine.runner.piecewise
        assert pieces is not None and pieces.buckets == [16, 32, 40]
        assert pieces.padded_tokens > 0, "no batch was padded up to its bucket"
        eager = llm.engine.stats.prefill_batches - sum(pieces.runs.values())
        assert sum(pieces.runs.values()) > 0 and eager > 0, "extends of 41-48 tokens should run eagerly"
        llm.check_integrity()


@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "olmo2", "granite", "qwen2_moe"])
def test_pieces_give_the_eager_forwards_hidden_states(ckpt_factory, arch):
    """Extend batches through the pieces and eagerly give the same hidden states and the same K/V in the
    pool: three requests of 9 tokens (27 in bucket 32), then two of 5 (10 in bucket 16, whose padded
    tail still holds the first batch's tokens and slots in the static buffers until it is reset). Families
    whose layers differ around the attention: Gemma 2's norms after each sublayer, window and soft-cap,
    OLMo 2's q/k norm over all heads and output norms, Granite's multipliers, Qwen2-MoE's experts."""
    from gapless.bench.prefill_launch import extend_batch

    cfg = dict(device="cpu", kv_cache_tokens=256, page_size=4)
    path = str(ckpt_factory(arch))
    eager = ModelRunner(EngineConfig(model=path, **cfg))
    pieces = ModelRunner(EngineConfig(model=path, piecewise_cuda_graph_max_tokens=32, **cfg))
    for requests, length in ((3, 9), (2, 5)):
        batch = extend_batch(requests, length, 4)
        want, got = eager.forward_hidden(batch), pieces.forward_hidden(batch)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(pieces.kv_pool.k_buffer[:, 4:], eager.kv_pool.k_buffer[:, 4:])
    assert pieces.piecewise is not None and dict(pieces.piecewise.runs) == {32: 1, 16: 1}
    assert pieces.piecewise.padded_tokens == 5 + 6


def test_pieces_are_off_by_default_and_refused_with_tensor_parallelism():
    assert EngineConfig(model="m").piecewise_cuda_graph_max_tokens == 0
    with pytest.raises(ValueError, match="piecewise_cuda_graph_max_tokens=-1"):
        EngineConfig(model="m", piecewise_cuda_graph_max_tokens=-1)
    with pytest.raises(ValueError, match="tensor_parallel_size 1 only"):
        EngineConfig(model="m", piecewise_cuda_graph_max_tokens=64, tensor_parallel_size=2)
