"""Smoke test of the offline benchmark: it runs end to end and counts tokens right on both sides."""

from __future__ import annotations

import json

from gapless.bench.offline import main
from gapless.bench.workload import random_workload
from gapless.testing import cached_checkpoint


def test_workload_is_deterministic_and_in_bounds():
    a = random_workload(20, 3, 9, 2, 5, vocab_size=50, seed=0)
    assert a == random_workload(20, 3, 9, 2, 5, vocab_size=50, seed=0)
    assert a != random_workload(20, 3, 9, 2, 5, vocab_size=50, seed=1)
    assert len(a) == 20
    assert all(3 <= len(p) <= 9 and all(0 <= t < 50 for t in p) for p in a.prompts)
    assert all(2 <= n <= 5 for n in a.output_lens)
    assert a.output_tokens == sum(a.output_lens)
    # prompts are drawn before output lengths: changing the output range keeps the prompts
    assert random_workload(20, 3, 9, 7, 8, vocab_size=50, seed=0).prompts == a.prompts


def test_offline_bench_smoke(tmp_path):
    model = cached_checkpoint("qwen3")
    out = tmp_path / "bench.json"
    sizes = dict(num_seqs=5, min_input=2, max_input=12, min_output=1, max_output=9)
    argv = ["--model", str(model), "--threads", "1", "--hf-batch-size", "2", "--json", str(out)]
    for name, value in sizes.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    res = main(argv)

    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    work = random_workload(**sizes, vocab_size=vocab, seed=0)
    g, h = res["gapless"], res["transformers"]
    assert g["output_tokens_per_s"] > 0 and h["output_tokens_per_s"] > 0
    # every request generated exactly its own length: the tokens/s numerator is the requested total
    assert g["output_tokens"] == g["requested_output_tokens"] == work.output_tokens
    assert g["wrong_length_requests"] == 0
    assert h["output_tokens"] == work.output_tokens
    assert h["computed_output_tokens"] >= h["output_tokens"]  # static batches decode past short requests
    assert res["ratio"] == g["output_tokens_per_s"] / h["output_tokens_per_s"]
    assert g["decode_batches"] + g["prefill_batches"] == g["steps"] > 0
    assert json.loads(out.read_text())["gapless"]["output_tokens"] == work.output_tokens
    assert "gapless / transformers" in res["report"]


def test_hf_generate_runs_past_the_checkpoints_eos():
    """The transformers side must decode every requested token even where the model emits its EOS."""
    import torch
    from transformers import AutoModelForCausalLM

    from gapless.bench.runs import hf_generate

    model = AutoModelForCausalLM.from_pretrained(
        str(cached_checkpoint("qwen3")), dtype=torch.float32, attn_implementation="sdpa"
    )
    prompts = [[5, 6, 7, 8], [9, 10]]
    free = hf_generate(model, prompts, 6, pad=0)
    assert free.shape == (2, 6)
    model.generation_config.eos_token_id = int(free[0, 0])  # now row 0's first token is the EOS
    assert torch.equal(hf_generate(model, prompts, 6, pad=0), free)
