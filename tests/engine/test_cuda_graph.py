"""The decode graph runner on the CPU, where capture is a no-op and replay runs the same body eagerly on the
same padded static buffers: buckets, padding (batch 3 in bucket 4, batches that shrink and leave live rows
in the buffers' tail), the reserved padding row, in the plain and overlap loops. The CUDA graphs themselves
are tested in test_cuda.py.

Also the memory-measuring dummy steps the CUDA KV sizing runs, and its arithmetic."""

from __future__ import annotations

import pytest
import torch

from gapless import LLM, SamplingParams
from gapless.config import EngineConfig
from gapless.engine.cuda_graph import batch_size_buckets
from gapless.engine.memory_plan import dummy_prefill, plan_gpu_kv
from gapless.engine.runner import measure_activations
from gapless.testing.hf_reference import check_greedy, prompts_and_references

# More requests than rows, with different lengths: decode batches shrink (4 -> 3 -> ...) as requests
# finish, freed rows are reused by later requests, and prompts share a prefix (radix cache hits), so a
# padded column left pointing at a live row or slot would corrupt a later request's table or KV.
MAX_TOKENS = [3, 9, 5, 16, 7, 10, 4, 8]
MAX_RUNNING = 6
GRAPH_BS = 4  # buckets 1, 2, 4: batches of 5-6 run eagerly, 3 is padded to 4


@pytest.fixture(scope="module")
def workload(ckpt_factory):
    path = ckpt_factory("qwen3")
    prompts, refs = prompts_and_references(path, MAX_TOKENS, seed=3, shared_prefix=24, max_len=40)
    return str(path), prompts, refs


def test_buckets():
    assert batch_size_buckets(1) == [1]
    assert batch_size_buckets(3) == [1, 2, 3]
    assert batch_size_buckets(4) == [1, 2, 4]
    assert batch_size_buckets(20) == [1, 2, 4, 8, 16, 20]
    big = batch_size_buckets(256)
    assert big[:5] == [1, 2, 4, 8, 16] and big[-2:] == [248, 256] and len(big) == 35
    with pytest.raises(ValueError):
        batch_size_buckets(0)


LOOPS = {"plain": {"overlap": False}, "overlap": {"overlap": True, "cpu_worker": "thread", "chaos_seed": 1}}


@pytest.mark.parametrize("loop", LOOPS)
def test_padded_static_buffer_decode_matches_reference(workload, loop):
    path, prompts, refs = workload
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    with LLM(
        path,
        device="cpu",
        page_size=4,
        kv_cache_tokens=2048,
        max_running_requests=MAX_RUNNING,
        chunked_prefill_size=64,
        cuda_graph_max_bs=GRAPH_BS,
        **LOOPS[loop],
    ) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        for out, ref in zip(outs, refs):
            check_greedy(out.token_ids, ref)
        runner = llm.engine.runner
        graphs = runner.graphs
        assert graphs is not None and graphs.buckets == [1, 2, 4]
        assert graphs.runs[4] > 0 and graphs.padded_rows > 0, "no batch was padded up to its bucket"
        assert graphs.runs[1] > 0
        eager = llm.engine.stats.decode_batches - sum(graphs.runs.values())
        assert eager > 0, "batches larger than the largest bucket should run eagerly"
        # the padding row's token slot still holds a valid token id (padded rows embed it)
        assert 0 <= int(runner.token_buf[runner.pad_row]) < runner.model_config.vocab_size
        llm.check_integrity()


def test_graph_runner_is_off_on_cpu_by_default(workload):
    path, prompts, refs = workload
    with LLM(path, device="cpu", kv_cache_tokens=512, overlap=False) as llm:
        assert llm.engine.runner.graphs is None
    with LLM(path, device="cpu", kv_cache_tokens=512, overlap=False, cuda_graph_max_bs=0) as llm:
        assert llm.engine.runner.graphs is None


def test_config_checks_the_new_options():
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(model="m", attention_backend="flash")
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        EngineConfig(model="m", cuda_graph_max_bs=-1)
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match=r"mem_fraction_static.*must be in \(0, 1\]"):
            EngineConfig(model="m", mem_fraction_static=bad)
    assert EngineConfig(model="m", mem_fraction_static=1.0).mem_fraction_static == 1.0  # (vLLM's 1.0)
    from gapless.attention import BACKENDS
    from gapless.config import ATTENTION_BACKENDS

    assert ATTENTION_BACKENDS == BACKENDS  # config keeps its own copy so it imports without torch


def test_cli_flags_for_the_new_options():
    import argparse

    from gapless.cli import add_engine_args, engine_options

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(
        ["--attention-backend", "triton", "--cuda-graph-max-bs", "64", "--mem-fraction-static", "0.8"]
    )
    assert engine_options(args) == {
        "attention_backend": "triton",
        "cuda_graph_max_bs": 64,
        "mem_fraction_static": 0.8,
    }


GiB = 2**30


def test_plan_gpu_kv_static_share_binds():
    # 80 GiB GPU to ourselves, 16 GiB of weights: weights + KV within 85% of it
    plan = plan_gpu_kv(
        total=80 * GiB,
        free=63 * GiB,
        allocated=16 * GiB,
        activation_peak=2 * GiB,
        graph_bytes=GiB,
        mem_fraction_static=0.85,
        bytes_per_token=128 * 1024,
        reserve=0,
    )
    assert plan.tokens == (int(80 * GiB * 0.85) - 16 * GiB) // (128 * 1024)
    # the log line carries the figures behind it, and which limit bound
    line = plan.describe()
    assert line.startswith("limited by mem_fraction_static: mem_fraction_static=0.85 of 80.0 GiB")
    assert (
        "less 16.00 GiB gapless holds leaves 52.00 GiB; 63.0 GiB free less activation peak 2.00 GiB" in line
    )


def test_plan_gpu_kv_free_memory_binds():
    # another process holds 30 GiB: what is free must still take the activation peak, graphs and reserve
    tokens = plan_gpu_kv(
        total=80 * GiB,
        free=34 * GiB,
        allocated=16 * GiB,
        activation_peak=3 * GiB,
        graph_bytes=GiB,
        mem_fraction_static=0.85,
        bytes_per_token=1000,
        reserve=GiB // 2,
    ).tokens
    assert tokens == (34 * GiB - 3 * GiB - GiB - GiB // 2) // 1000


def test_plan_gpu_kv_never_negative():
    kw = dict(total=24 * GiB, free=GiB, activation_peak=2 * GiB, graph_bytes=0, bytes_per_token=1)
    # the weights alone exceed the static share; the peak alone exceeds what is free
    assert plan_gpu_kv(allocated=23 * GiB, mem_fraction_static=0.9, **kw).tokens == 0
    assert plan_gpu_kv(allocated=GiB, mem_fraction_static=0.9, **kw).tokens == 0


def test_dummy_prefill_splits_at_the_table_width():
    batch = dummy_prefill(300, 256, pad_row=8, max_rows=8, vocab_size=100)
    assert batch.extend_lens.tolist() == [256, 44]
    assert batch.positions.shape == (300,) and int(batch.positions.max()) == 255
    assert batch.sample_index.tolist() == [255, 299]
    assert (batch.rows == 8).all() and (batch.out_slots == 0).all()
    assert batch.sampling is not None and batch.sampling.need_penalties and batch.sampling.num_logprobs == 20


def test_memory_dummies_run_and_leave_the_runner_as_new(workload):
    """The dummy prefill (split over the table width) and decodes run end to end on the CPU (where they
    measure nothing) and leave no trace: the same tokens as the reference afterwards."""
    path, prompts, refs = workload
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    with LLM(path, device="cpu", kv_cache_tokens=256, overlap=False, max_running_requests=MAX_RUNNING) as llm:
        runner = llm.engine.runner
        # (with the verify graphs' dummy extend of GRAPH_BS requests of 4 tokens too)
        # and the piecewise prefill pieces of 40 tokens, run once on padding
        sizes = measure_activations(
            runner, runner.kv_pool, runner.req_table, 300, GRAPH_BS, 4, piecewise_tokens=40
        )
        assert sizes == (0, 0)
        assert runner.sampler.output_counts is not None  # the decode dummy used penalties
        assert not runner.sampler.output_counts.any() and not runner.sampler.prompt_mask.any()
        assert (runner.token_buf[: runner.pad_row] == -1).all() and int(runner.token_buf[runner.pad_row]) == 0
        outs = llm.generate(prompts, params, use_tqdm=False)
        for out, ref in zip(outs, refs):
            check_greedy(out.token_ids, ref)
        llm.check_integrity()


def test_padding_row_is_beyond_the_schedulers_rows(workload):
    path, _, _ = workload
    with LLM(path, device="cpu", kv_cache_tokens=256, overlap=False, max_running_requests=3) as llm:
        runner = llm.engine.runner
        assert runner.pad_row == 3
        assert runner.req_table.device_table.shape[0] == 4 and runner.token_buf.shape == (4,)
        assert llm.engine.scheduler.req_table.max_rows == 3  # the scheduler never hands the padding row out
        assert torch.equal(runner.token_buf, torch.tensor([-1, -1, -1, 0]))
