"""`--quantization rtn` (vLLM's and SGLang's): a float checkpoint rounded to int8 or int4 at load
(`gapless.model.quant.rtn`), against vLLM's own rounding as its `rtn_quantize` and `rtn_dequantize` write it,
and transformers on the rounded weights; vLLM's `experts_int8`, a mixture's experts alone in int8."""

from __future__ import annotations

import re

import pytest
import torch

from gapless import LLM, SamplingParams
from gapless.__main__ import main
from gapless.model import loader, parallel
from gapless.model.quant import quantization, weights_held
from gapless.model.quant.formats import QuantFormatError, resolve
from gapless.model.quant.int4 import Int4LinearMethod
from gapless.testing.hf_reference import assert_agrees, load_hf_model
from gapless.testing.quant_checkpoints import experts_of, linear_layers, rounded_copy
from gapless.testing.ranks import load_as_ranks

CPU = torch.device("cpu")


def _vllm_rtn(w: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """vLLM's `rtn_quantize` then `rtn_dequantize` of `w` [N, K] (group -1: a row), in its dtype, as vLLM
    writes them: a scale from each group's largest |w|, values shifted by half the range."""
    q_range = 2**bits
    groups = w.shape[0] * w.shape[1] // group if group != -1 else w.shape[0]
    flat = w.reshape(groups, -1)
    lo, hi = flat.min(dim=1, keepdim=True)[0], flat.max(dim=1, keepdim=True)[0]
    scale = torch.max(lo.abs(), hi.abs()) * 2.0 / (q_range - 1)
    q = ((flat / scale).round() + q_range // 2).clamp(0, q_range - 1).to(torch.uint8)
    data = q.to(scale.dtype) - q_range // 2
    return torch.mul(data, scale).reshape(w.shape)


@pytest.fixture
def rtn(monkeypatch, int4_reference_path):
    """`--quantization rtn`'s settings (bits, group); its layers on the exact reference path on the CPU."""

    def use(bits: int, group: int) -> None:
        monkeypatch.setenv("RTN_NUM_BITS", str(bits))
        monkeypatch.setenv("RTN_GROUP_SIZE", str(group))

    monkeypatch.setenv("GAPLESS_CPU_GEMM", "plain")  # (the float models' weights left as loaded)
    return use


@pytest.mark.parametrize(
    "arch,bits,group,dtype",
    [
        ("llama", 4, 32, torch.float32),
        ("llama", 8, 64, torch.bfloat16),
        ("phi3", 4, -1, torch.bfloat16),  # (q/k/v and gate/up fused in the checkpoint; one scale a row)
        ("qwen3", 8, -1, torch.float32),
    ],
)
def test_each_layer_holds_vllms_rounding_of_its_weight(ckpt_factory, rtn, arch, bits, group, dtype):
    """Every linear layer (the head and the embedding stay float) holds int values whose weight is vLLM's
    rounding of its float weight in the model's dtype, bit for bit, in bits/8 bytes a weight and its group's
    scale and zero; named for what it is."""
    rtn(bits, group)
    src = ckpt_factory(arch)
    model, float_model = (loader.load_model(src, dtype, CPU, quantization=q) for q in ("rtn", None))
    formats, held = weights_held(model)
    linear = linear_layers(model)
    label = f"rtn w{bits}a16 {'channel' if group < 0 else f'g{group}'}"
    assert all(isinstance(m.linear_method, Int4LinearMethod) for m in linear), formats
    assert formats[label] == len(linear) and quantization(model) == "rtn"
    for name, m in model.named_modules():
        if m in linear:
            w = float_model.get_submodule(name).weight
            assert torch.equal(m.linear_method.dequantized(dtype), _vllm_rtn(w, bits, group)), name
    assert torch.equal(model.lm_head.weight, float_model.lm_head.weight)
    methods = [m.linear_method for m in linear]
    ints = sum(t.numel() * t.element_size() for m in methods for t in (m.qweight, m.scales, m.zeros))
    assert ints < (bits / 8 + 0.3) * sum(m.out_features * m.in_features for m in methods)  # (bytes a weight)


@pytest.mark.parametrize("arch,shape", [("llama", {}), ("qwen3_moe", {"moe_intermediate_size": 64})])
def test_greedy_tokens_equal_transformers_on_the_rounded_weights(ckpt_factory, tmp_path, rtn, arch, shape):
    """A dense model and a mixture (its experts rounded too, on the grouped GEMM's path), 4 bits in groups
    of 32: transformers' greedy tokens on the float checkpoint rounded as vLLM rounds it."""
    rtn(4, 32)
    src = ckpt_factory(arch, **shape)
    ref = rounded_copy(src, tmp_path / "rounded", lambda w: _vllm_rtn(w, 4, 32))
    model = loader.load_model(src, torch.float32, CPU, quantization="rtn")
    ref_model = loader.load_model(ref, torch.float32, CPU)
    assert len(experts_of(model)) == (1 if shape else 0)
    for ours, theirs in zip(experts_of(model), experts_of(ref_model), strict=True):
        assert ours.weight_format == "rtn w4a16 g32 experts" and ours.cpu_weights is not None
        assert torch.equal(ours.cpu_weights[0], theirs.gate_up_proj)
        assert torch.equal(ours.cpu_weights[1], theirs.down_proj)
    assert_agrees(src, load_hf_model(ref), quantization="rtn")


def test_each_rank_rounds_its_own_piece(ckpt_factory, rtn):
    """Two tensor-parallel ranks: each holds vLLM's rounding of its own float piece of every layer (rows, or
    inputs in whole groups), as vLLM's ranks round theirs."""
    rtn(4, 32)
    src = ckpt_factory("qwen3_moe", moe_intermediate_size=128, head_dim=32)
    _, ranks = load_as_ranks(src, quantization="rtn")
    _, float_ranks = load_as_ranks(src)
    for rank, float_rank in zip(ranks, float_ranks, strict=True):
        for name, m in rank.named_modules():
            if m in linear_layers(rank):
                w = float_rank.get_submodule(name).weight
                assert torch.equal(m.linear_method.dequantized(torch.float32), _vllm_rtn(w, 4, 32)), name
        assert all(e.weight_format == "rtn w4a16 g32 experts" for e in experts_of(rank))


@pytest.mark.parametrize(
    "bits,group,ranks,words",
    [
        (3, 128, 1, "RTN_NUM_BITS=3; 4 or 8"),
        (4, 48, 1, "RTN_GROUP_SIZE=48; a power of two from 8, or -1"),
        (4, 4, 1, "RTN_GROUP_SIZE=4; a power of two from 8"),
        (
            8,
            128,
            1,
            "self_attn.qkv_proj takes 64 inputs (this rank's), not a multiple of RTN_GROUP_SIZE 128",
        ),
        (
            4,
            64,
            2,
            "self_attn.o_proj takes 32 inputs (this rank's), not a multiple of RTN_GROUP_SIZE 64",
        ),
    ],
)
def test_settings_or_shapes_it_cannot_round_are_refused_before_loading(
    ckpt_factory, monkeypatch, bits, group, ranks, words
):
    """vLLM's variables out of range, or a layer whose inputs (a rank's) are in no whole groups: refused in
    one line naming them, before any weight is read."""
    monkeypatch.setenv("RTN_NUM_BITS", str(bits))
    monkeypatch.setenv("RTN_GROUP_SIZE", str(group))
    src = ckpt_factory("llama")
    read = []
    monkeypatch.setattr(loader, "iter_weights", lambda *a: read.append(a) or iter(()))
    parallel.use(parallel.TPGroup(rank=0, size=ranks))
    try:
        with pytest.raises(QuantFormatError) as e:
            loader.load_model(src, torch.float32, CPU, quantization="rtn")
    finally:
        parallel.use(parallel.SINGLE)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not read


@pytest.mark.parametrize(
    "flag,env,words",
    [
        ("rtn", {"RTN_GROUP_SIZE": "128"}, "model.layers.0.self_attn.qkv_proj takes 64 inputs"),
        ("bitsandbytes", {}, "model.layers.0.mlp.experts takes 32 inputs (this rank's), not a multiple of"),
    ],
)
def test_serve_refuses_layers_it_cannot_round_in_one_line(
    ckpt_factory, monkeypatch, capsys, flag, env, words
):
    """`gapless serve` checks the layers' shapes against the rounding before any worker starts (the model
    built with no memory): one line on stderr, exit status 2, no traceback."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    model = ckpt_factory("qwen3" if flag == "rtn" else "qwen3_moe")
    capsys.readouterr()  # (the checkpoint's writing, if this test made it)
    assert main(["serve", "--model", str(model), "--device", "cpu", "--quantization", flag]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_rtn_is_a_flag_not_a_checkpoints_format():
    """`--quantization rtn` names a rounding at load: a config that declares it, or the flag on a quantized
    checkpoint, is refused in one line."""
    with pytest.raises(QuantFormatError, match="rtn quantizes a float checkpoint at load alone"):
        resolve({"quant_method": "rtn"}, None, "cpu")
    with pytest.raises(QuantFormatError, match="--quantization rtn but the checkpoint is quantized as awq"):
        resolve({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}, "rtn", "cpu")


def test_the_engine_serves_it_on_the_cpus_own_kernels(ckpt_factory, monkeypatch):
    """Under `auto` a CPU runs the rounded layers on torch's int kernels (named so); a dummy load rounds its
    random weights alike; the engine generates either way."""
    monkeypatch.setenv("RTN_NUM_BITS", "4")
    monkeypatch.setenv("RTN_GROUP_SIZE", "32")
    src = ckpt_factory("qwen3")
    formats, _ = weights_held(loader.load_model(src, torch.bfloat16, CPU, quantization="rtn"))
    assert formats == {"rtn w4a16 g32 (torch-cpu)": 8, "bfloat16": 1}, formats
    for load_format in ("auto", "dummy"):
        opts = {"dtype": "bfloat16", "kv_cache_tokens": 256, "load_format": load_format}
        with LLM(str(src), device="cpu", quantization="rtn", **opts) as llm:
            out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert len(out[0].token_ids) == 4


def _vllm_experts_int8(w: torch.Tensor) -> torch.Tensor:
    """vLLM's `quantize_in_place_and_get_scales` of `w` [N, K] (an expert's projection), times its scales
    again: int8 with one scale a row, its largest |w| over 127."""
    vmax = torch.iinfo(torch.int8).max
    scales = torch.max(torch.abs(w), dim=1, keepdim=True)[0] / vmax
    return (w / scales).round().clamp(-vmax, vmax) * scales


EXPERT_WEIGHTS = re.compile(r"model\.layers\.\d+\.mlp\.experts\.\d+\.\w+_proj\.weight$")


def test_experts_int8_rounds_a_mixtures_experts_alone(
    ckpt_factory, tmp_path, monkeypatch, int4_reference_path
):
    """`--quantization experts_int8` (vLLM's): each expert's projections held as vLLM's int8 rounding of
    them, bit for bit, for the grouped GEMM; every other layer float; transformers' tokens on those weights.
    A model with no mixture is refused by name."""
    monkeypatch.setenv("GAPLESS_CPU_GEMM", "plain")
    src = ckpt_factory("qwen3_moe", moe_intermediate_size=64)
    ref = rounded_copy(src, tmp_path / "rounded", _vllm_experts_int8, EXPERT_WEIGHTS)
    model = loader.load_model(src, torch.float32, CPU, quantization="experts_int8")
    ref_model = loader.load_model(ref, torch.float32, CPU)
    assert quantization(model) == "experts_int8"
    assert weights_held(model)[0]["experts_int8 w8a16 channel experts"] == 1
    for ours, theirs in zip(experts_of(model), experts_of(ref_model), strict=True):
        assert ours.int_quant is not None and ours.cpu_weights is not None
        assert torch.equal(ours.cpu_weights[0], theirs.gate_up_proj)
        assert torch.equal(ours.cpu_weights[1], theirs.down_proj)
    assert all(
        torch.equal(p, ref_model.get_parameter(n)) for n, p in model.named_parameters() if "experts" not in n
    )
    assert_agrees(src, load_hf_model(ref), quantization="experts_int8")
    with pytest.raises(QuantFormatError, match="experts_int8: the model has no mixture of experts"):
        loader.load_model(ckpt_factory("llama"), torch.float32, CPU, quantization="experts_int8")


def test_experts_int8_on_two_ranks_rounds_each_ranks_piece(ckpt_factory, monkeypatch, int4_reference_path):
    """Each rank rounds its own piece of the experts (gate/up rows, down columns: a row's scale over this
    rank's columns), as vLLM's ranks do."""
    src = ckpt_factory("qwen3_moe", moe_intermediate_size=128, head_dim=32)
    _, ranks = load_as_ranks(src, quantization="experts_int8")
    _, float_ranks = load_as_ranks(src)
    for rank, float_rank in zip(ranks, float_ranks, strict=True):
        for ours, theirs in zip(experts_of(rank), experts_of(float_rank), strict=True):
            assert ours.cpu_weights is not None
            for held, w in zip(ours.cpu_weights, (theirs.gate_up_proj, theirs.down_proj)):
                assert torch.equal(held, torch.stack([_vllm_experts_int8(e) for e in w]))


NEEDS_CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device: the tests above check the same weights and tokens on the CPU's reference path",
)


@NEEDS_CUDA
def test_cuda_runs_the_rounded_layers_on_its_int_gemms(ckpt_factory, tmp_path, monkeypatch):
    """On a GPU: in float32 the Triton GEMM over the rounded layers gives transformers' tokens on the
    rounded weights; in bfloat16 4-bit layers take tinygemm's copy for decode too; the engine generates."""
    monkeypatch.setenv("RTN_NUM_BITS", "4")
    monkeypatch.setenv("RTN_GROUP_SIZE", "32")
    src = ckpt_factory("llama")
    ref = rounded_copy(src, tmp_path / "rounded", lambda w: _vllm_rtn(w, 4, 32))
    assert_agrees(src, load_hf_model(ref), quantization="rtn", device="cuda")
    formats, _ = weights_held(
        loader.load_model(src, torch.bfloat16, torch.device("cuda"), quantization="rtn")
    )
    assert formats.get("rtn w4a16 g32 (tinygemm to 8 rows, triton above)") == 8, formats
    with LLM(str(src), device="cuda", dtype="bfloat16", quantization="rtn", kv_cache_tokens=256) as llm:
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 4
