"""LoRA adapters over a quantized base model (the delta is added after the layer's own output, whatever its
weight format): greedy tokens equal `transformers` + `peft` on the same weights dequantized, on the int4
reference path exactly (AWQ, GPTQ with and without act-order, compressed-tensors, a mixture's experts),
over fp8 W8A8 exactly with peft's base inputs rounded as ours, and through torch's CPU int4 kernels (and
bitsandbytes' 4-bit one) but at near-ties of their bfloat16 roundings; and the adapter changes the base
model's tokens."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from gapless import LLM, LoRARequest, SamplingParams
from gapless.testing.fp8_checkpoints import inputs_rounded
from gapless.testing.hf_reference import check_greedy, hf_greedy, make_prompts
from gapless.testing.lora import ATTENTION, MLP, make_adapter, peft_model
from gapless.testing.quant_checkpoints import write_quantized

pytest.importorskip("peft", reason="the reference is transformers + peft")

MAX_NEW = 8
# torch's CPU int4 kernel rounds the activations, scales and zeros to bfloat16: with an adapter's deltas
# these tiny models' logits move by up to a few tenths (tests/model/test_int4_cpu.py's bound, doubled)
NEAR_TIE = 0.3


@pytest.mark.parametrize(
    ("arch", "layout", "kernel", "tol"),
    [
        ("qwen3", "awq", "triton", 1e-3),
        ("qwen3", "awq", "auto", NEAR_TIE),
        ("qwen3", "gptq", "triton", 1e-3),
        ("qwen3", "gptq-act", "triton", 1e-3),  # (x gathered into act-order's input order for the GEMM)
        ("qwen3", "compressed-tensors", "triton", 1e-3),
        ("qwen3_moe", "awq", "triton", 1e-3),  # (adapters on the stacked experts too)
        # (act-order experts: their intermediate reordered at load, the adapters' down A and gate/up B with
        # it; groups of 16, so that down's 32 inputs have an order)
        ("qwen3_moe", "gptq-act", "triton", 1e-3),
    ],
)
def test_an_adapter_over_int4_weights_equals_peft_on_the_dequantized_model(
    ckpt_factory, tmp_path, monkeypatch, arch, layout, kernel, tol
):
    monkeypatch.setenv("GAPLESS_INT4_KERNEL", kernel)  # (triton: the CPU's exact reference path)
    written, act_order = layout.removesuffix("-act"), layout.endswith("-act")
    src = ckpt_factory(arch)
    group = 16 if act_order and arch == "qwen3_moe" else 32
    qdir, refdir = write_quantized(src, tmp_path, written, bits=4, group=group, act_order=act_order)
    label = f"{written} w4a16"
    _adapter_equals_peft(qdir, refdir, tmp_path, label, tol)


def test_an_adapter_over_fp8_weights_equals_peft_on_the_dequantized_model(ckpt_factory, tmp_path):
    """Over an fp8 (W8A8) checkpoint the delta reads x unrounded, as peft's does: the reference is peft
    on the dequantized weights with its base layers' inputs rounded to e4m3 as gapless's are (its LoRA
    A/B, router and head not)."""
    from gapless.testing.fp8_checkpoints import write_fp8_checkpoint

    qdir, refdir = write_fp8_checkpoint(ckpt_factory("qwen3"), tmp_path / "q", "fp8", (32, 32))
    _adapter_equals_peft(qdir, refdir, tmp_path, "fp8 e4m3 block 32x32", 1e-3, rounded_group=32)


@pytest.mark.parametrize(("weights", "tol"), [("dequantize", 1e-3), ("auto", NEAR_TIE)])
def test_a_qlora_adapter_over_bitsandbytes_4bit_weights_equals_peft(
    ckpt_factory, tmp_path, monkeypatch, weights, tol
):
    """QLoRA's case: an adapter trained over a bitsandbytes NF4 base, served over that base (read as floats,
    or kept in 4 bits on bitsandbytes' CPU kernel where `auto` keeps them: x in bfloat16)."""
    from gapless.model.quant import bnb
    from gapless.testing.bnb_checkpoints import write_bnb

    monkeypatch.setenv("GAPLESS_BNB_WEIGHTS", weights)
    qdir, refdir = write_bnb(ckpt_factory("qwen3"), tmp_path, "nf4")
    label = "bitsandbytes nf4" if bnb.kept(torch.device("cpu")) else "float32"
    _adapter_equals_peft(qdir, refdir, tmp_path, label, tol)


def _adapter_equals_peft(
    qdir: Path, refdir: Path, tmp_path: Path, label: str, tol: float, rounded_group: int | None = None
) -> None:
    """An adapter made over the reference's weights: served over the quantized checkpoint (its layers in
    a format named `label`), greedy tokens equal peft's on the reference (`rounded_group`: its base layers'
    inputs rounded to e4m3 in groups of that many, as fp8 W8A8's are), and differ from the base's."""
    adapter = make_adapter(refdir, tmp_path / "adapter", ATTENTION + MLP, r=8, alpha=16, seed=1)
    prompts = make_prompts(500, n=4, shared_prefix=8, max_len=30)
    model = peft_model(refdir, adapter)
    rounding = inputs_rounded(model, rounded_group, _unrounded) if rounded_group is not None else None
    with rounding or contextlib.nullcontext():
        refs = [hf_greedy(model, p, MAX_NEW) for p in prompts]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    opts = dict(device="cpu", dtype="float32", kv_cache_tokens=512, overlap=False, enable_lora=True)
    with LLM(str(qdir), max_lora_rank=8, **opts) as llm:
        assert any(label in f for f in dict(llm.engine.info.weight_formats)), llm.engine.info.weight_formats
        lora = [LoRARequest("a", 1, str(adapter))] * len(prompts)
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
        base = llm.generate(prompts, params, use_tqdm=False)
    notes = [check_greedy(o.token_ids, r, tol=tol) for o, r in zip(outs, refs)]
    assert sum(n is not None for n in notes) <= 1, notes
    assert any(o.token_ids != b.token_ids for o, b in zip(outs, base))  # the adapter is applied


def _unrounded(name: str) -> bool:
    """Over fp8, peft's layers whose inputs stay unrounded: the adapter's A and B, the router, the head."""
    return "lm_head" in name or "lora_" in name or name.endswith(".gate")
