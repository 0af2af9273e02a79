"""The mixture-of-experts MLP: transformers' routing, the fused Triton path (under the interpreter on the
CPU) against the per-expert reference loop, and the per-expert checkpoint layout. Greedy parity and
teacher-forced logits of the MoE families against transformers are in tests/engine/test_parity.py and
test_logits.py (they run the reference loop, the CPU's path); the last test here runs a model end to end
on the fused path."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gapless import LLM, SamplingParams
from gapless.model.moe import Experts, reference_experts, route
from gapless.testing.hf_reference import check_greedy, hf_greedy, load_hf_model, make_prompts

# the Triton path runs on the GPU where there is one, else under the interpreter on the CPU
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize(
    ("hf_router", "renormalize", "fp32_weights"),
    [
        ("qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter", True, False),
        ("qwen2_moe.modeling_qwen2_moe.Qwen2MoeTopKRouter", False, False),
        ("olmoe.modeling_olmoe.OlmoeTopKRouter", False, False),
        ("mixtral.modeling_mixtral.MixtralTopKRouter", True, True),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routing_is_transformers_own(hf_router: str, renormalize: bool, fp32_weights: bool, dtype) -> None:
    """Same experts and bit-identical weights (dtype included: Mixtral keeps them in fp32) as each
    family's router in transformers."""
    from types import SimpleNamespace

    module, name = hf_router.rsplit(".", 1)
    router_class = getattr(importlib.import_module(f"transformers.models.{module}"), name)
    config = SimpleNamespace(
        num_experts_per_tok=3, num_experts=8, num_local_experts=8, norm_topk_prob=renormalize, hidden_size=32
    )
    hf = router_class(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(8, 32, generator=g))
    hf = hf.to(dtype)
    x = torch.randn(11, 32, generator=g).to(dtype)
    with torch.no_grad():
        logits, hf_weights, hf_ids = hf(x)
    weights, ids = route(logits, 3, renormalize, fp32_weights)
    assert torch.equal(ids, hf_ids)
    assert weights.dtype == hf_weights.dtype and torch.equal(weights, hf_weights)


@pytest.mark.parametrize(("tokens", "hidden", "inter"), [(1, 48, 40), (37, 64, 32)])
def test_fused_experts_match_the_reference_loop(tokens: int, hidden: int, inter: int) -> None:
    """The sorted, grouped-GEMM Triton path (interpreted on the CPU) equals the per-expert loop in fp32:
    a decode-sized batch (most experts get no token) and a prefill-sized one (an expert gets more entries
    than one block), widths that are not powers of two."""
    from gapless.model.moe_triton import align, fused_experts

    experts, top_k = 8, 2
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    logits = torch.randn(tokens, experts, generator=g) * 3
    weights, ids = route(logits, top_k, renormalize=False, fp32_weights=False)
    x, w13, w2, weights, ids = (t.to(DEVICE) for t in (x, w13, w2, weights, ids))
    ours = fused_experts(x, w13, w2, weights, ids)
    tol = 1e-5 if DEVICE.type == "cpu" else 1e-4  # (a GPU's dots sum in another order)
    torch.testing.assert_close(ours, reference_experts(x, w13, w2, weights, ids), atol=tol, rtol=tol)

    sorted_ids, block_expert, padded = align(ids, experts, 16)
    flat = ids.reshape(-1)
    used = sorted_ids[: int(padded)].view(-1, 16)
    for block, expert in zip(used, block_expert[: used.shape[0]].tolist()):
        real = block[block < flat.numel()]
        assert real.numel() > 0 and (flat[real] == expert).all()  # one expert per block, none empty
    assert sorted(sorted_ids[sorted_ids < flat.numel()].tolist()) == list(range(flat.numel()))


@pytest.mark.parametrize(("tokens", "top_k", "experts"), [(1, 8, 128), (3, 2, 4), (8, 8, 64), (5, 4, 60)])
def test_the_align_kernel_gives_the_torch_ops_result(monkeypatch, tokens, top_k, experts) -> None:
    """Up to `ALIGN_KERNEL_ENTRIES` entries `align` is one kernel (`_align_kernel`): the same sorted
    entries (stable by expert, runs padded with the sentinel), blocks' experts and padded length as the
    torch ops', bit for bit, for a decode's token and batches whose experts take several entries each
    (repeated ids), more experts than entries and fewer; at blocks of 16 and 4."""
    pytest.importorskip("triton", reason="the fused MoE path is Triton")
    from gapless.model import moe_triton

    g = torch.Generator().manual_seed(tokens * experts)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).to(DEVICE)
    if tokens > 1:
        ids[1] = ids[0]  # (two tokens on the same experts)
    for block_m in (16, 4):
        fused = moe_triton.align(ids, experts, block_m)
        with monkeypatch.context() as torch_ops:
            torch_ops.setattr(moe_triton, "ALIGN_KERNEL_ENTRIES", 0)
            want = moe_triton.align(ids, experts, block_m)
        for got, ref in zip(fused, want, strict=True):
            assert got.dtype == ref.dtype and torch.equal(got, ref), (block_m, got, ref)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> Path:
    from gapless.testing import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("mixtral"), "mixtral")


def test_experts_load_from_the_per_expert_layout(
    mixtral: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mixtral's `block_sparse_moe.experts.<e>.w1/w3/w2` land in expert e's gate, up and down slices (the
    Qwen/OLMoE names, `mlp.experts.<e>.gate_proj` ..., are in the parity tests); a checkpoint missing one
    expert's tensor is refused, naming it."""
    from gapless.model.cpu_gemm import ENV
    from gapless.model.loader import load_model

    monkeypatch.setenv(ENV, "plain")  # the loaded weights themselves, not their CPU-packed copies
    weights = load_file(str(mixtral / "model.safetensors"))
    model = load_model(mixtral, torch.float32, torch.device("cpu"))
    moe = model.model.layers[1].mlp
    assert isinstance(moe.experts, Experts)
    prefix = "model.layers.1.block_sparse_moe"
    inter = moe.experts.inter
    assert torch.equal(moe.experts.gate_up_proj[5, :inter], weights[f"{prefix}.experts.5.w1.weight"])
    assert torch.equal(moe.experts.gate_up_proj[5, inter:], weights[f"{prefix}.experts.5.w3.weight"])
    assert torch.equal(moe.experts.down_proj[5], weights[f"{prefix}.experts.5.w2.weight"])
    assert torch.equal(moe.gate.weight, weights[f"{prefix}.gate.weight"])

    bad = tmp_path / "bad"
    bad.mkdir()
    for f in mixtral.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            (bad / f.name).write_bytes(f.read_bytes())
    del weights[f"{prefix}.experts.6.w3.weight"]
    save_file(weights, str(bad / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"lacks weights: model\.layers\.1\.mlp\.experts\.gate_up_proj#\(6, 'up'\)"
    ):
        load_model(bad, torch.float32, torch.device("cpu"))


def test_a_model_on_the_fused_path_decodes_as_transformers(ckpt_factory) -> None:
    """The engine with every MoE layer on the Triton path (interpreted): greedy tokens equal
    transformers', through a chunked prefill and decode, with Qwen2-MoE's shared expert beside it."""
    path = ckpt_factory("qwen2_moe")
    hf = load_hf_model(path)
    prompts = make_prompts(hf.config.vocab_size, n=2, seed=5, shared_prefix=10, max_len=40)
    with LLM(
        str(path),
        device=DEVICE.type,
        dtype="float32",
        kv_cache_tokens=1024,
        overlap=False,
        chunked_prefill_size=16,
    ) as llm:
        for module in llm.engine.runner.model.modules():
            if isinstance(module, Experts):
                module.use_triton = True
        outs = llm.generate(
            prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False
        )
        llm.check_integrity()
    for prompt, out in zip(prompts, outs):
        assert check_greedy(out.token_ids, hf_greedy(hf, prompt, 4)) is None
