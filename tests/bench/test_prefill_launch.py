"""The prefill-launch benchmark: its batch is a real extend batch the engine's runner takes, and it runs end
to end on the CPU (the GPU columns need CUDA)."""

from __future__ import annotations

import json

import pytest
import torch

from gapless.bench import prefill_launch
from gapless.config import EngineConfig
from gapless.engine.runner import ModelRunner


def test_extend_batch_stores_every_token_in_a_slot_of_its_own(ckpt_factory):
    """The measured forward writes each prompt token's K/V once, in its own slot past the padding page,
    and attends over its own prompt: the same hidden states as each prompt run alone."""
    runner = ModelRunner(
        EngineConfig(model=str(ckpt_factory("qwen3")), device="cpu", kv_cache_tokens=64, page_size=4)
    )
    batch = prefill_launch.extend_batch(3, 5, runner.page_size)
    assert batch.out_slots.tolist() == list(range(4, 19))
    assert batch.token_rows.tolist() == [0] * 5 + [1] * 5 + [2] * 5
    hidden = runner.forward_hidden(batch)
    k = runner.kv_pool.k[0]
    written = k.flatten(1).abs().sum(1) > 0
    assert written[4:19].all() and not written[:4].any() and not written[19:].any()
    for i in range(3):  # request i alone, in row 0: attention saw its own prompt only
        one = prefill_launch.extend_batch(1, 5, runner.page_size)
        one.input_ids = batch.input_ids[5 * i : 5 * (i + 1)]
        torch.testing.assert_close(runner.forward_hidden(one), hidden[5 * i : 5 * (i + 1)])


def test_prefill_launch_bench_runs_on_cpu(tmp_path, capsys):
    out = tmp_path / "prefill.json"
    rows = prefill_launch.main(
        ["--tokens", "16", "48", "--prompt-len", "16", "--iters", "2", "--warmup", "1", "--json", str(out)]
        + ["--device", "cpu"]  # the CPU's columns on any machine (a GPU machine defaults to CUDA)
    )
    assert [(r["tokens"], r["requests"], r["prompt_len"]) for r in rows] == [(16, 1, 16), (48, 3, 16)]
    for r in rows:
        assert r["launch_ms"] > 0
        assert r["gpu_work_ms"] is None and r["graph_gpu_ms"] is None  # CUDA only
    printed = capsys.readouterr().out
    assert "| 48 | 3 x 16 | eager |" in printed and "launch/work" in printed
    assert len(json.loads(out.read_text())["rows"]) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU work and graph columns need CUDA")
def test_prefill_launch_bench_measures_gpu_work_on_cuda():
    (r,) = prefill_launch.main(["--tokens", "256", "--prompt-len", "128", "--iters", "3"])
    assert r["gpu_work_ms"] is not None and r["gpu_work_ms"] > 0
    assert r["graph_launch_ms"] is not None and r["graph_gpu_ms"] is not None and r["graph_gpu_ms"] > 0


def test_prefill_launch_bench_takes_the_piecewise_graphs_up_to_their_size(capsys):
    rows = prefill_launch.main(
        ["--tokens", "16", "48", "--prompt-len", "16", "--iters", "1", "--warmup", "0"]
        + ["--engine-option", "piecewise_cuda_graph_max_tokens=32"]
    )
    assert [r["piecewise"] for r in rows] == [True, False]  # 48 tokens: past the largest bucket, eager
    assert "| 16 | 1 x 16 | pieces |" in capsys.readouterr().out
