"""LoRA on a mixture of experts (Qwen3-MoE, Mixtral): adapters of the stacked experts (PEFT's
`target_parameters` on transformers 5's `mlp.experts.gate_up_proj` / `down_proj`) and of attention, mixed
with the base model in one batch, give `transformers` + `peft`'s greedy tokens, overlap on and off; an
adapter written one module per expert (transformers 4's names) reads as the same weights; the fused
Triton experts with LoRA (under the interpreter here) equal the per-expert torch path; what gapless does
not adapt is refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gapless import LLM, LoRARequest, SamplingParams
from gapless.lora.adapter import LoRAError, load_adapter
from gapless.model.config import load_model_config
from gapless.testing.hf_reference import check_greedy, hf_greedy, make_prompts
from gapless.testing.lora import make_adapter, peft_model

pytest.importorskip("peft", reason="the reference is transformers + peft")

MAX_NEW = 8
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
NAMES = [None, "experts", "down", "experts"]
PARAMS = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe(request, ckpt_factory, tmp_path_factory):
    """(base, LoRARequests, prompts, PEFT's greedy reference of each row)."""
    base = ckpt_factory(request.param)
    out = tmp_path_factory.mktemp(f"{request.param}-moe-loras")
    loras = {
        "experts": make_adapter(base, out / "experts", ["q_proj", "v_proj"], r=8, seed=1, parameters=EXPERTS),
        "down": make_adapter(base, out / "down", ["o_proj"], r=4, seed=2, parameters=EXPERTS[1:]),
    }
    requests = {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(loras.items())}
    prompts = make_prompts(500, n=len(NAMES), shared_prefix=4, max_len=20)
    models = {n: peft_model(base, loras[n] if n else None) for n in set(NAMES)}
    refs = [hf_greedy(models[n], p, MAX_NEW) for p, n in zip(prompts, NAMES)]
    plain = [hf_greedy(models[None], p, MAX_NEW) for p in prompts]
    assert all(r.tokens != b.tokens for r, b, n in zip(refs, plain, NAMES) if n), (
        "adapters that change nothing"
    )
    return base, requests, prompts, refs


def _generate(base, requests, prompts, names, **options) -> list[list[int]]:
    engine = dict(device="cpu", dtype="float32", enable_lora=True, kv_cache_tokens=1024, **options)
    with LLM(str(base), **engine) as llm:
        loras = [requests[n] if n else None for n in names]
        outs = llm.generate(prompts, PARAMS, use_tqdm=False, lora_request=loras)
        llm.check_integrity()
    return [o.token_ids for o in outs]


@pytest.mark.parametrize(
    "options",
    [
        pytest.param(dict(overlap=True, cpu_worker="thread", page_size=1), id="overlap-page1"),
        pytest.param(dict(overlap=False, page_size=16, chunked_prefill_size=8), id="plain-page16-chunk8"),
    ],
)
def test_experts_adapters_equal_peft(moe, options):
    """Two adapters of the experts (one with attention too, one of down only) and the base, one batch."""
    base, requests, prompts, refs = moe
    for ours, ref in zip(_generate(base, requests, prompts, NAMES, **options), refs):
        check_greedy(ours, ref)


def _per_expert(stacked, out, arch: str, cfg) -> str:
    """The stacked adapter written one module per expert, as transformers 4 named them: expert e's gate
    and up each with A_e and their rows of B_e, its down with A_e and B_e (the same weights)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(stacked, out)
    conf = json.loads((out / "adapter_config.json").read_text())
    r, e, inter = conf["r"], cfg.num_experts, cfg.moe_intermediate_size
    names = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    mlp = "block_sparse_moe" if arch == "mixtral" else "mlp"
    tensors = {}
    for key, t in load_file(str(out / "adapter_model.safetensors")).items():
        if ".experts." not in key:
            tensors[key] = t
            continue
        prefix = key[: key.index(".mlp.experts.")]
        param = "gate_up_proj" if "base_layer." in key else "down_proj"  # (gate_up listed first)
        if key.endswith("lora_B.weight"):
            continue
        a = t.view(e, r, -1)
        b = load_file(str(out / "adapter_model.safetensors"))[key.replace("lora_A", "lora_B")]
        b = b.view(b.shape[0], r, e).permute(2, 0, 1)  # [E, out, r]
        parts = (
            [(names[0], b[:, :inter]), (names[1], b[:, inter:])]
            if param == "gate_up_proj"
            else [(names[2], b)]
        )
        for x in range(e):
            for name, bx in parts:
                tensors[f"{prefix}.{mlp}.experts.{x}.{name}.lora_A.weight"] = a[x].clone()
                tensors[f"{prefix}.{mlp}.experts.{x}.{name}.lora_B.weight"] = bx[x].clone()
    save_file(tensors, str(out / "adapter_model.safetensors"))
    conf.update(target_parameters=None, target_modules=[*conf["target_modules"], *names])
    (out / "adapter_config.json").write_text(json.dumps(conf))
    return str(out)


def test_one_module_per_expert_reads_as_the_stacked_adapter(moe, tmp_path):
    """transformers 4's layout (Qwen's `mlp.experts.3.gate_proj`, Mixtral's `block_sparse_moe.experts.3.w1`)
    of the same weights: the same tokens, PEFT's."""
    base, requests, prompts, refs = moe
    cfg = load_model_config(base)
    arch = "mixtral" if "mixtral" in str(base) else "qwen3_moe"
    path = _per_expert(requests["experts"].lora_path, tmp_path / "per-expert", arch, cfg)
    got, want = load_adapter("x", path, cfg, 64), load_adapter("x", requests["experts"].lora_path, cfg, 64)
    moe_layers = [i for i in range(cfg.num_layers) if cfg.moe_layers[i]]
    assert {(x.layer, x.name, x.block) for x in got.experts} == {
        (layer, name, block)
        for layer in moe_layers
        for name, block in (("gate_up_proj", 0), ("gate_up_proj", 1), ("down_proj", 0))
    }
    assert {(x.layer, x.name, x.block) for x in want.experts} == {
        (layer, name, 0) for layer in moe_layers for name in ("gate_up_proj", "down_proj")
    }
    per = dict(requests, experts=LoRARequest("experts", 1, path))
    for ours, ref, name in zip(_generate(base, per, prompts, NAMES, overlap=False), refs, NAMES):
        if name != "down":
            check_greedy(ours, ref)


@pytest.mark.parametrize("tokens", [5, 40])
@pytest.mark.parametrize("fp8", [False, True])
def test_fused_experts_with_lora_equal_the_torch_path(tokens, fp8):
    """The fused Triton experts with adapters (the interpreter's run; on CUDA the kernels') equal the
    per-expert torch path with them, rows of two adapters and the base; and the adapters change them.
    fp8: the experts in e4m3 a row (W8A8: the base's inputs rounded to e4m3, the deltas' not)."""
    from gapless.lora import triton_kernels
    from gapless.lora.table import ExpertLoRA
    from gapless.model.moe import reference_experts, route
    from gapless.model.moe_triton import fused_experts
    from gapless.model.quant.fp8 import activation_group, quantize_rows

    if not torch.cuda.is_available() and not triton_kernels.interpreted():
        pytest.skip("no GPU and TRITON_INTERPRET unset")
    dev = "cpu" if triton_kernels.interpreted() else "cuda"
    g = torch.Generator().manual_seed(tokens)
    e, h, inter, r, slots = 6, 32, 24, 8, 3
    x = torch.randn(tokens, h, generator=g)
    w13, w2 = torch.randn(e, 2 * inter, h, generator=g) * 0.2, torch.randn(e, h, inter, generator=g) * 0.2
    weights, ids = route(torch.randn(tokens, e, generator=g), 2, True, False)
    tables = {
        "gate_up_proj": (
            torch.randn(slots, e, r, h, generator=g) * 0.2,
            torch.randn(slots, e, 2 * inter, r, generator=g) * 0.2,
        ),
        "down_proj": (
            torch.randn(slots, e, r, inter, generator=g) * 0.2,
            torch.randn(slots, e, h, r, generator=g) * 0.2,
        ),
    }
    token_slots = torch.tensor([i % 4 - 1 for i in range(tokens)])  # -1 (base), 0, 1, 2, ...
    tables = {k: (a.to(dev), b.to(dev)) for k, (a, b) in tables.items()}
    fused = ExpertLoRA(SimpleNamespace(kernel=True, token_slots=token_slots.to(dev)), tables)
    torch_path = ExpertLoRA(SimpleNamespace(kernel=False, token_slots=token_slots, segments=object()), tables)
    held, scales, groups = (w13, w2), None, (0, 0)
    if fp8:  # (each expert row's scale; the reference multiplies by the dequantized rows)
        rounded = [quantize_rows(w.reshape(-1, w.shape[2])) for w in (w13, w2)]
        held = tuple((q.float() * s).view(w.shape) for (q, s), w in zip(rounded, (w13, w2)))
        w13, w2 = (q.view(w.shape) for (q, _), w in zip(rounded, (w13, w2)))
        scales = tuple((s.view(*w.shape[:2], 1).to(dev), w.shape[2]) for (_, s), w in zip(rounded, (w13, w2)))
        groups = (activation_group(h, 0), activation_group(inter, 0))
    got = fused_experts(x.to(dev), w13.to(dev), w2.to(dev), weights.to(dev), ids.to(dev), fused, scales).cpu()
    want = reference_experts(x, *held, weights, ids, torch_path, groups)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    plain = reference_experts(x, *held, weights, ids, act_groups=groups)
    base_rows = token_slots < 0
    torch.testing.assert_close(want[base_rows], plain[base_rows], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(want[~base_rows], plain[~base_rows], atol=1e-3)


def test_what_is_not_adapted_is_refused_by_name(ckpt_factory, tmp_path):
    """Qwen2-MoE's shared expert, `target_parameters` other than the experts' or on a dense model, an
    expert the model lacks, another model's expert shapes: each refused naming what is wrong."""
    from safetensors.torch import load_file, save_file

    base = ckpt_factory("qwen3_moe")
    cfg = load_model_config(base)
    good = make_adapter(base, tmp_path / "good", ["q_proj"], r=4, parameters=EXPERTS[1:])
    weights = load_file(str(good / "adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.0.mlp."

    def variant(name: str, extra: dict, **conf) -> str:
        out = tmp_path / name
        shutil.copytree(good, out)
        save_file({**weights, **extra}, str(out / "adapter_model.safetensors"))
        c = json.loads((out / "adapter_config.json").read_text())
        (out / "adapter_config.json").write_text(json.dumps({**c, **conf}))
        return str(out)

    ab = {"lora_A.weight": torch.zeros(4, cfg.hidden_size), "lora_B.weight": torch.zeros(8, 4)}
    cases = [
        (
            variant("shared", {f"{prefix}shared_expert.up_proj.{k}": t for k, t in ab.items()}),
            r"shared_expert.*Qwen2-MoE's shared expert is not supported",
        ),
        (
            variant("param", {}, target_parameters=["mlp.experts.router"]),
            r"target_parameters \['mlp.experts.router'\] are not supported",
        ),
        (
            variant("expert9", {f"{prefix}experts.{cfg.num_experts}.up_proj.{k}": t for k, t in ab.items()}),
            rf"adapts expert {cfg.num_experts}; the model has {cfg.num_experts}",
        ),
        (
            variant("shape", {f"{prefix}experts.lora_A.weight": torch.zeros(4 * cfg.num_experts, 7)}),
            r"layers\.0\.mlp\.experts has A \(\d+, 7\).*need gate_up_proj A.*another base model",
        ),
    ]
    for path, why in cases:
        with pytest.raises(LoRAError, match=why):
            load_adapter("bad", path, cfg, 64)
    dense = ckpt_factory("llama")
    with pytest.raises(LoRAError, match=r"target_parameters .* \(the model has no experts\)"):
        load_adapter("bad", variant("dense", {}), load_model_config(dense), 64)


def test_without_expert_slots_expert_adapters_are_refused(moe):
    """`lora_experts=False` (--no-lora-experts): no slots for the experts, an adapter of them refused by
    name before anything is queued, one of attention alone still served."""
    base, requests, prompts, refs = moe
    engine = dict(device="cpu", dtype="float32", enable_lora=True, kv_cache_tokens=1024, lora_experts=False)
    engine["cpu_worker"] = "inline"  # the runner in this process (auto: a device process on 4+ cores)
    attn = LoRARequest(
        "attn", 9, str(make_adapter(base, Path(requests["down"].lora_path).parent / "attn", ["q_proj"], r=4))
    )
    with LLM(str(base), **engine) as llm:
        assert llm.engine.runner.lora.experts == {}
        with pytest.raises(LoRAError, match=r"adapts the experts.*lora_experts off: --lora-experts"):
            llm.generate(prompts[:1], PARAMS, use_tqdm=False, lora_request=requests["experts"])
        plain = llm.generate(prompts[:1], PARAMS, use_tqdm=False)[0].token_ids
        assert llm.generate(prompts[:1], PARAMS, use_tqdm=False, lora_request=attn)[0].token_ids != plain
        llm.check_integrity()
