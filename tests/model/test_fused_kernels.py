"""The fused Triton kernels (`gapless.model.fused`) against their torch reference, the model code itself.

Without a GPU they run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET before
anything imports Triton), so shapes are tiny: odd hidden sizes, head dims that are no power of two,
empty and ragged batches, fp32/bf16/fp16, every RMSNorm arithmetic, Llama 3 RoPE scaling. Then whole
models with the kernels forced on give the same greedy tokens as with torch, and as transformers.
"""

from __future__ import annotations

import dataclasses
import logging
import types

import pytest
import torch

from gapless import LLM, SamplingParams
from gapless.model.layers import GATED_ACTIVATIONS, RotaryEmbedding, make_rms_norm
from gapless.testing.hf_reference import check_greedy, hf_greedy, load_hf_model
from gapless.testing.triton import import_kernels_or_skip

fk = import_kernels_or_skip("gapless.model.fused.triton_kernels")

from gapless.model import fused  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# one rounding step of the dtype (the kernels round where torch rounds; only the fp32 sum's order and
# rsqrt may differ), with room
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
LLAMA3 = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=32,
)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    if not want.numel():
        return
    scale = want.float().abs().max().clamp_min(1e-6)
    err = float((got.float() - want.float()).abs().max() / scale)
    assert err <= TOL[dtype], f"relative error {err:.2e}"


def _rand(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["llama", "fp32", "gemma"])
@pytest.mark.parametrize("rows", [0, 5])
@torch.inference_mode()
def test_rms_norm_with_and_without_residual(dtype, kind, rows):
    hidden = 37
    norm = make_rms_norm(hidden, 1e-5, kind).to(device=DEVICE, dtype=dtype)
    norm.weight.data = _rand(hidden, dtype=dtype, seed=1)
    x, residual = _rand(rows, hidden, dtype=dtype, seed=2), _rand(rows, hidden, dtype=dtype, seed=3)
    _close(fk.rms_norm(x, norm.weight, norm.eps, kind), norm(x), dtype)
    got, got_res = fk.rms_norm(x, norm.weight, norm.eps, kind, residual)
    want, want_res = norm(x, residual)
    assert torch.equal(got_res, want_res), "the residual sum is one rounding of x + residual, as in torch"
    _close(got, want, dtype)


@torch.inference_mode()
def test_rms_norm_keeps_non_finite_values_where_torch_has_them():
    """The weight's load is tied to the sum of squares (`_with_early`) without changing it: an inf or NaN
    weight spoils its own column alone, a NaN in x its whole row, as in torch."""
    norm = make_rms_norm(37, 1e-5, "llama").to(device=DEVICE)
    norm.weight.data = _rand(37, dtype=torch.float32, seed=1)
    norm.weight.data[[3, 9]] = torch.tensor([float("inf"), float("nan")], device=DEVICE)
    x = _rand(2, 37, dtype=torch.float32, seed=2)
    x[1, 5] = float("nan")
    got, want = fk.rms_norm(x, norm.weight, norm.eps, "llama"), norm(x)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    assert got[1].isnan().all() and got[0].isfinite().sum() == 35
    _close(got[0].nan_to_num(0, 0, 0), want[0].nan_to_num(0, 0, 0), torch.float32)


def _rope_store_reference(rope, positions, q, k, v, k_cache, v_cache, slots, norms):
    if norms is not None:
        q, k = norms[0](q), norms[1](k)
    q, k = rope(positions, q, k)
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))
    return q


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("head_dim", "norm_kind", "scaling"), [(12, None, LLAMA3), (16, "llama", None), (6, "gemma", None)]
)
@pytest.mark.parametrize("tokens", [0, 4])
@torch.inference_mode()
def test_qk_norm_rope_store(dtype, head_dim, norm_kind, scaling, tokens):
    heads, kv_heads, slots_n = 3, 1, 9
    rope = RotaryEmbedding(head_dim, 64, 10000.0, scaling).to(DEVICE)
    qkv = _rand(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=4)
    q, k, v = (
        t.view(tokens, t.shape[-1] // head_dim, head_dim)
        for t in qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    )
    positions = torch.tensor([0, 7, 31, 63][:tokens], dtype=torch.int64, device=DEVICE)
    slots = torch.tensor([5, 1, 8, 2][:tokens], dtype=torch.int64, device=DEVICE)
    norms = None
    if norm_kind is not None:
        norms = [make_rms_norm(head_dim, 1e-6, norm_kind).to(device=DEVICE, dtype=dtype) for _ in range(2)]
        for i, n in enumerate(norms):
            n.weight.data = _rand(head_dim, dtype=dtype, seed=5 + i)
    caches = [torch.zeros(slots_n, kv_heads, head_dim, dtype=dtype, device=DEVICE) for _ in range(4)]
    want = _rope_store_reference(rope, positions, q, k, v, caches[0], caches[1], slots, norms)
    norm = None if norms is None else (norms[0].weight, norms[1].weight, norms[0].eps, norm_kind)
    got = fk.qk_norm_rope_store(positions, q, k, v, rope.cos_sin, caches[2], caches[3], slots, norm)
    _close(got, want, dtype)
    _close(caches[2], caches[0], dtype)
    assert torch.equal(caches[3], caches[1]), "v is copied as it is"


@pytest.mark.parametrize("kv", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", DTYPES)
@torch.inference_mode()
def test_qk_norm_rope_store_into_fp8_cache(dtype, kv):
    """Into an fp8 cache (e4m3 or e5m2) the kernel stores, bit for bit, `KVPool.store`'s quantization of
    what it stores into a cache of the model's dtype: k / k_scale and v / v_scale in fp32, saturated at the
    type's largest value (the small scales here saturate some), rounded to nearest even (the large ones
    take some values to subnormals and zero)."""
    from gapless.memory.kv_pool import E5M2, FP8, fp8_max, quantize_fp8

    fp8_type = FP8 if kv == "e4m3" else E5M2
    tokens, heads, kv_heads, head_dim, slots_n = 5, 4, 2, 16, 11
    rope = RotaryEmbedding(head_dim, 64, 10000.0, None).to(DEVICE)
    q, k, v = (
        _rand(tokens, n, head_dim, dtype=dtype, seed=9 + i) for i, n in enumerate((heads, kv_heads, kv_heads))
    )
    positions = torch.tensor([0, 3, 9, 40, 63], device=DEVICE)
    slots = torch.tensor([2, 7, 1, 10, 4], device=DEVICE)
    norms = [make_rms_norm(head_dim, 1e-6, "llama").to(device=DEVICE, dtype=dtype) for _ in range(2)]
    norm = (norms[0].weight, norms[1].weight, norms[0].eps, "llama")
    plain = [torch.zeros(slots_n, kv_heads, head_dim, dtype=dtype, device=DEVICE) for _ in range(2)]
    q_plain = fk.qk_norm_rope_store(positions, q, k, v, rope.cos_sin, *plain, slots, norm)
    top, tiny = fp8_max(fp8_type), torch.finfo(fp8_type).smallest_normal
    small, large = ((0.004, 0.0031), (60.0, 47.0)) if kv == "e4m3" else ((3e-5, 2.3e-5), (7e3, 5.1e3))
    for k_scale, v_scale in (small, large):
        fp8 = [torch.zeros(slots_n, kv_heads, head_dim, dtype=fp8_type, device=DEVICE) for _ in range(2)]
        scales = torch.tensor([k_scale], device=DEVICE), torch.tensor([v_scale], device=DEVICE)
        q_fp8 = fk.qk_norm_rope_store(positions, q, k, v, rope.cos_sin, *fp8, slots, norm, *scales)
        assert torch.equal(q_fp8, q_plain)
        for got, want, scale in zip(fp8, plain, scales):
            assert torch.equal(got.view(torch.uint8), quantize_fp8(want, scale, fp8_type).view(torch.uint8))
            stored = got[slots].float().abs()
            if scale < 1:
                assert (stored == top).any(), "some values saturate"
            else:
                assert ((stored > 0) & (stored < tiny)).any(), "some values are subnormal"
    with pytest.raises(ValueError, match="needs its k_scale and v_scale"):
        fk.qk_norm_rope_store(positions, q, k, v, rope.cos_sin, *fp8, slots, norm)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize(("rows", "n"), [(0, 37), (3, 37), (2, 1030)])
def test_act_and_mul(dtype, act, rows, n):
    x = _rand(rows, 2 * n, dtype=dtype, seed=6) * 3
    _close(fk.act_and_mul(x, act), GATED_ACTIVATIONS[act](x), dtype)


# qwen3: per-head q/k norm (Llama's arithmetic), SiLU, pre-norms; gemma3_text: per-head Gemma norms, GeGLU,
# norms on both sides of each sublayer, two RoPE tables, decoding through the graph runner's padded static
# buffers (padded rows store into the padding slot, as with torch)
@pytest.mark.parametrize(
    ("arch", "graph_bs"),
    [("qwen3", 0), pytest.param("gemma3_text", 4, marks=pytest.mark.slow)],  # (~9 s)
)
def test_model_greedy_same_with_fused_kernels(ckpt_factory, arch, graph_bs):
    path = ckpt_factory(arch)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [9, 8, 7, 6]]  # three: a graph bucket of 4, one padded row
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=4, temperature=0.9, top_k=20, seed=3, ignore_eos=True)
    hf = load_hf_model(path)
    refs = [hf_greedy(hf, p, 4) for p in prompts]
    tokens = {}
    for kernels in ("torch", "triton"):
        with LLM(
            str(path),
            device=DEVICE,
            dtype="float32",
            attention_backend="torch",
            fused_kernels=kernels,
            kv_cache_tokens=64,
            overlap=False,
            cuda_graph_max_bs=graph_bs,
        ) as llm:
            assert llm.engine.runner.fused_kernels == kernels
            # the sampler's seeded draw follows the same choice (`gapless.sampling.fused`)
            assert (llm.engine.runner.sampler.draw_kernel is not None) == (kernels == "triton")
            tokens[kernels] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            drawn = llm.generate(prompts[:1] * 2, [sampled, dataclasses.replace(sampled, top_k=-1)], False)
            tokens[kernels + " sampled"] = [o.token_ids for o in drawn]
            graphs = llm.engine.runner.graphs
            assert not graph_bs or (graphs is not None and graphs.padded_rows > 0)
            llm.check_integrity()
    assert tokens["triton"] == tokens["torch"]
    assert tokens["triton sampled"] == tokens["torch sampled"]
    for ours, ref in zip(tokens["triton"], refs):
        check_greedy(ours, ref)


def test_start_up_check_falls_back_to_torch_with_reason(ckpt_factory, caplog):
    from gapless.model.loader import load_model

    model = load_model(ckpt_factory("qwen3"), torch.float32, torch.device(DEVICE))
    assert fused.disagreement(model, fk, torch.device(DEVICE)) is None
    assert fused.checked(model, fk, torch.device(DEVICE)) == "triton"
    assert model.model.norm.fused is fk and model.model.layers[0].mlp.fused is fk

    broken = types.SimpleNamespace(**{n: getattr(fk, n) for n in fk.__all__})
    broken.act_and_mul = lambda x, act: fk.act_and_mul(x, act) + 1.0
    with caplog.at_level(logging.WARNING, logger="gapless.model.fused"):
        assert fused.checked(model, broken, torch.device(DEVICE)) == "torch"
    assert "act_and_mul: relative error" in caplog.text
    assert model.model.norm.fused is None and model.model.layers[0].self_attn.fused is None

    broken.rms_norm = lambda *a: 1 / 0
    assert "rms_norm failed: ZeroDivisionError" in fused.disagreement(model, broken, torch.device(DEVICE))


def test_start_up_check_covers_the_store_into_an_fp8_cache(ckpt_factory):
    """With an fp8 KV cache the start-up check compares the store into one (scales not 1): the kernels
    pass it, into e4m3 and e5m2, and a store that forgets the scales does not."""
    from gapless.memory.kv_pool import E5M2, FP8
    from gapless.model.loader import load_model

    model = load_model(ckpt_factory("qwen3"), torch.bfloat16, torch.device(DEVICE))
    assert fused.disagreement(model, fk, torch.device(DEVICE), FP8) is None
    assert fused.disagreement(model, fk, torch.device(DEVICE), E5M2) is None
    broken = types.SimpleNamespace(**{n: getattr(fk, n) for n in fk.__all__})
    # the scales read as 1.0 (the decoder passes them after the norm: positional arguments 9 and 10)
    broken.qk_norm_rope_store = lambda *a: fk.qk_norm_rope_store(*a[:9], *map(torch.ones_like, a[9:]))
    why = fused.disagreement(model, broken, torch.device(DEVICE), FP8)
    assert why is not None and why.startswith("qk_norm_rope_store: relative error"), why


def test_bad_choice_is_refused(ckpt_factory):
    with pytest.raises(ValueError, match="fused_kernels='fast': must be one of"):
        LLM(str(ckpt_factory("qwen3")), device="cpu", fused_kernels="fast", kv_cache_tokens=64)
