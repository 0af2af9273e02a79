"""LoRA serving equals `transformers` + `peft`: greedy tokens of rows running three adapters and the base
model mixed in one batch, for three families (Phi-3's fused checkpoint names among them; every other
family with one adapter beside the base), the adapter unmerged and merged; under overlap on and off, page
sizes 1 and 16, chunked prefill and fewer device slots than adapters (least recently used out). Seeded
sampling is batch-invariant across adapters, and the prefix cache never gives one adapter's KV to another."""

from __future__ import annotations

import pytest
import torch

from gapless import LLM, LoRARequest, SamplingParams
from gapless.testing.hf_reference import check_greedy, hf_greedy, make_prompts
from gapless.testing.lora import ATTENTION, MLP, make_adapter, peft_model

pytest.importorskip("peft", reason="the reference is transformers + peft")

MAX_NEW = 8
# three adapters: every module at rank 8; q/v at rank 4 with rslora; o/gate/down at rank 16
ADAPTERS = {
    "all": dict(targets=ATTENTION + MLP, r=8, alpha=16, seed=1),
    "qv": dict(targets=["q_proj", "v_proj"], r=4, alpha=8, seed=2, rslora=True),
    "odown": dict(targets=["o_proj", "gate_proj", "down_proj"], r=16, alpha=16, seed=3),
}
NAMES = [None, "all", "qv", "odown"]


@pytest.fixture(scope="module")
def family(ckpt_factory, tmp_path_factory):
    """`get(arch)`: (base path, its adapters' LoRARequests, prompts, {adapter or None: greedy refs}),
    made once per family."""
    made: dict[str, tuple] = {}

    def get(arch: str) -> tuple:
        if arch not in made:
            base = ckpt_factory(arch)
            out = tmp_path_factory.mktemp(f"{arch}-loras")
            loras = {
                name: LoRARequest(name, i + 1, str(make_adapter(base, out / name, **kw)))
                for i, (name, kw) in enumerate(ADAPTERS.items())
            }
            prompts = make_prompts(500, n=8, shared_prefix=12, max_len=40)
            refs = {}
            for name in NAMES:
                model = peft_model(base, loras[name].lora_path if name else None)
                refs[name] = [hf_greedy(model, p, MAX_NEW) for p in prompts]
            made[arch] = (base, loras, prompts, refs)
        return made[arch]

    return get


def _generate(llm: LLM, prompts, loras, names, **sp):
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, **sp)
    return llm.generate(
        prompts, params, use_tqdm=False, lora_request=[loras[n] if n else None for n in names]
    )


def _check(outs, refs, names) -> None:
    for i, (out, name) in enumerate(zip(outs, names)):
        check_greedy(out.token_ids, refs[name][i])


def _names(n: int) -> list[str | None]:
    return [NAMES[i % len(NAMES)] for i in range(n)]


# the device process for one family: the adapters' loads travel to it with the batches; for another the
# padded decode-graph path and the prefill pieces, run eagerly on the CPU
WORKERS = {"llama": {"cpu_worker": "process"}, "qwen3": {"cuda_graph_max_bs": 8}, "phi3": {}}


# (llama's, on a CPU worker process, ~10 s: the slow tier)
@pytest.mark.parametrize(
    "arch", [pytest.param(a, marks=pytest.mark.slow) if a == "llama" else a for a in WORKERS]
)
def test_mixed_adapters_equal_peft(family, arch):
    """Every row of a batch of three adapters and the base equals PEFT's unmerged forward of its own."""
    base, loras, prompts, refs = family(arch)
    options = dict(device="cpu", dtype="float32", enable_lora=True, kv_cache_tokens=4096)
    with LLM(str(base), **WORKERS[arch], **options) as llm:
        names = _names(len(prompts))
        _check(_generate(llm, prompts, loras, names), refs, names)
        llm.check_integrity()


LOOPS = {"plain": {"overlap": False}, "overlap": {"overlap": True, "cpu_worker": "thread"}}
# a KV pool too small for the workload, and admission that reserves almost nothing: decode retracts
RETRACT = {"kv_cache_tokens": 80, "init_new_token_ratio": 0.02, "min_new_token_ratio": 0.02}


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("page_size", [1, 16])
def test_options_and_slot_reuse(family, loop, page_size):
    """Overlap on and off, page sizes 1 and 16, prefill in chunks of 16, two device slots for three
    adapters (rows wait for a slot, slots are reloaded) and, at page size 1, retraction: every row still
    equals PEFT."""
    base, loras, prompts, refs = family("llama")
    memory = RETRACT if page_size == 1 else {"kv_cache_tokens": 4096}
    with LLM(
        str(base),
        device="cpu",
        dtype="float32",
        enable_lora=True,
        max_loras=2,
        page_size=page_size,
        chunked_prefill_size=16,
        **memory,
        **LOOPS[loop],
    ) as llm:
        names = _names(len(prompts))[::-1]
        _check(_generate(llm, prompts, loras, names), refs, names)
        llm.check_integrity()
        assert (llm.engine.stats.retractions > 0) == (memory is RETRACT)
        table = llm.engine.runner.lora
        assert table.loads >= 3 and len(table.resident) == 2  # three adapters through two slots


def test_merged_adapter_equals(family):
    """The adapter merged into the weights (PEFT's merge_and_unload) gives the same tokens as gapless."""
    base, loras, prompts, _ = family("llama")
    merged = peft_model(base, loras["all"].lora_path, merged=True)
    with LLM(str(base), device="cpu", dtype="float32", enable_lora=True, kv_cache_tokens=4096) as llm:
        outs = _generate(llm, prompts[:3], loras, ["all"] * 3)
    for out, p in zip(outs, prompts):
        check_greedy(out.token_ids, hf_greedy(merged, p, MAX_NEW))


def test_seeded_sampling_is_batch_invariant(family):
    """A seeded request of one adapter samples the same tokens alone and among rows of other adapters."""
    base, loras, prompts, _ = family("llama")
    params = SamplingParams(max_tokens=MAX_NEW, temperature=1.0, seed=7, ignore_eos=True)
    with LLM(str(base), device="cpu", dtype="float32", enable_lora=True, kv_cache_tokens=4096) as llm:
        alone = llm.generate([prompts[1]], params, use_tqdm=False, lora_request=loras["qv"])[0].token_ids
        names = ["all", "qv", None, "odown"]
        batch = [prompts[0], prompts[1], prompts[2], prompts[3]]
        mixed = llm.generate(
            batch, params, use_tqdm=False, lora_request=[loras[n] if n else None for n in names]
        )
        base_row = llm.generate([prompts[1]], params, use_tqdm=False)[0].token_ids
    assert mixed[1].token_ids == alone
    assert base_row != alone, "the adapter was meant to change the sampled tokens"


def test_prefix_cache_is_per_adapter(family):
    """A prompt cached under one adapter is recomputed under another (its KV differs), and reused under
    the same adapter again; each output equals PEFT's."""
    base, loras, prompts, refs = family("llama")
    p = prompts[0]
    with LLM(str(base), device="cpu", dtype="float32", enable_lora=True, kv_cache_tokens=4096) as llm:
        first = _generate(llm, [p], loras, ["all"])[0]
        other = _generate(llm, [p], loras, ["qv"])[0]
        base_run = _generate(llm, [p], loras, [None])[0]
        again = _generate(llm, [p], loras, ["all"])[0]
        llm.check_integrity()
    assert first.cached_tokens == 0 and other.cached_tokens == 0 and base_run.cached_tokens == 0
    assert again.cached_tokens > 0
    for out, name in ((first, "all"), (other, "qv"), (base_run, None), (again, "all")):
        check_greedy(out.token_ids, refs[name][0])


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA graphs and the Triton LoRA kernels need a GPU"
)
def test_cuda_graphs_and_kernels(family):
    """On a GPU: decode CUDA graphs replay the gathered kernels with the slot vector as a static buffer;
    every row of three adapters and the base still equals PEFT (fp32)."""
    base, loras, prompts, refs = family("llama")
    with LLM(str(base), device="cuda", dtype="float32", enable_lora=True, kv_cache_tokens=4096) as llm:
        assert llm.engine.runner is None or llm.engine.runner.graphs is not None
        names = _names(len(prompts))
        _check(_generate(llm, prompts, loras, names), refs, names)
        llm.check_integrity()


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_mixture_of_experts_peft_adapter(ckpt_factory, tmp_path, arch):
    """On a mixture of experts, PEFT's own adapter of every projection (on transformers 5 its MLP targets
    become the stacked experts, gate and up one `gate_up_proj` of twice the rank through rank_pattern and
    alpha_pattern), beside the base."""
    base = ckpt_factory(arch)
    lora = LoRARequest("all", 1, str(make_adapter(base, tmp_path / "all", ATTENTION + MLP, r=8, seed=5)))
    prompts = make_prompts(500, n=2, shared_prefix=4, max_len=20)
    refs = [hf_greedy(peft_model(base, lora.lora_path), p, MAX_NEW) for p in prompts]
    refs.append(hf_greedy(peft_model(base, None), prompts[0], MAX_NEW))
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    with LLM(str(base), device="cpu", dtype="float32", enable_lora=True, kv_cache_tokens=1024) as llm:
        outs = llm.generate([*prompts, prompts[0]], params, use_tqdm=False, lora_request=[lora, lora, None])
    for out, ref in zip(outs, refs):
        check_greedy(out.token_ids, ref)


# the families the tests above leave out; a mixture's MLP targets are its stacked experts (Qwen2-MoE's
# shared expert is a dense MLP those names would match too: its experts through target_parameters)
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
OTHER_FAMILIES = {
    "qwen2": (ATTENTION + MLP, None),
    "mistral": (ATTENTION + MLP, None),
    "olmo2": (ATTENTION + MLP, None),
    "granite": (ATTENTION + MLP, None),
    "gemma2": (ATTENTION + MLP, None),
    "gemma3_text": (ATTENTION + MLP, None),
    "qwen2_moe": (ATTENTION, EXPERT_PARAMETERS),
    "olmoe": (ATTENTION + MLP, None),
}


@pytest.mark.parametrize("arch", list(OTHER_FAMILIES))
def test_every_other_family(ckpt_factory, tmp_path, arch):
    """Every other family gapless serves: an adapter of its attention and MLP beside the base in one batch
    equals PEFT's unmerged forward, row by row."""
    base = ckpt_factory(arch)
    targets, parameters = OTHER_FAMILIES[arch]
    adapter = make_adapter(base, tmp_path / "a", targets, r=8, seed=11, parameters=parameters)
    lora = LoRARequest("a", 1, str(adapter))
    prompts = make_prompts(500, n=3, shared_prefix=4, max_len=24)
    names: list[str | None] = ["a", None, "a"]
    adapted, plain = peft_model(base, adapter), peft_model(base, None)
    refs = [hf_greedy(adapted if n else plain, p, MAX_NEW) for p, n in zip(prompts, names)]
    assert refs[0].tokens != hf_greedy(plain, prompts[0], MAX_NEW).tokens, "an adapter that changes nothing"
    with LLM(str(base), device="cpu", dtype="float32", enable_lora=True, kv_cache_tokens=1024) as llm:
        outs = _generate(llm, prompts, {"a": lora}, names)
        llm.check_integrity()
    for out, ref in zip(outs, refs):
        check_greedy(out.token_ids, ref)
