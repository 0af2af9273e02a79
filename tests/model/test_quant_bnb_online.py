"""`--quantization bitsandbytes` on a float checkpoint (vLLM's in-flight 4-bit): every linear layer but the
routers, and every mixture's experts, quantized to NF4 in blocks of 64 at load (`gapless.model.quant.bnb`).
Against bitsandbytes' own quantizer and transformers running the model through it where bitsandbytes is
installed; against a plain nearest-level rounding and transformers on the same rounded weights
everywhere."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from gapless import LLM, SamplingParams
from gapless.model import loader
from gapless.model.quant import bnb, quantization, weights_held
from gapless.model.quant.formats import QuantFormatError
from gapless.testing.hf_reference import assert_agrees, load_hf_model
from gapless.testing.quant_checkpoints import assert_codebook_layers, experts_of, linear_layers, rounded_copy
from gapless.testing.ranks import assert_experts_cut, load_as_ranks

CPU = torch.device("cpu")
NEEDS_BNB = pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None,
    reason="bitsandbytes is absent: its own quantizer and transformers' reading through it are the reference",
)


def _load(path, dtype=torch.float32, **kw):
    return _load_on(path, CPU, dtype, **kw)


def _load_on(path, device: torch.device, dtype=torch.float32, **kw):
    return loader.load_model(path, dtype, device, quantization="bitsandbytes", **kw)


def _nearest_nf4(w: torch.Tensor) -> torch.Tensor:
    """`w` [..., K] rounded as NF4 in blocks of 64 by a plain search: each value times the reciprocal of its
    block's absolute maximum, to the nearest level, times that maximum again (float32)."""
    table = torch.tensor(bnb.NF4)
    blocks = w.float().reshape(-1, 64)
    absmax = blocks.abs().amax(-1, keepdim=True)
    codes = ((blocks * (1.0 / absmax)).unsqueeze(-1) - table).abs().argmin(-1)
    return (table[codes] * absmax).view(w.shape)


@pytest.mark.parametrize("arch", ["llama", "phi3"])  # (phi3: q/k/v and gate/up fused in the checkpoint)
def test_the_triton_route_holds_each_layers_nearest_nf4_codes(ckpt_factory, tmp_path, monkeypatch, arch):
    """On the Triton GEMM's route (a GPU's; here its reference path) every linear layer holds NF4 codes in
    blocks of 64 whose weight is the nearest-level rounding of its float weight, bit for bit, in under a
    seventh of the float32 bytes; the head stays float; transformers' tokens on the rounded weights."""
    monkeypatch.setattr(bnb, "kept", lambda device: "triton")
    monkeypatch.setenv("GAPLESS_CPU_GEMM", "plain")
    src = ckpt_factory(arch)
    ref = rounded_copy(src, tmp_path / "rounded", _nearest_nf4)
    model, ref_model = _load(src), loader.load_model(ref, torch.float32, CPU)
    assert_codebook_layers(model, ref_model, "bitsandbytes nf4 g64")
    assert quantization(model) == "bitsandbytes"
    assert torch.equal(model.lm_head.weight, ref_model.lm_head.weight)
    assert_agrees(src, load_hf_model(ref), quantization="bitsandbytes")


@NEEDS_BNB
def test_the_codes_are_bitsandbytes_own(ckpt_factory, monkeypatch):
    """Each layer's weight is the one bitsandbytes' `quantize_4bit` and `dequantize_4bit` give its float
    weight with vLLM's in-flight settings (NF4, blocks of 64; the scales float32), bit for bit."""
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    monkeypatch.setattr(bnb, "kept", lambda device: "triton")
    monkeypatch.setenv("GAPLESS_CPU_GEMM", "plain")  # (the float model's weights left as loaded)
    src = ckpt_factory("qwen3")
    model, float_model = _load(src), loader.load_model(src, torch.float32, CPU)
    linear = linear_layers(model)
    for name, m in model.named_modules():
        if m in linear:
            w = float_model.get_submodule(name).weight
            theirs = dequantize_4bit(*quantize_4bit(w, blocksize=64, quant_type="nf4"))
            assert torch.equal(m.linear_method.dequantized(torch.float32), theirs), name


@NEEDS_BNB
def test_tokens_equal_transformers_quantizing_through_bitsandbytes(ckpt_factory):
    """The load as this CPU runs it (bitsandbytes' fused kernel where it runs, else float layers holding
    NF4's values) against transformers loading the same float checkpoint with bitsandbytes' NF4
    (`BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")`, on the same kernel or its float
    path): the same greedy tokens."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    src = ckpt_factory("llama")
    config = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )
    theirs = AutoModelForCausalLM.from_pretrained(str(src), quantization_config=config, device_map="cpu")
    fused = bnb.kept(CPU) == "bitsandbytes"
    for module in theirs.modules():
        if hasattr(module, "support_avx512bf16_for_cpu") and not fused:
            module.support_avx512bf16_for_cpu = False
    methods = {getattr(m.linear_method, "quant_method", None) for m in linear_layers(_load(src))}
    assert methods == {"bitsandbytes" if fused else "unquantized"}
    assert_agrees(src, theirs.eval(), quantization="bitsandbytes")


def test_without_a_4bit_kernel_the_layers_hold_nf4s_values(ckpt_factory, tmp_path, monkeypatch):
    """Where nothing keeps 4 bits, the layers and a mixture's experts stay float holding the NF4 rounding
    of their weights, the very weights the Triton route holds: one model on every device; transformers'
    tokens on the rounded weights."""
    monkeypatch.setenv("GAPLESS_CPU_GEMM", "plain")
    src = ckpt_factory("qwen3_moe", moe_intermediate_size=64)
    ref = rounded_copy(src, tmp_path / "rounded", _nearest_nf4)
    monkeypatch.setattr(bnb, "kept", lambda device: None)
    model, ref_model = _load(src), loader.load_model(ref, torch.float32, CPU)
    for (name, p), (_, r) in zip(model.named_parameters(), ref_model.named_parameters(), strict=True):
        assert torch.equal(p, r), name
    assert all(e.int_quant is None for e in experts_of(model))
    monkeypatch.setattr(bnb, "kept", lambda device: "triton")
    for ours, theirs in zip(experts_of(_load(src)), experts_of(ref_model), strict=True):
        assert ours.weight_format == "bitsandbytes nf4 g64 experts" and ours.cpu_weights is not None
        assert torch.equal(ours.cpu_weights[0], theirs.gate_up_proj)
        assert torch.equal(ours.cpu_weights[1], theirs.down_proj)
    monkeypatch.setattr(bnb, "kept", lambda device: None)
    assert_agrees(src, load_hf_model(ref), quantization="bitsandbytes")


def test_each_rank_quantizes_its_own_piece(ckpt_factory, monkeypatch):
    """Two tensor-parallel ranks: each holds the NF4 rounding of its own float piece of every layer (rows,
    or inputs in whole blocks of 64), and its piece of the experts is the whole layer's, cut."""
    monkeypatch.setattr(bnb, "kept", lambda device: "triton")
    monkeypatch.setenv("GAPLESS_INT4_KERNEL", "triton")
    monkeypatch.setenv("GAPLESS_CPU_GEMM", "plain")
    src = ckpt_factory("qwen3_moe", moe_intermediate_size=128, head_dim=32)  # (o: 64 inputs a rank)
    whole, ranks = load_as_ranks(src, quantization="bitsandbytes")
    _, float_ranks = load_as_ranks(src)
    for rank, float_rank in zip(ranks, float_ranks):
        for name, m in rank.named_modules():
            if m in linear_layers(rank):
                w = float_rank.get_submodule(name).weight
                assert torch.equal(m.linear_method.dequantized(torch.float32), _nearest_nf4(w)), name
    for experts, *pieces in zip(experts_of(whole), *map(experts_of, ranks), strict=True):
        assert all(p.weight_format == "bitsandbytes nf4 g64 experts" for p in [experts, *pieces])
        assert_experts_cut(experts, pieces)


@pytest.mark.parametrize(
    "arch,shape,ranks,words",
    [
        ("llama", {"intermediate_size": 96}, 1, "model.layers.0.mlp.down_proj takes 96 inputs"),
        (
            "qwen3_moe",
            {"moe_intermediate_size": 64, "head_dim": 32},
            2,
            "layers.0.mlp.experts takes 32 inputs",
        ),
    ],
)
def test_inputs_in_no_whole_blocks_are_refused_before_loading(
    ckpt_factory, monkeypatch, arch, shape, ranks, words
):
    """A layer whose inputs (a rank's share of them) are no multiple of bitsandbytes' blocks of 64 is
    refused by name, before any weight is read."""
    from gapless.model import parallel

    src = ckpt_factory(arch, **shape)
    read = []
    monkeypatch.setattr(loader, "iter_weights", lambda *a: read.append(a) or iter(()))
    parallel.use(parallel.TPGroup(rank=0, size=ranks))
    try:
        with pytest.raises(QuantFormatError) as e:
            _load(src)
    finally:
        parallel.use(parallel.SINGLE)
    assert words in str(e.value) and "blocks of 64" in str(e.value) and "\n" not in str(e.value)
    assert not read


def test_a_dummy_load_quantizes_its_random_weights(ckpt_factory):
    """`--load-format dummy --quantization bitsandbytes` (a benchmark's): random weights NF4 holds, every
    layer kept as a loaded checkpoint's on the route this CPU takes; the engine generates."""
    src = ckpt_factory("qwen3")
    model = _load(src, torch.bfloat16, dummy=True)
    assert quantization(model) == ("bitsandbytes" if bnb.kept(CPU) else None)
    engine = {"load_format": "dummy", "dtype": "bfloat16", "kv_cache_tokens": 256}
    with LLM(str(src), device="cpu", quantization="bitsandbytes", **engine) as llm:
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 4


def test_vllms_older_spelling_quantizes_a_float_checkpoint(ckpt_factory):
    """`--quantization bitsandbytes --load-format bitsandbytes` (vLLM's in-flight spelling before its load
    format became `auto`) passes the checks for a float checkpoint; `--load-format bitsandbytes` alone is
    refused in one line naming the flag that quantizes one."""
    from gapless.config import EngineConfig
    from gapless.engine.preflight import check_engine_config

    src = str(ckpt_factory("llama"))
    cfg = EngineConfig(model=src, device="cpu", load_format="bitsandbytes", quantization="bitsandbytes")
    assert check_engine_config(cfg).cfg.quantization == "bitsandbytes"
    with pytest.raises(ValueError) as e:
        check_engine_config(EngineConfig(model=src, device="cpu", load_format="bitsandbytes"))
    assert "\n" not in str(e.value) and "with --quantization bitsandbytes a float one is quantized" in str(
        e.value
    )


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device: the tests above check the same codes and tokens on the Triton route's reference",
)
def test_cuda_runs_nf4_at_load_on_the_codebook_gemm(ckpt_factory, tmp_path):
    """On a GPU (float32): every layer on the Triton GEMM with NF4's levels, transformers' tokens on the
    NF4-rounded weights."""
    src = ckpt_factory("llama")
    ref = rounded_copy(src, tmp_path / "rounded", _nearest_nf4)
    formats, _ = weights_held(_load_on(src, torch.device("cuda")))
    assert formats.get("bitsandbytes nf4 g64") == 8, formats
    assert_agrees(src, load_hf_model(ref), quantization="bitsandbytes", device="cuda")
