"""Decodes whose sampling runs inside their CUDA graph (`GraphRunner.sampling_shape`, `run_sampled`): the
decoder, the LM head, the draw and the future-token writes as one replay, one graph per bucket and
sampling shape.

On the CPU nothing is captured and `run_sampled` runs the very body a graph would record, on the same
padded static buffers, so these tests check what goes into the graph and what stays eager: every
shape's tokens equal the eager path's (graphs off), seeded draws included; batches that need a mask,
penalties or logprobs never take the sampled path; the padding's token slot stays valid. The capture and
replay themselves run in the CUDA tests at the end, skipped without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from gapless import LLM, SamplingParams
from gapless.engine.batch import decode_batch
from gapless.engine.cuda_graph import GREEDY, SAMPLED_SHAPES, TEMPERATURE
from gapless.sampling.rows import SampleFlags
from gapless.testing.hf_reference import make_prompts

GRAPH_BS = 4  # buckets 1, 2, 4
MAX_TOKENS = [6, 3, 8, 5, 7]  # batches shrink through every bucket, 3 padded to 4

SHAPES = {  # sampling "shapes" a batch of these requests has
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.7),
    "top_k_top_p": dict(temperature=0.6, top_k=20, top_p=0.95),
    "min_p": dict(temperature=1.0, min_p=0.1),
}


def _params(shape: str) -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=n, seed=10 + i, ignore_eos=True, **SHAPES[shape])
        for i, n in enumerate(MAX_TOKENS)
    ]


@pytest.fixture(scope="module")
def path(ckpt_factory):
    return str(ckpt_factory("qwen3"))


@pytest.fixture(scope="module")
def prompts(path):
    from transformers import AutoConfig

    return make_prompts(AutoConfig.from_pretrained(path).vocab_size, n=len(MAX_TOKENS), seed=5)


def _llm(path: str, graph_bs: int, device: str = "cpu", **kw) -> LLM:
    return LLM(
        path,
        device=device,
        dtype="float32",
        kv_cache_tokens=1024,
        max_running_requests=6,
        cuda_graph_max_bs=graph_bs,
        **kw,
    )


@pytest.fixture(scope="module")
def eager_tokens(path, prompts):
    """Each shape's tokens with the graph runner off: the eager path the sampled graph must equal."""
    with _llm(path, 0) as llm:
        return {s: [o.token_ids for o in llm.generate(prompts, _params(s), use_tqdm=False)] for s in SHAPES}


@pytest.mark.parametrize("overlap", [False, True])
def test_sampled_decode_gives_the_eager_paths_tokens(path, prompts, eager_tokens, overlap):
    """Greedy, temperature, top-k + top-p and min-p batches through the sampled body give the eager
    path's tokens (the seeded draws too), every decode of at most GRAPH_BS rows takes it, once per
    bucket and shape, and the padding's token slot still holds a valid id."""
    with _llm(path, GRAPH_BS, overlap=overlap) as llm:
        runner = llm.engine.runner
        graphs = runner.graphs
        assert graphs is not None
        for shape in SHAPES:
            before = sum(graphs.sampled_runs.values())
            outs = [o.token_ids for o in llm.generate(prompts, _params(shape), use_tqdm=False)]
            assert outs == eager_tokens[shape], shape
            assert sum(graphs.sampled_runs.values()) > before, f"no {shape} decode took the sampled path"
        shapes = {flags for _, flags in graphs.sampled_runs}
        assert GREEDY in shapes and TEMPERATURE in shapes and len(shapes) == len(SHAPES)
        assert {n for n, _ in graphs.sampled_runs} == {1, 2, 4} and graphs.padded_rows > 0
        # decodes larger than the largest bucket run eagerly, and every graph run was a sampled one
        assert (
            llm.engine.stats.decode_batches > sum(graphs.runs.values()) == sum(graphs.sampled_runs.values())
        )
        assert 0 <= int(runner.token_buf[runner.pad_row]) < runner.model_config.vocab_size
        llm.check_integrity()


def test_batches_needing_the_host_or_more_than_tokens_sample_eagerly(path, prompts):
    """Logprobs, penalties and logit bias keep a batch out of the sampled graph: it replays the plain
    decode graph and samples after it, and still gets its tokens."""
    asks = [dict(logprobs=2), dict(repetition_penalty=1.3), dict(logit_bias={3: 5.0})]
    with _llm(path, GRAPH_BS) as llm:
        graphs = llm.engine.runner.graphs
        for ask in asks:
            params = SamplingParams(max_tokens=4, temperature=0.8, seed=1, ignore_eos=True, **ask)
            outs = llm.generate(prompts[:3], params, use_tqdm=False)
            assert all(len(o.token_ids) == 4 for o in outs)
        assert sum(graphs.runs.values()) > 0 and not graphs.sampled_runs
        llm.check_integrity()


def test_sampling_shape(path):
    """Which flags a sampled graph takes: any mix of greedy, temperature and the filters, at most
    `sampled_max_bs` rows; never penalties, bias, masks or logprobs."""
    with _llm(path, GRAPH_BS) as llm:
        graphs = llm.engine.runner.graphs
        assert graphs.sampled_max_bs == GRAPH_BS

        def shape(n: int, flags: SampleFlags):
            vectors = [torch.arange(n)] * 6
            return graphs.sampling_shape(decode_batch(vectors, 16, flags))

        filters = SampleFlags(False, True, True, True, True, False, max_top_k=20, max_top_p_k=20)
        for flags in (*SAMPLED_SHAPES, filters):
            assert shape(3, flags) == flags
        assert shape(GRAPH_BS + 1, GREEDY) is None
        assert shape(2, None) is None
        for extra in (
            dict(need_penalties=True),
            dict(num_logprobs=0),
            dict(need_bias=True),
            dict(need_mask=True),
        ):
            assert shape(2, SampleFlags(**{**GREEDY.__dict__, **extra})) is None, extra


# ---------------------------------------------------------------------------------------- on a CUDA GPU

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the CPU runs the body)")


@cuda
def test_cuda_sampled_graphs_are_captured_and_give_the_eager_tokens(path, prompts):
    """On the GPU: greedy and temperature graphs for every bucket at start-up; top-k + top-p captured on
    first use, with no synchronising call in the step loop; each shape's tokens equal to the graphs-off
    run on the same GPU."""
    with _llm(path, 0, device="cuda") as llm:
        want = {s: [o.token_ids for o in llm.generate(prompts, _params(s), use_tqdm=False)] for s in SHAPES}
    with _llm(path, GRAPH_BS, device="cuda") as llm:
        graphs = llm.engine.runner.graphs
        assert set(graphs.sampled_graphs) == {(n, f) for n in (1, 2, 4) for f in SAMPLED_SHAPES}
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = {
                s: [o.token_ids for o in llm.generate(prompts, _params(s), use_tqdm=False)] for s in SHAPES
            }
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert got == want
        assert graphs.lazy_captures > 0 and not graphs.refused
        assert {f for _, f in graphs.sampled_runs} >= set(SAMPLED_SHAPES)
        llm.check_integrity()
