"""LoRA with speculative decoding: a verify batch's tokens (each request's last token and its drafts) run
their request's adapter, so the target verifies with it, while the drafter (the n-gram lookup, or a draft
model, which has no LoRA layers) drafts without it. Greedy tokens of rows of two adapters and the base
model in one batch equal `transformers` + `peft` and the same engine without speculation: n-gram and
draft-model speculation, overlap on and off, verify batches eager and through the graph runner's padded
columns (run eagerly on the CPU)."""

from __future__ import annotations

import random

import pytest
import torch

from gapless import LLM, LoRARequest, SamplingParams
from gapless.config import EngineConfig
from gapless.testing.hf_reference import check_greedy, hf_greedy, make_prompts
from gapless.testing.lora import ATTENTION, MLP, make_adapter, peft_model

pytest.importorskip("peft", reason="the reference is transformers + peft")

MAX_NEW = 12
ADAPTERS = {
    "all": dict(targets=ATTENTION + MLP, r=8, alpha=16, seed=1),
    "qv": dict(targets=["q_proj", "v_proj"], r=4, alpha=8, seed=2, rslora=True),
}
NAMES = [None, "all", "qv"]
BASE = {"device": "cpu", "dtype": "float32", "enable_lora": True, "kv_cache_tokens": 2048}


@pytest.fixture(scope="module")
def setup(ckpt_factory, tmp_path_factory):
    """(base path, LoRARequests, prompts, each row's adapter, PEFT's greedy reference of each row, the
    engine's tokens without speculation)."""
    base = ckpt_factory("llama")
    out = tmp_path_factory.mktemp("spec-loras")
    loras = {
        name: LoRARequest(name, i + 1, str(make_adapter(base, out / name, **kw)))
        for i, (name, kw) in enumerate(ADAPTERS.items())
    }
    rng = random.Random(3)  # prompts that repeat themselves (n-gram drafts found), and others
    loops = [[rng.randrange(3, 500) for _ in range(n)] * r for n, r in ((3, 6), (5, 4), (8, 3))]
    prompts = loops + make_prompts(500, n=3, shared_prefix=8, max_len=24)
    names = [NAMES[i % len(NAMES)] for i in range(len(prompts))]
    models = {n: peft_model(base, loras[n].lora_path if n else None) for n in NAMES}
    refs = [hf_greedy(models[n], p, MAX_NEW) for p, n in zip(prompts, names)]
    base_refs = [hf_greedy(models[None], p, MAX_NEW) for p in prompts]
    changed = [r.tokens != b.tokens for r, b, n in zip(refs, base_refs, names) if n]
    assert any(changed), "the adapters were meant to change the greedy tokens"
    # in this process (cpu_worker "auto" picks a device process on 4 cores or more)
    plain, _ = _run(base, loras, prompts, names, {"cpu_worker": "inline"})
    return base, loras, prompts, names, refs, plain


def _run(base, loras, prompts, names, options: dict) -> tuple[list[list[int]], dict]:
    """Each row's tokens, and what the run did: the engine's stats, LoRA loads, verifies through the graph
    runner, and whether a draft model's layers hold any LoRA."""
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    with LLM(str(base), **{**BASE, **options}, max_running_requests=4) as llm:
        outs = llm.generate(
            prompts, params, use_tqdm=False, lora_request=[loras[n] if n else None for n in names]
        )
        llm.check_integrity()
        runner = llm.engine.runner
        graphs, draft = runner.graphs, runner.spec.draft if runner.spec is not None else None
        did = {
            **llm.get_stats(),
            "lora_loads": runner.lora.loads,
            "graph_verifies": sum(graphs.verify_runs.values()) if graphs is not None else 0,
            "draft_lora": draft is not None and any(getattr(m, "lora", None) for m in draft.model.modules()),
        }
        return [o.token_ids for o in outs], did


LOOPS = {"plain": {"overlap": False}, "overlap": {"overlap": True, "cpu_worker": "thread"}}
# (algorithm, loop, cuda_graph_max_bs): every algorithm in both loops, eager and through the graph runner
CASES = [("ngram", "plain", 0), ("ngram", "overlap", 4), ("draft", "plain", 4), ("draft", "overlap", 0)]


@pytest.mark.parametrize(("algorithm", "loop", "graphs"), CASES)
def test_speculation_with_adapters_equals_peft(setup, algorithm, loop, graphs):
    base, loras, prompts, names, refs, plain = setup
    # a draft model: the base itself, without the adapters (its drafts right for base rows, partly wrong
    # for adapter rows: acceptance and rejection both run)
    draft = {"speculative_draft_model": str(base)} if algorithm == "draft" else {}
    spec = {"speculative_algorithm": algorithm, "speculative_num_draft_tokens": 3, **draft}
    tokens, did = _run(base, loras, prompts, names, {**spec, **LOOPS[loop], "cuda_graph_max_bs": graphs})
    assert tokens == plain, "speculation changed a row's greedy tokens"
    for ours, ref in zip(tokens, refs):
        check_greedy(ours, ref)
    assert did["spec_drafted_tokens"] > 0 and did["spec_accepted_tokens"] > 0, did
    assert did["lora_loads"] >= 2 and not did["draft_lora"]  # the draft model drafts with base weights
    assert (did["graph_verifies"] > 0) == bool(graphs), "verifies were to run through the graph runner"


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="captured verify graphs and the LoRA kernels need a GPU"
)
@pytest.mark.parametrize("algorithm", ["ngram", "draft"])
def test_captured_verify_graphs_with_adapters(setup, algorithm):
    """On a GPU: captured verify graphs replay the gathered LoRA kernels over the static slot vector laid
    out as their columns; every row still equals PEFT (fp32)."""
    base, loras, prompts, names, refs, plain = setup
    draft = {"speculative_draft_model": str(base)} if algorithm == "draft" else {}
    spec = {"speculative_algorithm": algorithm, "speculative_num_draft_tokens": 3, **draft}
    tokens, did = _run(base, loras, prompts, names, {**spec, "device": "cuda", "cuda_graph_max_bs": 4})
    for ours, ref in zip(tokens, refs):
        check_greedy(ours, ref)
    assert did["graph_verifies"] > 0 and did["spec_accepted_tokens"] > 0, did


def test_config_takes_lora_with_speculation():
    """LoRA and speculative decoding start together (once refused at start-up)."""
    cfg = EngineConfig(model="m", enable_lora=True, speculative_algorithm="ngram")
    assert cfg.enable_lora and cfg.speculative_algorithm == "ngram"
