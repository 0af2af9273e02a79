"""int4/int8 weight-only checkpoints on the CPU through torch's own kernels (`int4_kernels.CPU_KERNEL`,
what `GAPLESS_INT4_KERNEL=auto` gives a layer they take): each layer's product against the dequantized
matmul of its bfloat16-rounded activations, which layers they take, and whole models' greedy tokens against
transformers on the same weights dequantized, diverging at near-ties of the bfloat16 roundings only. (The
reference path, exact: test_quant_int4.py.)"""

from __future__ import annotations

import pytest
import torch

from gapless import LLM, SamplingParams
from gapless.model.moe import Experts
from gapless.model.quant import int4_kernels, weights_held
from gapless.model.quant.gguf_cpu import CpuInt4
from gapless.model.quant.int4 import Int4LinearMethod
from gapless.model.quant.int4_kernels import CPU_KERNEL, CpuInt8, CpuInt8Groups
from gapless.model.quant.int4_layouts import Int4Spec
from gapless.testing.hf_reference import check_greedy, hf_greedy, make_prompts
from gapless.testing.quant_checkpoints import layout_label, quantize, write_quantized

CPU = torch.device("cpu")
MAX_NEW = 8
# bfloat16 activations, scales and zeros move these tiny models' logits (std ~2) by a few hundredths; a
# greedy divergence is accepted where the reference's top-2 logits are within this, and counted
NEAR_TIE = 0.15


@pytest.mark.parametrize(
    ("bits", "group", "sym", "n", "library"),
    [
        (4, 32, False, 64, CpuInt4),
        (4, 128, True, 24, CpuInt4),  # 24 rows: padded to 32 for the packing, cut from the product
        # GPTQ's 2 and 3 bits held as 4: moved to the middle of 4 bits' range, where the kernel's
        # bfloat16 offset from 8 is small (at 0..3, 2 bits' error was 3-7% of the largest output)
        (2, 32, True, 64, CpuInt4),
        (2, 128, False, 64, CpuInt4),
        (3, 128, False, 64, CpuInt4),
        (8, -1, True, 64, CpuInt8),
        (8, -1, False, 40, CpuInt8),  # asymmetric: the zero's offset added through x's row sums
        (4, -1, False, 48, CpuInt8),  # 4 bits one group a row: widened to int8
        (8, 32, True, 64, CpuInt8Groups),  # 8 bits in groups: the int4 kernel over both nibbles
        (8, 128, False, 40, CpuInt8Groups),  # asymmetric: the zeros' bfloat16 rounding made up
    ],
)
@pytest.mark.parametrize("m", [1, 7])
def test_each_kernel_gives_the_dequantized_product(bits, group, sym, n, library, m):
    k = 256
    gen = torch.Generator().manual_seed(bits * 100 + n + m)
    w = quantize(torch.randn(n, k, generator=gen) * 0.05, bits, group, sym)
    spec = Int4Spec("gptq", max(bits, 4), group, sym, stored_bits=bits if bits < 4 else 0)
    method = Int4LinearMethod(w, spec, torch.float32, CPU)
    assert isinstance(method.library, library) and method.name.endswith(f"({CPU_KERNEL})")
    assert not method.triton_held  # the kernel's layout alone: no second copy
    x = torch.randn(m, k, generator=gen)
    want = x.bfloat16().float() @ w.dequantize().t()
    got = method.apply(torch.nn.Module(), x)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


@pytest.mark.parametrize("sym", [True, False])
def test_int8_groups_on_the_int4_kernel_lose_no_more_than_the_output_rounding(sym):
    """The two nibbles' products are summed in float32 inside the kernel: against the exact product of
    the bfloat16 activations with the weight (scales as held, in bfloat16), the error is the bfloat16
    output's rounding and no more (a bfloat16 rounding of each nibble's weight would add ~0.1% to its
    ~0.17%)."""
    gen = torch.Generator().manual_seed(7)
    w = quantize(torch.randn(512, 256, generator=gen) * 0.05, 8, 64, sym)
    x = torch.randn(64, 256, generator=gen).bfloat16().float()
    group_scale = w.scale.bfloat16().float().repeat_interleave(64, 1)
    exact = x @ ((w.q.float() - w.zero.repeat_interleave(64, 1)) * group_scale).t()

    def rms(err: torch.Tensor) -> float:
        return (err.pow(2).mean().sqrt() / exact.pow(2).mean().sqrt()).item()

    got = CpuInt8Groups(w)(x).float()
    assert rms(got - exact) <= 1.1 * rms(exact.bfloat16().float() - exact)


@pytest.mark.parametrize(
    ("bits", "group", "k"),
    [(8, 16, 256), (4, 16, 256), (8, -1, 48)],  # groups under 32; K no multiple of 32
)
def test_a_layer_the_kernels_do_not_take_keeps_the_reference_path(bits, group, k):
    w = quantize(torch.randn(16, k) * 0.05, bits, group, True)
    method = Int4LinearMethod(w, Int4Spec("gptq", bits, group, True), torch.float32, CPU)
    assert method.library is None and method.triton_held
    x = torch.randn(3, k)
    torch.testing.assert_close(
        method.apply(torch.nn.Module(), x), x @ w.dequantize().t(), rtol=1e-5, atol=1e-5
    )
    assert (
        int4_kernels.for_layer("auto", bits, w.q.shape[1] // w.scale.shape[1], torch.float32, 16, k, CPU)
        == "triton"
    )


def _greedy(model, prompts):
    with LLM(str(model), device="cpu", dtype="float32", kv_cache_tokens=2048, overlap=False) as llm:
        outs = llm.generate(
            prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True), use_tqdm=False
        )
    return [o.token_ids for o in outs]


@pytest.mark.parametrize(
    ("arch", "layout", "bits", "group", "sym", "act_order"),
    [
        ("qwen3", "awq", 4, 32, False, False),
        ("phi3", "gptq", 4, 64, True, True),  # fused q/k/v and gate/up, act-order: x gathered first
        ("llama", "int-quantized", 8, -1, False, False),  # W8A8 INT8, asymmetric, per row
        ("qwen3", "gptq", 8, 32, True, False),  # GPTQ int8 in groups (Qwen's *-GPTQ-Int8)
        ("llama", "compressed-tensors", 4, -1, False, False),  # w4a16 one group a row
        ("qwen3_moe", "awq", 4, 32, False, False),  # each expert's kernel in the reference loop
        ("qwen3_moe", "gptq", 4, 32, False, True),  # act-order experts: x gathered for each expert's kernel
        ("qwen3_moe", "int-quantized", 8, -1, True, False),
    ],
)
def test_greedy_tokens_equal_transformers_on_the_dequantized_weights(
    ckpt_factory, tmp_path, arch, layout, bits, group, sym, act_order
):
    from transformers import AutoModelForCausalLM

    qdir, refdir = write_quantized(
        ckpt_factory(arch), tmp_path, layout, bits=bits, group=group, sym=sym, act_order=act_order
    )
    g = "channel" if group < 0 else f"g{group}"
    with LLM(str(qdir), device="cpu", dtype="float32", kv_cache_tokens=256, overlap=False) as llm:
        formats = dict(llm.engine.info.weight_formats)
        held = weights_held(llm.engine.runner.model)[1]
        experts = [m for m in llm.engine.runner.model.modules() if isinstance(m, Experts)]
        assert all(m.gate_up_proj.numel() == m.down_proj.numel() == 0 for m in experts)  # (kernels alone)
    label = layout_label(layout, bits, group, sym, act_order)
    assert formats.get(f"{label} ({CPU_KERNEL})"), formats  # every quantized layer on the kernels
    if arch == "qwen3_moe":  # and every layer's experts
        assert formats.get(f"{label} ({CPU_KERNEL}) experts"), formats
    with LLM(str(refdir), device="cpu", dtype="float32", kv_cache_tokens=256, overlap=False) as llm:
        assert held < weights_held(llm.engine.runner.model)[1]  # the float model's weights
    prompts = make_prompts(1000, n=3, max_len=30, shared_prefix=8)
    ours = _greedy(qdir, prompts)
    ref = AutoModelForCausalLM.from_pretrained(str(refdir), dtype=torch.float32).eval()
    notes = [check_greedy(o, hf_greedy(ref, p, MAX_NEW), tol=NEAR_TIE) for o, p in zip(ours, prompts)]
    ties = [n for n in notes if n is not None]
    print(f"{layout} w{bits} {g}: {len(ties)} of {len(prompts)} prompts diverged at a near-tie: {ties}")
