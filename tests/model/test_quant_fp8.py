"""FP8 e4m3 weights (`gapless.model.quant.fp8`) and the format dispatch (`gapless.model.quant.formats`).

Tiny random checkpoints are quantized here into each layout (`gapless.testing.fp8_checkpoints`): Hugging
Face's `quant_method: fp8` with block scales, compressed-tensors `float-quantized` per tensor, per channel
and per block, and `--quantization fp8` of the float checkpoint. Each one's greedy tokens are compared with
transformers running a float32 checkpoint of the same weights dequantized: the difference is the rounding
of the activations to e4m3, so tokens are equal or diverge at a near-tie only (counted). The Triton GEMM
runs under the interpreter on activations that e4m3 holds exactly after scaling (the interpreter's own
e4m3 rounding is wrong, see `fp8_kernel`), and with real rounding on a GPU when there is one."""

from __future__ import annotations

import itertools
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from gapless import LLM, SamplingParams
from gapless.model import layers, loader
from gapless.model.quant import declared, formats, quantization, weights_held, weights_summary
from gapless.model.quant.formats import QuantFormatError
from gapless.model.quant.fp8 import (
    FP8,
    activation_group,
    dequantize,
    quantize_blocks,
    quantize_rows,
    reference_linear,
)
from gapless.model.quant.fp8_kernel import FP8_MAX, fp8_gemm
from gapless.testing.fp8_checkpoints import inputs_rounded, quant_config, write_fp8_checkpoint
from gapless.testing.hf_reference import check_greedy, hf_greedy, load_hf_model, make_prompts
from gapless.testing.quant_checkpoints import experts_of
from gapless.testing.ranks import assert_experts_cut, load_as_ranks

MAX_NEW = 8
# e4m3 activations (3 mantissa bits: a relative rounding of up to 2^-4 per value) move these tiny models'
# logits (std ~2) by up to 1.2 at a position, median 0.6 (measured on the qwen3 tiny model: transformers
# with each linear's input rounded as the kernel rounds it, against without). A greedy divergence is
# accepted where the reference's logit of our token is within that of its top one, and counted.
NEAR_TIE = 1.2
CPU = torch.device("cpu")


# --- the format dispatch ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layout", "label"),
    [
        ("fp8", "fp8 e4m3 block 128x128"),
        ("ct-tensor", "compressed-tensors fp8 e4m3 per-tensor"),
        ("ct-channel", "compressed-tensors fp8 e4m3 per-channel"),
        ("ct-block", "compressed-tensors fp8 e4m3 block 128x128"),
        ("fp8-tensor", "fp8 e4m3 per-tensor"),
        ("modelopt-channel", "modelopt fp8 e4m3 per-channel"),
        ("modelopt-block", "modelopt fp8 e4m3 block 128x128"),
        ("fbgemm", "fbgemm fp8 e4m3 per-channel"),
        ("ct-group", "compressed-tensors fp8 e4m3 g128"),
        ("ct-mxfp8", "compressed-tensors mxfp8 e4m3 g32"),
        ("modelopt-mxfp8", "modelopt mxfp8 e4m3 g32"),
    ],
)
def test_each_layouts_config_names_its_format(layout, label):
    spec = formats.resolve(quant_config(layout, (128, 128)), None, "cpu")
    assert spec is not None and spec.scheme == "fp8" and spec.label == label
    if layout == "modelopt-mxfp8":  # (vLLM's name of its kernel, as a flag and as some exports name it)
        mx = quant_config(layout, (128, 128))
        assert formats.resolve(mx, "modelopt_mxfp8", "cpu") == spec
        assert formats.resolve({**mx, "quant_method": "modelopt_mxfp8"}, None, "cpu") == spec
    assert formats.resolve(None, "fp8", "cpu").online  # --quantization fp8 of a float checkpoint
    assert formats.resolve(None, None, "cpu") is None


def _group_format(top: str, group: str) -> dict:
    """compressed-tensors' per-channel FP8 config saying `top` as its format and `group` in its group."""
    qcfg = quant_config("ct-channel", (1, 1))
    groups = {name: {**g, "format": group} for name, g in qcfg["config_groups"].items()}
    return {**qcfg, "format": top, "config_groups": groups}


def _one_line(excinfo, *words):
    msg = str(excinfo.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


@pytest.mark.parametrize(
    ("qcfg", "flag", "words"),
    [
        ({"quant_method": "hqq"}, None, ["'hqq'", "is not run"]),
        (None, "frobnicate", ["--quantization 'frobnicate'", "not a known format"]),
        (quant_config("fp8", (128, 128)), "compressed-tensors", ["quantized as fp8"]),
        ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, None, ["e5m2"]),
        ({"quant_method": "fp8", "weight_block_size": [128]}, None, ["weight_block_size=[128]"]),
        (
            {"quant_method": "compressed-tensors", "format": "marlin-24"},  # (2:4 sparse int4)
            None,
            ["'marlin-24'"],
        ),
        # fields of another JSON type than the writers write: one line naming the format, not a traceback
        ({**quant_config("ct-channel", (1, 1)), "config_groups": "group_0"}, None, ["malformed config"]),
        ({**quant_config("ct-channel", (1, 1)), "format": ["float-quantized"]}, None, ["malformed config"]),
        (
            {"quant_method": "gptq", "bits": 4, "group_size": 32, "dynamic": {"+:.*": 5}},
            None,
            ["quantization gptq: malformed config"],
        ),
        (_group_format("pack-quantized", "float-quantized"), None, ["format 'pack-quantized', but"]),
        (
            {**quant_config("ct-channel", (1, 1)), "sparsity_config": {"format": "sparse-24"}},
            None,
            ["sparsity"],
        ),
    ],
)
def test_an_unknown_or_malformed_format_is_refused_in_one_line(qcfg, flag, words):
    with pytest.raises(QuantFormatError) as e:
        formats.resolve(qcfg, flag, "cpu")
    _one_line(e, *words)


def test_fp8_on_a_gpu_without_fp8_tensor_cores_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(QuantFormatError) as e:
        formats.resolve(None, "fp8", "cuda")
    _one_line(e, "quantization fp8", "sm_89", "NVIDIA A100 is sm_80")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert formats.resolve(quant_config("fp8", (128, 128)), None, "cuda") is not None


def test_refused_before_any_weight_loads(ckpt_factory, tmp_path, monkeypatch):
    """The engine's pre-flight and the loader refuse before reading a tensor."""
    from gapless.config import EngineConfig
    from gapless.engine.preflight import check_engine_config

    src = ckpt_factory("qwen3")
    dst, _ = write_fp8_checkpoint(src, tmp_path / "q", "fp8")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"]["quant_method"] = "hqq"
    (dst / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setattr(loader, "iter_weights", lambda *a: pytest.fail("a weight was read"))
    with pytest.raises(ValueError) as e:
        loader.load_model(dst, torch.float32, CPU)
    _one_line(e, "'hqq'")
    with pytest.raises(ValueError) as e:
        check_engine_config(EngineConfig(model=str(dst), device="cpu"))
    _one_line(e, "'hqq'")


@pytest.mark.parametrize(
    ("arch", "block", "words"),
    [
        ("qwen3", (128, 128), ("'s 64 input columns per rank split its 128-wide scale blocks",)),
        ("qwen3_moe", (32, 32), ("fp8 experts: 16 columns per rank split", "32x32 scale blocks")),
    ],
)
def test_blocks_the_ranks_would_split_are_refused_before_any_worker_starts(
    ckpt_factory, tmp_path, monkeypatch, arch, block, words
):
    """Under tensor parallelism the pre-flight builds the model on `meta` as rank 0 cuts it and prepares
    the checkpoint's fp8 layers, so blocks a rank's cut would split are refused there, reading no tensor
    (they were found as the worker loaded)."""
    from gapless.config import EngineConfig
    from gapless.engine.preflight import check_engine_config

    dst, _ = write_fp8_checkpoint(ckpt_factory(arch), tmp_path / "q", "fp8", block=block)
    monkeypatch.setattr(loader, "iter_weights", lambda *a: pytest.fail("a weight was read"))
    check_engine_config(EngineConfig(model=str(dst), device="cpu"))  # (one rank: whole blocks)
    with pytest.raises(ValueError) as e:
        check_engine_config(EngineConfig(model=str(dst), device="cpu", tensor_parallel_size=2))
    _one_line(e, *words)


def test_a_block_width_no_kernel_steps_through_is_refused_with_the_config():
    for qcfg in (
        {"quant_method": "fp8", "weight_block_size": [24, 24]},
        quant_config("ct-block", (128, 96)),
    ):
        with pytest.raises(QuantFormatError, match="block width (24|96) is not a power of two >= 16"):
            formats.resolve(qcfg, None, "cpu")


def test_a_scale_of_the_wrong_shape_is_refused_by_name(ckpt_factory, tmp_path):
    dst, _ = write_fp8_checkpoint(ckpt_factory("qwen3"), tmp_path / "q", "fp8", block=(32, 32))
    tensors = load_file(str(dst / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight_scale_inv"
    tensors[name] = tensors[name][:, :1].contiguous()
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(QuantFormatError) as e:
        loader.load_model(dst, torch.float32, CPU)
    _one_line(e, "model.layers.1.mlp.down_proj.weight_scale", "expected (2, 4)")


@pytest.mark.parametrize("layout", ["fp8", "ct-channel"])
def test_an_fp8_weight_without_its_scale_or_in_e5m2_is_refused_by_name(ckpt_factory, tmp_path, layout):
    """A layer whose e4m3 weight comes without its scale is not an FP8 layer of the checkpoint's format:
    its codes cast to floats would be the weights divided by their scale, so the load is refused naming
    the weight; so is an e5m2 weight, which a cast to e4m3 would round again."""
    dst, _ = write_fp8_checkpoint(ckpt_factory("qwen3"), tmp_path / "q", layout, block=(32, 32))
    tensors = load_file(str(dst / "model.safetensors"))
    weight = "model.layers.1.mlp.down_proj.weight"
    for name in [n for n in tensors if n.startswith(weight.removesuffix("weight") + "weight_scale")]:
        del tensors[name]
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(QuantFormatError) as e:
        loader.load_model(dst, torch.float32, CPU)
    _one_line(e, repr(weight), "float8_e4m3fn", "lacks its scale")
    dst, _ = write_fp8_checkpoint(ckpt_factory("qwen3"), tmp_path / "r", layout, block=(32, 32))
    tensors = load_file(str(dst / "model.safetensors"))
    tensors[weight] = tensors[weight].to(torch.float8_e5m2)
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(QuantFormatError) as e:
        loader.load_model(dst, torch.float32, CPU)
    _one_line(e, repr(weight), "float8_e5m2", "e5m2 weights are not run")


_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the CPU cases check the same)")
GPU = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # (the interpreter's run on the CPU)


def _tie_tolerance(device: str) -> float:
    """A mixture's greedy tie tolerance: on the CPU each activation is rounded to e4m3 as the reference
    rounds it, so tokens are equal. On CUDA float32's last bits differ (cuBLAS, the attention kernel),
    and one such bit at an e4m3 midpoint moves a value by 2^-4: a divergence at a near-tie is accepted.
    (On an H200 the dense layers on the torch reference path diverged as the kernels did: 4.2e-2 at
    step 6; the fused experts equal the reference to 2e-7.)"""
    return 1e-3 if device == "cpu" else NEAR_TIE


@pytest.mark.parametrize(
    ("layout", "block", "device", "arch"),
    [
        ("fp8", (32, 32), "cpu", "qwen3_moe"),
        ("ct-channel", None, "cpu", "qwen3_moe"),
        ("ct-tensor", None, "cpu", "qwen3_moe"),
        ("ct-mxfp8", (1, 32), "cpu", "qwen3_moe"),
        ("fp8", (32, 32), "cpu", "mixtral"),  # (its experts' w1/w3/w2)
        ("fp8", (32, 32), "cpu-fused", "qwen3_moe"),  # (the grouped GEMM under the interpreter)
        pytest.param("fp8", (32, 32), "cuda", "qwen3_moe", marks=_CUDA, id="fp8-cuda"),
    ],
)
def test_fp8_checkpoint_of_a_mixture_equals_its_dequantized_weights(
    ckpt_factory, tmp_path, layout, block, device, arch
):
    """A mixture's fp8 checkpoint (each expert's projections quantized with their scales, as Qwen's
    `*-FP8` mixtures are): the experts load in e4m3 with their scales, per row or per block, and greedy
    tokens equal transformers' on the dequantized weights, every quantized projection's inputs rounded
    as ours are (the experts' too: W8A8, as transformers' `FP8Experts`)."""
    src = ckpt_factory(arch)
    dst, ref = write_fp8_checkpoint(src, tmp_path / layout, layout, block or (128, 128))
    loaded = loader.load_model(dst, torch.float32, CPU)
    experts = [m for m in loaded.modules() if type(m).__name__ == "Experts"]
    assert experts and all(m.gate_up_proj.dtype == FP8 and m.cpu_weights is not None for m in experts)
    assert any(f.endswith("experts") for f in weights_held(loaded)[0]), weights_held(loaded)
    prompts = make_prompts(1000, n=3, max_len=30, shared_prefix=6)
    ours = _greedy(dst, prompts, device=device.removesuffix("-fused"), fused=device.endswith("fused"))
    hf = load_hf_model(ref)
    with inputs_rounded(hf, block[1] if block else 0):
        for out, p in zip(ours, prompts):
            check_greedy(out, hf_greedy(hf, p, MAX_NEW), tol=_tie_tolerance(device))


def test_a_mixtures_bad_expert_scale_is_refused_in_one_line(ckpt_factory, tmp_path):
    src = ckpt_factory("qwen3_moe")
    dst, _ = write_fp8_checkpoint(src, tmp_path / "bad", "fp8", (32, 32))
    tensors = load_file(str(dst / "model.safetensors"))
    key = next(k for k in tensors if ".experts.0.down_proj.weight_scale" in k)
    tensors[key] = torch.ones(5, 5)
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(QuantFormatError) as e:
        loader.load_model(dst, torch.float32, CPU)
    _one_line(e, "expert down scale of shape (5, 5) fits no per-tensor, per-row or block scale")


def _rows_rounded(w: torch.Tensor) -> torch.Tensor:
    """w with each row (of its last dimension) through e4m3 and back, as `--quantization fp8` holds it."""
    q, s = quantize_rows(w.reshape(-1, w.shape[-1]))
    return (q.float() * s).view(w.shape).to(w.dtype)


@pytest.mark.parametrize(
    ("arch", "device"),
    [
        ("qwen3_moe", "cpu"),
        ("mixtral", "cpu"),
        pytest.param("qwen3_moe", "cuda", marks=_CUDA, id="qwen3_moe-cuda"),
    ],
)
def test_online_fp8_mixture_equals_its_rounded_weights(ckpt_factory, arch, device):
    """`--quantization fp8` of a mixture: attention and the experts in e4m3, W8A8, the router float.
    Greedy tokens equal transformers' on the same rounded weights, attention's and the experts' inputs
    rounded as ours are (on CUDA: the fused experts' e4m3 grouped GEMM)."""
    src = ckpt_factory(arch)
    loaded = loader.load_model(src, torch.float32, CPU, quantization="fp8")
    held = weights_held(loaded)[0]
    experts = [m for m in loaded.modules() if type(m).__name__ == "Experts"]
    assert experts and all(m.gate_up_proj.dtype == FP8 and m.down_proj.dtype == FP8 for m in experts)
    assert any("fp8" in f for f in held), held
    prompts = make_prompts(1000, n=3, max_len=30, shared_prefix=6)
    ours = _greedy(src, prompts, quantization="fp8", device=device)
    hf = load_hf_model(src)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            # every projection (attention, dense MLP layers, the experts' stacked ones), not the router
            if name.startswith("model.layers.") and (name.endswith("_proj.weight") or name.endswith("_proj")):
                p.copy_(_rows_rounded(p))
    with inputs_rounded(hf, 0):
        for out, p in zip(ours, prompts):
            check_greedy(out, hf_greedy(hf, p, MAX_NEW), tol=_tie_tolerance(device))


def _on_gpu(*tensors):
    """`tensors` (and (tensor, int) pairs, as scales) on `GPU`."""
    return tuple((t[0].to(GPU), t[1]) if isinstance(t, tuple) else t.to(GPU) for t in tensors)


def _fp8_experts(seed: int) -> tuple[torch.Tensor, tuple, tuple, tuple, tuple]:
    """A mixture layer for the grouped GEMM over e4m3 experts: x [9, 32]; 4 experts' float w13 [96, 32]
    and w2 [32, 48]; the same rounded to e4m3 a row, with their scales as `fused_experts` takes them;
    each token's 2 experts (routing weights, ids)."""
    from gapless.model.moe import route

    g = torch.Generator().manual_seed(seed)
    tokens, e, h, inter = 9, 4, 32, 48
    x = torch.randn(tokens, h, generator=g)
    w13, w2 = torch.randn(e, 2 * inter, h, generator=g) * 0.1, torch.randn(e, h, inter, generator=g) * 0.1
    routed = route(torch.randn(tokens, e, generator=g), 2, True, False)
    q13, s13 = quantize_rows(w13.reshape(-1, h))
    q2, s2 = quantize_rows(w2.reshape(-1, inter))
    scales = ((s13.view(e, 2 * inter, 1), h), (s2.view(e, h, 1), inter))
    return x, (w13, w2), (q13.view(w13.shape), q2.view(w2.shape)), scales, routed


def test_fused_experts_over_fp8_weights_equal_the_dequantized_reference():
    """The grouped GEMM over e4m3 experts (W8A8: each K step of the activations rounded to e4m3 per row,
    an e4m3 dot, both scales) equals the per-expert torch path over the dequantized weights with the
    activations rounded alike (per token and 128 columns, at most K: 32 for gate/up, 64 for down), and
    not the path with them unrounded (W8A16)."""
    from gapless.model.moe import reference_experts
    from gapless.model.moe_triton import fused_experts

    x, (w13, w2), (q13, q2), scales, (weights, ids) = _fp8_experts(0)
    held = (_rows_rounded(w13), _rows_rounded(w2))
    want = reference_experts(x, *held, weights, ids, act_groups=(32, 64))
    got = fused_experts(*_on_gpu(x, q13, q2, weights, ids), scales=_on_gpu(*scales)).cpu()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(got, reference_experts(x, *held, weights, ids), atol=1e-3)


def test_fused_experts_over_fp8_weights_scaled_per_group_of_inputs_equal_the_dequantized_reference():
    """A scale per row and group of inputs (MXFP8's layout: groups of 32; of 16 here, which divides these
    experts' 32 and 48 inputs): each K step's product scaled by its group's scale, the activations
    rounded per the same 16 columns (`act_group`)."""
    from gapless.model.moe import reference_experts
    from gapless.model.moe_triton import fused_experts

    x, (w13, w2), _, _, (weights, ids) = _fp8_experts(1)
    (e, n13, h), n2, inter = w13.shape, w2.shape[1], w2.shape[2]
    q13, s13 = quantize_blocks(w13.reshape(-1, h), (1, 16))
    q2, s2 = quantize_blocks(w2.reshape(-1, inter), (1, 16))
    scales = ((s13.view(e, n13, h // 16), 16), (s2.view(e, n2, inter // 16), 16))
    held = (dequantize(q, s, 1, 16).view(w.shape) for q, s, w in ((q13, s13, w13), (q2, s2, w2)))
    want = reference_experts(x, *held, weights, ids, act_groups=(16, 16))
    quantized = (q13.view(w13.shape), q2.view(w2.shape))
    got = fused_experts(*_on_gpu(x, *quantized, weights, ids), scales=_on_gpu(*scales)).cpu()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_fused_experts_refuse_activation_groups_no_k_step_can_take():
    """An activation group the grouped GEMM cannot step through (past the weight's scale block, no power of
    two, under 16) is refused by name, not run with the wrong scales."""
    from gapless.model.moe import WeightQuant
    from gapless.model.moe_triton import fused_experts

    x, (w13, _), (q13, q2), _, (weights, ids) = _fp8_experts(1)
    e, n13, h = w13.shape
    s13, s2 = (
        torch.ones(e, n13, h // 16, device=GPU),
        torch.ones(e, q2.shape[1], q2.shape[2] // 16, device=GPU),
    )
    for group in (32, 48, 8):
        scales = (WeightQuant(s13, 16, act_group=group), WeightQuant(s2, 16, act_group=group))
        with pytest.raises(ValueError, match=f"activation groups of {group} in scale blocks of 16"):
            fused_experts(*_on_gpu(x, q13, q2, weights, ids), scales=scales)


def test_fused_experts_over_fp8_weights_round_bf16_activations_as_float32_ones(monkeypatch):
    """Under bfloat16 activations the grouped GEMM rounds each tile to e4m3 from its bfloat16 values (no
    float16 in between, which W8A16 clamped them to): the reference on the same values, to bfloat16's
    rounding of the hidden rows; and an activation past float16's range only scales its group. (The
    kernel itself, not `fused_experts`' interpreter detour through float32, under which a bfloat16 dot
    would multiply raw bits.)"""
    from gapless.model import moe_triton
    from gapless.model.moe import reference_experts

    x, (w13, w2), (q13, q2), scales, (weights, ids) = _fp8_experts(1)
    x = x.bfloat16()
    monkeypatch.setattr(moe_triton, "INTERPRET", False)  # (bf16 into the kernel, as on a GPU)
    args, scales = _on_gpu(x, q13, q2, weights, ids), _on_gpu(*scales)
    got = moe_triton.fused_experts(*args, scales=scales).cpu()
    held = (_rows_rounded(w13), _rows_rounded(w2))
    want = reference_experts(x.float(), *held, weights, ids, act_groups=(32, 64))
    assert got.dtype == torch.bfloat16
    assert (got.float() - want).abs().max() <= 2e-2 * want.abs().max()
    args[0][2, 5] = 1e5  # (bfloat16 holds it; float16 does not)
    big = moe_triton.fused_experts(*args, scales=scales).cpu()
    x[2, 5] = 1e5
    want = reference_experts(x.float(), *held, weights, ids, act_groups=(32, 64))
    assert torch.isfinite(big).all()
    assert (big.float() - want).abs().max() <= 2e-2 * want.abs().max()


@pytest.mark.slow  # (sm_90 compiles in a child process, ~15 s)
def test_fused_fp8_experts_multiply_e4m3_by_e4m3_when_compiled():
    """Compiled for sm_90 at a checkpoint's widths ([128, 128] blocks: x rounded per 128 columns, each K
    step one block), bfloat16 activations: past 512 routed entries (64-row tiles, a prefill's) both GEMMs
    run fp8's own wgmma on e4m3 operands (`QGMMA ... E4M3.E4M3`), x rounded in registers
    (`F2FP.SATFINITE.E4M3`), nothing spilled; at a decode's 16-row tiles (mma.sync, both operands widened
    to float16, as the dense GEMM's) x is rounded the same way (bench/results/sm90_moe_fp8_cpu)."""
    from gapless.testing.triton_compile import compile_child

    script = (
        "import json, re, torch\n"
        "from gapless.model.moe import WeightQuant\n"
        "from gapless.model.moe_triton import fused_experts\n"
        "from gapless.testing.sass import cuobjdump, resources\n"
        "from gapless.testing.triton_compile import Compiler\n"
        "e, hidden, inter, out = 4, 256, 128, []\n"
        "w13 = torch.zeros(e, 2 * inter, hidden).to(torch.float8_e4m3fn)\n"
        "w2 = torch.zeros(e, hidden, inter).to(torch.float8_e4m3fn)\n"
        "s13, s2 = torch.ones(e, 2 * inter, hidden // 128), torch.ones(e, hidden, inter // 128)\n"
        "scales = (WeightQuant(s13, 128, act_group=128), WeightQuant(s2, 128, act_group=128))\n"
        "with Compiler(90) as c, torch.inference_mode():\n"
        "    for tokens in (300, 3):\n"
        "        ids = torch.arange(tokens * 2).remainder(e).view(tokens, 2)\n"
        "        x, weights = torch.zeros(tokens, hidden, dtype=torch.bfloat16), torch.ones(tokens, 2)\n"
        "        fused_experts(x, w13, w2, weights, ids, scales=scales)\n"
        "    for name, k in c.compiled:\n"
        "        if name == '_grouped_gemm_kernel':\n"
        "            sass = cuobjdump(k, '-sass')\n"
        "            out.append([len(re.findall(r'QGMMA\\.\\S+\\.E4M3\\.E4M3', sass)),\n"
        "                        sass.count('F2FP.SATFINITE.E4M3'), resources(k)['spill_bytes']])\n"
        "print(json.dumps([out, c.failed]))\n"
    )
    out = compile_child(script, "compiling the fp8 experts")
    if out is None:
        pytest.skip("this Triton has no NVIDIA backend to compile with")
    kernels, failed = json.loads(out.strip().splitlines()[-1])
    assert not failed and len(kernels) == 4, (kernels, failed)
    (gate_up, down), decode = kernels[:2], kernels[2:]
    assert all(wgmma > 0 and rounded > 0 and spills == 0 for wgmma, rounded, spills in (gate_up, down)), (
        kernels
    )
    assert all(wgmma == 0 and rounded > 0 for wgmma, rounded, _ in decode), kernels


# --- the layouts' arithmetic and the kernel ------------------------------------------------------------


def test_quantized_layouts_round_trip():
    w = torch.randn(70, 200)
    for q, s, rows, group in (
        (*quantize_rows(w), 1, 0),
        (*quantize_blocks(w, (32, 64)), 32, 64),
    ):
        assert q.dtype == FP8 and q.float().abs().max() <= FP8_MAX
        back = dequantize(q, s, rows, group)
        # e4m3's step near |w| is at most 2^-3 |w| (relative 2^-4 rounding), scaled per row or block
        assert ((back - w).abs() <= 2**-4 * w.abs() + 2**-9 * w.abs().max()).all()


def _exact_activations(m: int, k: int, group: int, seed: int = 0) -> torch.Tensor:
    """x whose every `group` columns of a row are e4m3 values times a power of two with one value at +-448:
    the kernel's scale is that power of two and x / scale is exact, so no e4m3 rounding happens."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(m, k, generator=g) * 60).clamp(-400, 400).to(FP8).float()
    q[:, ::group] = 448.0
    powers = 2.0 ** torch.randint(-12, -4, (m, -(-k // group)), generator=g).float()
    return q * powers.repeat_interleave(group, 1)[:, :k]


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the interpreter's run; on a GPU the next test runs the kernel"
)
@pytest.mark.parametrize("rows", [3, 20])
@pytest.mark.parametrize("block", [None, (32, 64), (1, 32)])  # ((1, 32): MXFP8's groups)
@pytest.mark.parametrize("exact", [True, False])
def test_triton_gemm_matches_the_reference_under_the_interpreter(rows, block, exact):
    """The GEMM (x rounded in its loop) gives the reference's result, on activations e4m3 holds exactly
    after scaling and on any (the interpreter's rounding is torch's: `fp8_rounding.round_rows`)."""
    n, k = 48, 192
    w = torch.randn(n, k) * 0.05
    q, s = quantize_rows(w) if block is None else quantize_blocks(w, block)
    rps, group = (1, 0) if block is None else block
    act = activation_group(k, group)
    x = _exact_activations(rows, k, act) if exact else torch.randn(rows, k) * 3
    bias = torch.randn(n)
    y = fp8_gemm(x, q, s, rps, group, act, bias)
    ref = reference_linear(x, dequantize(q, s, rps, group), act, bias)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the interpreter's run; on a GPU the next test runs the kernel"
)
@pytest.mark.parametrize("rows", [3, 33])
def test_decode_rows_split_k_and_leave_the_counters_at_rest(monkeypatch, rows):
    """Up to `SPLIT_ROWS` rows (a decode's 16-row tiles, and 64-row tiles at 33) K is cut over several
    programs per tile, the last to arrive adding the partial tiles: the same result as one program per
    tile (to fp32 rounding), and every counter back at 0. Past `SPLIT_ROWS`, one program per tile."""
    from gapless.model.quant import fp8_kernel, split_k

    n, k, act = 48, 448, 64  # 7 steps of 64: splits of 1 step each
    w = torch.randn(n, k) * 0.05
    q, s = quantize_blocks(w, (16, 64))
    x, bias = _exact_activations(rows, k, act, seed=1), torch.randn(n)
    assert fp8_kernel._splits(rows, 2, 7, x.device) == 7
    assert fp8_kernel._splits(fp8_kernel.SPLIT_ROWS + 1, 2, 7, x.device) == 1
    split = fp8_gemm(x, q, s, 16, 64, act, bias)
    assert int(split_k._COUNTERS[x.device].abs().sum()) == 0
    monkeypatch.setattr(fp8_kernel, "SPLIT_PROGRAMS", 1)
    assert fp8_kernel._splits(rows, 2, 7, x.device) == 1
    whole = fp8_gemm(x, q, s, 16, 64, act, bias)
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-5)
    ref = reference_linear(x, dequantize(q, s, 16, 64), act, bias)
    torch.testing.assert_close(split, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the interpreter's run; on a GPU the next test runs the kernel"
)
@pytest.mark.parametrize("by", ["launch", "program"])
@pytest.mark.parametrize("block", [None, (16, 64)])
def test_decode_rows_rounded_before_the_gemm_give_the_same_bits(monkeypatch, block, by):
    """At decode sizes x may be rounded to e4m3 before the GEMM's loop, by its own launch or by each
    program for its share of K (`DECODE_X`): the bits the loop's own rounding gives (so a row's result
    does not depend on how many rows ride with it), here on activations that are not exact in e4m3, K
    split over several programs a tile."""
    from gapless.model.quant import fp8_kernel

    n, k, act = 48, 200, 64  # K not a multiple of the group: a partial last group
    w = torch.randn(n, k) * 0.05
    q, s = quantize_rows(w) if block is None else quantize_blocks(w, block)
    rps, group = (1, 0) if block is None else block
    x, bias = torch.randn(5, k), torch.randn(n)
    monkeypatch.setattr(fp8_kernel, "SPLIT_PROGRAMS", 2)  # (one 16 x 64 tile, 4 groups: 2 splits of 2)
    assert fp8_kernel._splits(5, 1, 4, x.device) == 2
    monkeypatch.setattr(fp8_kernel, "DECODE_ROWS", 0)
    in_loop = fp8_gemm(x, q, s, rps, group, act, bias)
    monkeypatch.setattr(fp8_kernel, "DECODE_ROWS", 16)
    monkeypatch.setattr(fp8_kernel, "DECODE_X", by)
    assert torch.equal(fp8_gemm(x, q, s, rps, group, act, bias), in_loop)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the interpreter's run; on a GPU the next test runs the kernel"
)
@pytest.mark.parametrize("block", [None, (16, 64)])
def test_decode_rows_in_fp16_are_x_in_fp16_times_the_dequantized_weights(monkeypatch, block):
    """`GAPLESS_FP8_DECODE=fp16` (W8A16): a decode's x is not rounded to e4m3 but taken to float16, clamped to
    its range (a component past it counts as 65504), against the dequantized weights, K split; more rows
    than `DECODE_ROWS` are still rounded to e4m3."""
    from gapless.model.quant import fp8_kernel

    n, k, act = 48, 200, 64
    w = torch.randn(n, k) * 0.05
    q, s = quantize_rows(w) if block is None else quantize_blocks(w, block)
    rps, group = (1, 0) if block is None else block
    wd = dequantize(q, s, rps, group).double()
    x, bias = torch.randn(20, k) * 3, torch.randn(n)
    x[0, 3] = 1e6
    monkeypatch.setenv("GAPLESS_FP8_DECODE", "fp16")  # (what DECODE_X = None reads)
    y = fp8_gemm(x[:5], q, s, rps, group, act, bias)
    monkeypatch.setattr(fp8_kernel, "DECODE_X", "fp16")
    assert torch.equal(fp8_gemm(x[:5], q, s, rps, group, act, bias), y)
    ref = x[:5].clamp(-65504, 65504).half().double() @ wd.T + bias.double()
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-3)
    w8a8 = reference_linear(x[:5], wd.float(), act, bias)  # (e4m3's x: off by far more)
    assert (y - w8a8).abs().max() > 100 * (y.double() - ref).abs().max()
    x = _exact_activations(20, k, act)  # 20 rows: rounded to e4m3 in the loop, as without the setting
    torch.testing.assert_close(
        fp8_gemm(x, q, s, rps, group, act, bias), reference_linear(x, wd.float(), act, bias)
    )


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the interpreter's run; on a GPU the next test runs the kernel"
)
@pytest.mark.parametrize("tiles", [(64, 32, 4, 4), (64, 64, 4, 4)])
def test_decode_rows_in_the_sweeps_64_row_tiles_match_the_reference(monkeypatch, tiles):
    """The 64-row decode tiles `bench/experiments/fp8_gemm.py --sweep` times (fp8's own wgmma on sm_90)
    give the reference's result at 1 and 5 rows, x rounded before the loop either way or taken to fp16, K
    split."""
    from gapless.model.quant import fp8_kernel

    n, k, act = 80, 256, 64
    w = torch.randn(n, k) * 0.05
    q, s = quantize_rows(w)
    monkeypatch.setattr(fp8_kernel, "_tiles", lambda m: tiles)
    for rows in (1, 5):
        x, bias = _exact_activations(rows, k, act, seed=rows), torch.randn(n)
        ref = reference_linear(x, dequantize(q, s, 1, 0), act, bias)
        for by in ("launch", "program", "fp16"):  # (the activations are exact in e4m3 and fp16)
            monkeypatch.setattr(fp8_kernel, "DECODE_X", by)
            torch.testing.assert_close(fp8_gemm(x, q, s, 1, 0, act, bias), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the interpreter's run; on a GPU the next test runs the kernel"
)
@pytest.mark.parametrize("block", [None, (16, 64)])
def test_the_swapped_tiles_give_the_references_result(monkeypatch, block):
    """Up to `SWAPPED_ROWS` rows the tiles run swapped (W x^T, W's tile the dot's first operand; on sm_90
    fp8's wgmma with no widening), the GEMV off: the reference's result at 1 and 5 rows, per-channel and
    block scales, x rounded before the loop either way, in the loop or taken to fp16, K split, a partial
    last tile. `GAPLESS_FP8_SWAPPED` turns them on to 16 rows, x rounded by each program under `auto`."""
    from gapless.model.quant import fp8_kernel

    n, k, act = 80, 256, 64
    w = torch.randn(n, k) * 0.05
    q, s = quantize_rows(w) if block is None else quantize_blocks(w, block)
    rps, group = (1, 0) if block is None else block
    wd = dequantize(q, s, rps, group)
    monkeypatch.setattr(fp8_kernel, "SWAPPED_ROWS", 16)
    for rows in (1, 5):
        assert not fp8_kernel._plan(rows, n, k)[0]  # (no GEMV)
        x, bias = _exact_activations(rows, k, act, seed=rows), torch.randn(n)
        ref = reference_linear(x, wd, act, bias)
        for by in ("launch", "program", "fp16"):  # (the activations are exact in e4m3 and fp16)
            monkeypatch.setattr(fp8_kernel, "DECODE_X", by)
            torch.testing.assert_close(fp8_gemm(x, q, s, rps, group, act, bias), ref, rtol=1e-5, atol=1e-5)
        with monkeypatch.context() as loop:  # (x rounded in the loop: past DECODE_ROWS)
            loop.setattr(fp8_kernel, "DECODE_ROWS", 0)
            torch.testing.assert_close(fp8_gemm(x, q, s, rps, group, act, bias), ref, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(fp8_kernel, "SWAPPED_ROWS", None)  # GAPLESS_FP8_SWAPPED's then (default off)
    assert not fp8_kernel._swapped(1)
    monkeypatch.setenv("GAPLESS_FP8_SWAPPED", "1")
    assert fp8_kernel._swapped(16) and not fp8_kernel._swapped(17)
    monkeypatch.setattr(fp8_kernel, "DECODE_X", None)
    monkeypatch.delenv("GAPLESS_FP8_DECODE", raising=False)
    assert fp8_kernel._plan(1, n, k) == (False, 2)  # (`auto`: each program rounds its share, no launch)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the interpreter's run; on a GPU the next test runs the kernel"
)
@pytest.mark.parametrize(
    "block, bn, unroll, stages",
    [(None, 16, 1, 3), ((16, 64), 16, 2, 1), ((16, 64), 32, 1, 2), ((1, 32), 16, 1, 2)],
)
def test_the_gemv_gives_the_gemms_result(monkeypatch, block, bn, unroll, stages):
    """Up to `GEMV_ROWS` rows the GEMV on the CUDA cores runs instead of the tiles: per-channel scales
    (applied at the end), block scales one per tile a step (BN 16 inside a 16-row block) or one per row a
    step (BN 32 over two blocks), K split (in shares of an odd number of steps: two steps a loop
    iteration leave the last one's second masked), a partial last group and a partial last tile. x
    rounded by a launch or in the GEMV's registers: the same bits; the GEMM's result to fp32 rounding; in
    fp16 (W8A16), x in fp16 times the dequantized weights."""
    from gapless.model.quant import fp8_kernel, split_k

    n, k = 40, 150  # (3 steps of 64: with 3 rows of x, every tile's K split in 3)
    w = torch.randn(n, k) * 0.05
    q, s = quantize_rows(w) if block is None else quantize_blocks(w, block)
    rps, group = (1, 0) if block is None else block
    act = activation_group(k, group) if group == 32 else 64
    wd = dequantize(q, s, rps, group)
    monkeypatch.setattr(fp8_kernel, "SPLIT_PROGRAMS", 64)
    monkeypatch.setattr(fp8_kernel, "GEMV_TILES", (bn, 4, unroll, stages))
    x, bias = _exact_activations(3, k, act, seed=2), torch.randn(n)
    tiles = fp8_gemm(x, q, s, rps, group, act, bias)
    monkeypatch.setattr(fp8_kernel, "GEMV_ROWS", 3)
    monkeypatch.setattr(fp8_kernel, "DECODE_X", "launch")
    gemv = fp8_gemm(x, q, s, rps, group, act, bias)
    torch.testing.assert_close(gemv, tiles, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gemv, reference_linear(x, wd, act, bias), rtol=1e-5, atol=1e-5)
    with monkeypatch.context() as whole:  # (K not split: each program all of it)
        whole.setattr(fp8_kernel, "SPLIT_PROGRAMS", 1)
        torch.testing.assert_close(fp8_gemm(x, q, s, rps, group, act, bias), gemv, rtol=1e-5, atol=1e-5)
    x = torch.randn(3, k)  # (not exact in e4m3: the two roundings of x agree all the same)
    by_launch = fp8_gemm(x, q, s, rps, group, act, bias)
    monkeypatch.setattr(fp8_kernel, "DECODE_X", "program")
    assert torch.equal(fp8_gemm(x, q, s, rps, group, act, bias), by_launch)
    monkeypatch.setattr(fp8_kernel, "DECODE_X", "fp16")
    x[1, 5] = 1e6
    ref = x.clamp(-65504, 65504).half().double() @ wd.double().T + bias.double()
    in_fp16 = fp8_gemm(x, q, s, rps, group, act, bias)
    torch.testing.assert_close(in_fp16.double(), ref, rtol=1e-5, atol=1e-3)
    assert int(split_k._COUNTERS[x.device].abs().sum()) == 0
    monkeypatch.setattr(fp8_kernel, "GEMV_ROWS", None)  # GAPLESS_FP8_GEMV_ROWS's then (default 1)
    monkeypatch.setenv("GAPLESS_FP8_GEMV_ROWS", "3")
    assert torch.equal(fp8_gemm(x, q, s, rps, group, act, bias), in_fp16)
    monkeypatch.setenv("GAPLESS_FP8_GEMV_ROWS", "2")  # (3 rows: past it)
    assert not torch.equal(fp8_gemm(x, q, s, rps, group, act, bias), in_fp16)
    monkeypatch.setenv("GAPLESS_FP8_GEMV_ROWS", "3")
    monkeypatch.setattr(fp8_kernel, "GEMV_MAX_WEIGHTS", n * k - 1)  # (a weight past it: the tiles)
    assert not torch.equal(fp8_gemm(x, q, s, rps, group, act, bias), in_fp16)


def test_auto_rounds_x_in_the_gemvs_registers_and_by_a_launch_before_the_tiles(monkeypatch):
    """`GAPLESS_FP8_DECODE=auto` (the default): one row through the GEMV (`GAPLESS_FP8_GEMV_ROWS`'s
    default, 1) rounds x in its registers, with no rounding launch; more rows, up to `DECODE_ROWS`, through
    the tiles, by a launch first; either way the bits of the other rounding."""
    from gapless.model.quant import fp8_kernel

    launches = []

    class Counted:  # the rounding kernel, its launches counted
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    real = fp8_kernel._fp8_quant_kernel
    monkeypatch.setattr(fp8_kernel, "_fp8_quant_kernel", Counted())
    monkeypatch.delenv("GAPLESS_FP8_DECODE", raising=False)
    monkeypatch.delenv("GAPLESS_FP8_GEMV_ROWS", raising=False)
    n, k, act = 40, 128, 64
    q, s = quantize_rows(torch.randn(n, k) * 0.05)
    for m, rounded in ((1, []), (2, [(2, 2)])):
        x = torch.randn(m, k)
        auto = fp8_gemm(x, q, s, 1, 0, act, None)
        assert launches == rounded, m
        with monkeypatch.context() as other:  # (the other rounding: the same bits)
            other.setattr(fp8_kernel, "DECODE_X", "launch" if m == 1 else "program")
            assert torch.equal(fp8_gemm(x, q, s, 1, 0, act, None), auto)
        launches.clear()


@pytest.mark.slow  # (14 sm_90 compiles in a child process, ~10 s warm)
def test_mxfp8_groups_compile_for_sm90():
    """The GEMM (each tile shape, both dtypes) and the GEMV (x rounded each way, and fp16) with MXFP8's
    scales, a row's and 32 inputs', compile for sm_90 (`gapless.testing.triton_compile`), none failing."""
    from gapless.testing.triton_compile import compile_cases

    built = compile_cases("fp8", "mxfp8")
    if built is None:
        pytest.skip("this Triton has no NVIDIA backend to compile with")
    assert built.kernels == ["_fp8_gemm_kernel", "_fp8_gemv_kernel", "_fp8_quant_kernel"], built
    assert built.compilations == 14 and not built.failed, built


@pytest.mark.slow  # (sm_90 compiles in a child process, ~10 s)
def test_the_swapped_tiles_multiply_e4m3_on_fp8s_wgmma_when_compiled():
    """Compiled for sm_90 (bf16, one row, x by a launch): the swapped tiles run fp8's own wgmma on both
    operands in e4m3 (`QGMMA ... E4M3.E4M3`) with nothing widened (a few `F2FP` for the output: 4 with
    Triton 3.6 and 3.9), in fewer instructions than the 16-row tiles, which widen both operands to fp16
    for mma.sync (68 `F2FP`; 616-624 instructions against 648-680; their loop bodies 161 and 209 on
    Qwen3-8B's gate/up, for as many weight bytes)."""
    from gapless.testing.triton_compile import compile_child

    script = (
        "import re\n"
        "from gapless.testing.triton_compile import Compiler\n"
        "from gapless.testing.triton_cases import fp8_cases\n"
        "from gapless.testing.sass import cuobjdump, instruction_mix\n"
        "with Compiler(90) as c:\n"
        "    for name, case in fp8_cases().items():\n"
        "        if name.startswith('fp8 gemm 1 rows torch.bfloat16 channel, decode x launch'):\n"
        "            case()\n"
        "            k = c.compiled[-1][1]\n"
        "            sass = cuobjdump(k, '-sass')\n"
        "            fp8 = len(re.findall(r'QGMMA\\.\\S+\\.E4M3\\.E4M3', sass))\n"
        "            n = instruction_mix(k)['instructions']\n"
        "            print(name.split(', ')[-1], n, fp8, sass.count('F2FP'))\n"
    )
    out = compile_child(script, "compiling the FP8 tiles")
    if out is None:
        pytest.skip("this Triton has no NVIDIA backend to compile with")
    got = {line.rsplit(" ", 3)[0]: [int(v) for v in line.split()[-3:]] for line in out.splitlines()}
    (tiles, tiles_fp8, widened), (swapped, fp8, f2fp) = got["decode x launch"], got["swapped"]
    assert fp8 > 0 and f2fp <= 8 and swapped < tiles and tiles_fp8 == 0 and widened >= 64, got


@pytest.mark.slow  # (sm_90 compiles in a child process, ~20 s)
def test_the_gemvs_weights_stay_in_registers_when_compiled():
    """Compiled for sm_90 (the harness's stand-in driver), the GEMV multiplies on the CUDA cores (no
    matrix instruction) and its weight tile goes from its load to its multiply without crossing shared
    memory (a 64 x 128 e4m3 tile, 8 KB, did when x was a [1, BK] tile: the compiler moved W into x's
    layout), for each way of rounding x, each kind of weight scales (a row's, a block's, MXFP8's
    groups), one step or two a loop iteration, a gated activation or an RMSNorm made as x loads (then its
    weights' first bytes prefetched into L2 before its first load, as on a GPU); asked for stages, its
    loads go through asynchronous copies into shared memory, that many deep."""
    from gapless.testing.triton_compile import compile_child

    script = (
        "import json\n"
        "from unittest import mock\n"
        "from gapless.model.quant import fp8_kernel\n"
        "from gapless.testing.triton_compile import Compiler\n"
        "from gapless.testing.triton_cases import fp8_cases\n"
        "out = []\n"
        "first = lambda ptx: ptx.find('prefetch.global.L2') < ptx.find('ld.global')\n"
        "gpu = mock.patch.object(fp8_kernel, '_prefetches', lambda norm, device: norm is not None)\n"
        "with gpu, Compiler(90) as c:\n"
        "    for name, case in fp8_cases().items():\n"
        "        if 'gemv' in name and 'bfloat16' in name:\n"
        "            before = len(c.compiled)\n"
        "            case()\n"
        "            out += [[name, k.metadata.shared, 'mma' in k.asm['ptx'], 'cp.async' in k.asm['ptx'],\n"
        "                     'prefetch.global.L2' in k.asm['ptx'] and first(k.asm['ptx'])]\n"
        "                    for n, k in c.compiled[before:] if n == '_fp8_gemv_kernel']\n"
        "print(json.dumps(out))\n"
    )
    out = compile_child(script, "compiling the FP8 GEMV")
    if out is None:
        pytest.skip("this Triton has no NVIDIA backend to compile with")
    kernels = json.loads(out.strip().splitlines()[-1])
    assert len(kernels) == 19 and not any(mma for _, _, mma, _, _ in kernels), kernels
    for name, shared, _, copies, prefetched in kernels:
        if name.endswith("stages 3"):  # two 8 KB weight tiles ahead
            assert copies and shared >= 2 * 8192, (name, shared)
        else:
            assert not copies and shared < 4096, (name, shared)
        # normed: the weights' first bytes asked of L2 before any load (the norm's row's among them)
        assert prefetched == ("normed" in name), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (sm_89+)")
def test_triton_gemm_matches_the_reference_on_the_gpu():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 tensor cores need sm_89+")
    dev = torch.device("cuda")
    for rows, (br, bc) in itertools.product((1, 40, 300), ((128, 128), (1, 32))):  # ((1, 32): MXFP8's)
        w = torch.randn(512, 1024) * 0.05
        q, s = quantize_blocks(w, (br, bc))
        x = torch.randn(rows, 1024, dtype=torch.bfloat16)
        args = (x.to(dev), q.to(dev), s.to(dev), br, bc, bc, None)
        y = fp8_gemm(*args)
        ref = reference_linear(x.float(), dequantize(q, s, br, bc), bc, None)
        # e4m3 roundings at a tie may differ; bf16 output: relative 2^-8
        assert (y.float().cpu() - ref).abs().max() <= 0.02 * ref.abs().max(), (rows, br, bc)
        # one row: K split over 8 programs a tile, added in a fixed order (the same bits every call)
        assert torch.equal(fp8_gemm(*args), y)
    q, s = quantize_blocks(w, (128, 128))
    from gapless.model.quant import fp8_kernel, split_k

    # x rounded before the loop (`DECODE_ROWS`), by its own launch or by each program: the in-loop bits;
    # in fp16 (W8A16): x in fp16 times the dequantized weights, to bf16's rounding
    x = torch.randn(3, 1024, dtype=torch.bfloat16, device=dev)
    args = (x, q.to(dev), s.to(dev), 128, 128, 128, None)
    before = fp8_kernel.DECODE_ROWS, fp8_kernel.DECODE_X
    try:
        fp8_kernel.DECODE_ROWS = 0
        in_loop = fp8_gemm(*args)
        fp8_kernel.DECODE_ROWS = 16
        for by in ("launch", "program"):
            fp8_kernel.DECODE_X = by
            assert torch.equal(fp8_gemm(*args), in_loop), by
        fp8_kernel.DECODE_X = "fp16"
        ref = x.float().cpu() @ dequantize(q, s, 128, 128).T
        in_fp16 = fp8_gemm(*args)
        assert (in_fp16.float().cpu() - ref).abs().max() <= 0.01 * ref.abs().max()
        # the GEMV (`GEMV_ROWS`): x rounded by a launch or in its registers, the same bits; the tiles'
        # result to bf16's rounding; W8A16 as the tiles' fp16
        fp8_kernel.GEMV_ROWS = 3
        for by, tiles in (("launch", in_loop), ("program", in_loop), ("fp16", in_fp16)):
            fp8_kernel.DECODE_X = by
            gemv = fp8_gemm(*args)
            assert (gemv.float() - tiles.float()).abs().max() <= 0.01 * tiles.float().abs().max(), by
        fp8_kernel.DECODE_X = "launch"
        by_launch = fp8_gemm(*args)
        fp8_kernel.DECODE_X = "program"
        assert torch.equal(fp8_gemm(*args), by_launch)
        # the swapped tiles (`SWAPPED_ROWS`: fp8's wgmma on both e4m3 operands): the tiles' result to bf16's
        # rounding, x by a launch, by each program, in the loop, in fp16
        fp8_kernel.GEMV_ROWS, fp8_kernel.SWAPPED_ROWS = 0, 16
        for by, tiles in (("launch", in_loop), ("program", in_loop), ("fp16", in_fp16)):
            fp8_kernel.DECODE_X = by
            swapped = fp8_gemm(*args)
            assert (swapped.float() - tiles.float()).abs().max() <= 0.01 * tiles.float().abs().max(), by
        fp8_kernel.DECODE_ROWS = 0
        assert (fp8_gemm(*args).float() - in_loop.float()).abs().max() <= 0.01 * in_loop.float().abs().max()
    finally:
        fp8_kernel.DECODE_ROWS, fp8_kernel.DECODE_X = before
        fp8_kernel.GEMV_ROWS = fp8_kernel.SWAPPED_ROWS = None

    assert int(split_k._COUNTERS[y.device].abs().sum()) == 0  # every split tile's counter back at 0


# --- whole models -------------------------------------------------------------------------------------------


def _greedy(model, prompts, fused=False, **kw):
    # (an unquantized cache, which ModelOpt's layouts, naming an FP8 one, would otherwise get)
    engine = {"device": "cpu", "dtype": "float32", "kv_cache_tokens": 2048, "overlap": False, **kw}
    engine.setdefault("kv_cache_dtype", "bfloat16")
    with LLM(str(model), **engine) as llm:
        for module in experts_of(llm.engine.runner.model) if fused else ():
            module.use_triton = True  # (every mixture layer on the grouped GEMM: interpreted on the CPU)
        outs = llm.generate(
            prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True), use_tqdm=False
        )
    return [o.token_ids for o in outs]


@pytest.mark.parametrize(
    ("layout", "block", "device"),
    [
        ("fp8", (32, 32), "cpu"),
        ("fp8", (128, 128), "cpu"),
        ("ct-tensor", None, "cpu"),
        ("ct-channel", None, "cpu"),
        ("ct-block", (16, 32), "cpu"),
        ("fp8-tensor", None, "cpu"),
        ("modelopt", None, "cpu"),
        ("modelopt-channel", None, "cpu"),
        ("modelopt-block", (128, 128), "cpu"),
        ("fbgemm", None, "cpu"),
        ("ct-group", (1, 16), "cpu"),
        ("ct-mxfp8", (1, 32), "cpu"),
        ("modelopt-mxfp8", (1, 32), "cpu"),
        ("online", None, "cpu"),
        pytest.param("online", None, "cuda", marks=_CUDA, id="online-None-cuda"),
    ],
)
def test_fp8_greedy_equals_the_dequantized_float32_model(ckpt_factory, tmp_path, layout, block, device):
    """Qwen3 (fused q/k/v and gate/up, whose shards' scales are placed as their weights) in each layout
    (vLLM's and AutoFP8's per-tensor `quant_method: fp8` and ModelOpt's three among them, with the static
    `input_scale`s and KV-cache scales those carry); [128, 128] blocks on a 64-wide model are ragged (one
    partial block). Against transformers on the
    dequantized weights with its activations rounded as ours are: the same tokens but for float32
    summation-order near-ties. Against it with float activations (the issue's accuracy check): near-ties
    of the e4m3 activations' size, counted. On CUDA (the fused kernels, the GEMV at one row taking the
    norms' and the activation's inputs) near-ties of the rounded activations are accepted too."""
    src = ckpt_factory("qwen3")
    written = "ct-channel" if layout == "online" else layout  # at load, rows are scaled as ct-channel's
    dst, ref = write_fp8_checkpoint(src, tmp_path / layout, written, block or (128, 128))
    model, kw = (src, {"quantization": "fp8"}) if layout == "online" else (dst, {})
    loaded = loader.load_model(model, torch.float32, CPU, **kw)
    held = weights_held(loaded)[0]
    assert sum(n for f, n in held.items() if "fp8 e4m3" in f) == 8, held  # 4 projections x 2 layers
    methods = {"ct": "compressed-tensors", "modelopt": "modelopt", "fbgemm": "fbgemm_fp8"}
    assert quantization(loaded) == methods.get(layout.split("-")[0], "fp8")
    prompts = make_prompts(1000, n=4, max_len=40, shared_prefix=8)
    ours = _greedy(model, prompts, device=device, **kw)
    hf = load_hf_model(ref)
    with inputs_rounded(hf, block[1] if block else 0):
        tol = _tie_tolerance(device)
        same = [check_greedy(o, hf_greedy(hf, p, MAX_NEW), tol=tol) for o, p in zip(ours, prompts)]
    notes = [check_greedy(out, hf_greedy(hf, p, MAX_NEW), tol=NEAR_TIE) for out, p in zip(ours, prompts)]
    ties = [n for n in notes if n is not None]
    print(
        f"{layout} {block}: {len(ties)} of {len(prompts)} prompts diverged from float activations at a "
        f"near-tie: {ties}; with them rounded: {same}"
    )


def test_start_up_line_names_fp8(ckpt_factory, tmp_path):
    dst, _ = write_fp8_checkpoint(ckpt_factory("qwen3"), tmp_path / "q", "fp8", block=(32, 32))
    line = weights_summary(loader.load_model(dst, torch.float32, CPU))
    assert "8 fp8 e4m3 block 32x32" in line and "1 float32" in line, line  # the tied LM head stays float


def test_transformers_reads_the_tiny_fp8_checkpoint_as_we_do(ckpt_factory, tmp_path):
    """transformers' FineGrainedFP8 (dequantizing on a CPU) reads our `quant_method: fp8` file: its
    weights are the same dequantized weights our reference checkpoint holds."""
    dst, ref = write_fp8_checkpoint(ckpt_factory("llama"), tmp_path / "q", "fp8", block=(32, 32))
    try:
        theirs = load_hf_model(dst)
    except Exception as e:  # noqa: BLE001 - a transformers without FP8 on this device is a skip
        pytest.skip(f"transformers does not load quant_method=fp8 here: {type(e).__name__}: {e}")
    ours = load_file(str(ref / "model.safetensors"))
    for name, w in theirs.state_dict().items():
        if name in ours:
            torch.testing.assert_close(w.float(), ours[name], rtol=2**-8, atol=0, msg=name)


@pytest.mark.parametrize("layout", ["fp8", "ct-tensor", "modelopt-block", "ct-mxfp8"])  # (ModelOpt's: 4-D)
def test_tensor_parallel_ranks_hold_their_weights_scales(ckpt_factory, tmp_path, layout):
    """Built as rank r of 2, each fused and row-parallel layer holds the rows (or columns) of its weight
    and of its scales that rank 0 of 1 holds at the same places: scales are sharded with their weights.
    (ModelOpt's blocks are 128 wide: twice the width, so that each rank's input columns are whole blocks.)"""
    wide = 2 if layout == "modelopt-block" else 1
    src = ckpt_factory("llama", hidden_size=128 * wide, intermediate_size=256 * wide, head_dim=32 * wide)
    dst, _ = write_fp8_checkpoint(src, tmp_path / layout, layout, block=(32, 32))
    whole, ranks = load_as_ranks(dst)
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        full = whole.get_submodule(f"model.layers.0.{name}")
        w = dequantize(
            full.weight, full.weight_scale, full.linear_method.rows_per_scale, full.linear_method.k_group
        )
        parts = []
        for model in ranks:
            layer = model.get_submodule(f"model.layers.0.{name}")
            m = layer.linear_method
            parts.append(dequantize(layer.weight, layer.weight_scale, m.rows_per_scale, m.k_group))
        if name.endswith(("o_proj", "down_proj")):
            torch.testing.assert_close(torch.cat(parts, dim=1), w, rtol=0, atol=0)
        else:  # fused: each shard's rows split over the ranks
            layer = whole.get_submodule(f"model.layers.0.{name}")
            pieces = [w[off : off + n] for off, n in layer.shard_offsets.values()]
            mine = [torch.cat([p.chunk(2)[r] for p in pieces]) for r in range(2)]
            torch.testing.assert_close(torch.cat(parts), torch.cat(mine), rtol=0, atol=0)


@pytest.mark.parametrize(("layout", "block"), [("fp8", (16, 16)), ("ct-channel", None)])
def test_tensor_parallel_ranks_hold_their_experts_scales(ckpt_factory, tmp_path, layout, block):
    """A mixture's fp8 checkpoint built as rank r of 2: each rank's experts, dequantized with their scales,
    are its gate/up rows and down columns of the whole model's."""
    src = ckpt_factory("qwen3_moe", moe_intermediate_size=64)
    dst, _ = write_fp8_checkpoint(src, tmp_path / layout, layout, block=block or (128, 128))
    whole, ranks = load_as_ranks(dst)
    experts = [m.model.layers[0].mlp.experts for m in ranks]
    assert_experts_cut(whole.model.layers[0].mlp.experts, experts)


def test_dummy_load_format_reads_no_weights_and_quantizes_at_load(ckpt_factory, tmp_path):
    """`load_format="dummy"`: a directory with a config and a tokenizer only runs, its random weights
    quantized by `quantization="fp8"` (what bench/gpu_quant.sh does on the 8B shape)."""

    src = ckpt_factory("qwen3")
    shutil.copytree(src, tmp_path / "m", ignore=shutil.ignore_patterns("*.safetensors*"))
    opts = dict(device="cpu", kv_cache_tokens=256, overlap=False, load_format="dummy", quantization="fp8")
    with LLM(str(tmp_path / "m"), **opts) as llm:
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
        assert len(out[0].token_ids) == 3
        assert llm.engine.info.quantization == "fp8"
        assert dict(llm.engine.info.weight_formats)["fp8 e4m3 per-channel (quantized at load)"] == 8


@pytest.mark.parametrize(
    ("arch", "layout", "label"),
    [
        ("qwen3", "fp8", "fp8 e4m3 block 128x128"),  # Qwen's own *-FP8 (bench/gpu_quant.sh's 8B twin)
        ("qwen3", "ct-channel", "compressed-tensors fp8 e4m3 per-channel"),
        ("qwen3", "modelopt", "modelopt fp8 e4m3 per-tensor"),  # (said by hf_quant_config.json alone)
        ("qwen3_moe", "fp8", "fp8 e4m3 block 128x128"),
    ],
)
def test_dummy_load_format_holds_an_fp8_checkpoints_layers_in_its_layout(
    ckpt_factory, tmp_path, arch, layout, label
):
    """`load_format="dummy"` of an FP8 checkpoint's config (it has no tensors to name its quantized layers):
    the layers such checkpoints quantize (every linear but the routers and the head, the experts) hold
    e4m3 weights and scales in the config's layout, and the engine generates. Before, the load looked for
    the checkpoint's scales in files it does not have."""
    from gapless.model.moe import Experts
    from gapless.model.quant.fp8 import Fp8LinearMethod

    dst = tmp_path / "m"
    shutil.copytree(ckpt_factory(arch), dst, ignore=shutil.ignore_patterns("*.safetensors*"))
    qcfg = quant_config(layout, (128, 128))
    if layout == "modelopt":
        (dst / declared.MODELOPT_FILE).write_text(json.dumps(qcfg))
    else:
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps(dict(cfg, quantization_config=qcfg)))
    opts = dict(device="cpu", kv_cache_tokens=256, overlap=False, load_format="dummy")
    with LLM(str(dst), **opts) as llm:
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
        assert len(out[0].token_ids) == 3
        model, info = llm.engine.runner.model, llm.engine.info
    linears = [m for m in model.modules() if isinstance(m, layers._Linear)]
    fp8 = [m for m in linears if isinstance(m.linear_method, Fp8LinearMethod)]
    routers = [m for m in linears if isinstance(m, layers.ReplicatedLinear)]
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    assert dict(info.weight_formats)[label] == len(fp8) == len(linears) - len(routers) > 0
    assert all(m.weight.dtype == torch.float8_e4m3fn for m in fp8)
    assert not isinstance(model.lm_head.linear_method, Fp8LinearMethod)
    n, k = fp8[0].weight.shape
    # (a block's scale per block; a row's, and a tensor's, held per row: a fused layer's shards differ)
    assert tuple(fp8[0].weight_scale.shape) == ((-(-n // 128), -(-k // 128)) if layout == "fp8" else (n, 1))
    assert bool(experts) == (arch == "qwen3_moe")
    assert len(experts) == dict(info.weight_formats).get(f"{label} experts", 0), info.weight_formats


@pytest.mark.slow  # (two tensor-parallel rank processes a case, ~10 s each)
@pytest.mark.parametrize(("arch", "block"), [("llama", (32, 32)), ("qwen3_moe", (16, 16))])
def test_two_ranks_give_the_dequantized_models_tokens(ckpt_factory, tmp_path, arch, block):
    """Tensor parallelism over an fp8 checkpoint, end to end (gloo, one process per rank): q/k/v and
    gate/up cut by rows with their scales' blocks, o and down by input blocks, a mixture's experts
    likewise. Greedy tokens against transformers on the dequantized weights with its activations rounded
    as ours are; the ranks' all-reduce sums in another order, which may move an activation across an e4m3
    midpoint: at most one near-tie. (`--quantization fp8` scales each rank's piece of a row as it loads,
    so its model depends on the number of ranks; not this test's.)"""
    src = ckpt_factory(arch, moe_intermediate_size=64) if arch == "qwen3_moe" else ckpt_factory(arch)
    dst, ref = write_fp8_checkpoint(src, tmp_path / "q", "fp8", block)
    prompts = make_prompts(1000, n=3, max_len=30, shared_prefix=8)
    ours = _greedy(dst, prompts, tensor_parallel_size=2)
    hf = load_hf_model(ref)
    with inputs_rounded(hf, block[1]):
        notes = [check_greedy(o, hf_greedy(hf, p, MAX_NEW), tol=NEAR_TIE) for o, p in zip(ours, prompts)]
    assert sum(n is not None for n in notes) <= 1, notes


@pytest.mark.slow  # (two tensor-parallel rank processes, ~10 s)
def test_two_ranks_read_an_fp8_kv_cache_as_one_does(ckpt_factory, tmp_path):
    """`--kv-cache-dtype fp8` under tensor parallelism, with per-layer k/v scales from the checkpoint (the
    weights float, so that only the cache is rounded): each rank stores its heads' keys and values in
    e4m3 under the same scales, so two ranks' tokens are one rank's (only o's and down's all-reduce
    differ, in float32's last bits)."""
    dst = shutil.copytree(ckpt_factory("qwen3"), tmp_path / "scaled")
    scales = {
        f"model.layers.{i}.self_attn.{kv}_scale": torch.tensor(0.02 + 0.01 * i) for i in (0, 1) for kv in "kv"
    }
    save_file(
        load_file(str(dst / "model.safetensors")) | scales,
        str(dst / "model.safetensors"),
        metadata={"format": "pt"},
    )
    prompts = make_prompts(1000, n=3, max_len=30, shared_prefix=8)
    one, two = (_greedy(dst, prompts, kv_cache_dtype="fp8", tensor_parallel_size=n) for n in (1, 2))
    assert one == two
