"""Verify batches through the graph runner (`gapless.engine.cuda_graph`): on the CPU nothing is captured and
the same padded static-buffer body runs eagerly, so `cuda_graph_max_bs` > 0 tests the bucketing (requests
padded up to their bucket, requests that draft fewer than K padded up to K + 1 tokens, batches past the
largest bucket run eagerly) against the same engine without graphs: greedy tokens and logprobs equal, for
n-gram and draft-model speculation, in the overlap loop with chaos; padding never touches a request's KV
(the integrity check). The captured graphs are compared with eager runs in test_graphs_cuda below."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoConfig

from gapless import LLM, SamplingParams

GRAPH_BS = 4  # buckets 1, 2, 4: a verify of 3 requests is padded to 4, of 5-6 runs eagerly
LOOP = {"overlap": True, "cpu_worker": "thread", "chaos_seed": 2}


def _workload(vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts that repeat themselves (n-gram drafts partly right) and that do not, with max_tokens that
    end requests mid-run (fewer drafts than K near the end) and shrink the batch."""
    rng = random.Random(5)
    loops = [[rng.randrange(3, vocab) for _ in range(n)] * r for n, r in ((3, 6), (5, 4), (9, 3))]
    prompts = loops + [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 7, 30, 12)]
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=1)
        for n in (2, 40, 9, 30, 5, 17, 13)
    ]
    return prompts, params


def _run(
    path: str, graphs: int, spec: dict, device: str = "cpu", count: int = 7, **options
) -> tuple[list, object]:
    """Tokens and logprobs of the workload's first `count` requests, and the runner's graph runner. A
    random-weight model: KV a padded token wrote into a request's slots would change its logprobs."""
    prompts, params = _workload(AutoConfig.from_pretrained(path).vocab_size)
    prompts, params = prompts[:count], params[:count]
    with LLM(
        path,
        device=device,
        kv_cache_tokens=1024,
        max_running_requests=6,
        chunked_prefill_size=32,
        cuda_graph_max_bs=graphs,
        **(LOOP if device == "cpu" else {"overlap": True}),
        **spec,
        **options,
    ) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        llm.check_integrity()
        return [(o.token_ids, o.logprobs) for o in outs], llm.engine.runner.graphs


def _spec(algorithm: str, model: str) -> dict:
    draft = {"speculative_draft_model": model} if algorithm == "draft" else {}
    return {"speculative_algorithm": algorithm, "speculative_num_draft_tokens": 3, **draft}


def _same(a: list, b: list) -> None:
    for (tokens, lps), (ref_tokens, ref_lps) in zip(a, b):
        assert tokens == ref_tokens
        assert max(abs(x - y) for x, y in zip(lps, ref_lps)) < 1e-4


@pytest.mark.parametrize("algorithm", ["ngram", "draft"])
def test_verify_batches_through_the_graph_runner_are_eager_ones(ckpt_factory, algorithm):
    path = str(ckpt_factory("qwen3"))
    spec = _spec(algorithm, path)  # a draft model: the target itself, its drafts right
    eager, none = _run(path, 0, spec)
    assert none is None
    graphed, graphs = _run(path, GRAPH_BS, spec)
    _same(graphed, eager)
    assert graphs is not None and graphs.verify_width == 4
    assert sum(graphs.verify_runs.values()) > 0, "no verify ran through the graph runner"
    assert graphs.verify_runs[4] > 0 and graphs.padded_rows > 0, "no verify was padded up to its bucket"
    assert graphs.padded_tokens > 0, "no request drafted fewer than K"


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the interpreter's run; on a GPU test_graphs_cuda runs the kernel"
)
def test_triton_extend_kernel_reads_the_padded_verify_layout(ckpt_factory):
    """The Triton backend (its extend kernel under the interpreter, as a GPU graph would run it) on the
    padded verify columns gives the torch backend's eager tokens and logprobs. Three requests: a verify
    padded to bucket 4 (kept short: the interpreter is slow)."""
    path = str(ckpt_factory("qwen3"))
    spec = _spec("ngram", path)
    eager, _ = _run(path, 0, spec, count=3)
    graphed, graphs = _run(path, GRAPH_BS, spec, count=3, attention_backend="triton")
    _same(graphed, eager)
    assert graphs is not None and graphs.verify_runs[4] > 0 and graphs.padded_tokens > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("algorithm", ["ngram", "draft"])
def test_graphs_cuda(ckpt_factory, algorithm):
    """The captured decode and verify graphs replayed on a GPU give eager's tokens and logprobs."""
    path = str(ckpt_factory("qwen3"))
    spec = _spec(algorithm, path)
    eager, _ = _run(path, 0, spec, device="cuda")
    graphed, graphs = _run(path, GRAPH_BS, spec, device="cuda")
    _same(graphed, eager)
    assert graphs is not None and set(graphs.verify_graphs) == {1, 2, 4} and set(graphs.graphs) == {1, 2, 4}
    assert sum(graphs.verify_runs.values()) > 0
