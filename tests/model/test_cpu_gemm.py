"""The CPU's prepacked GEMMs (`gapless.model.cpu_gemm`): a model loaded on the CPU in float32 runs its
linear layers and LM head on oneDNN-packed weights, within float32 reassociation of `F.linear`; other
dtypes, `GAPLESS_CPU_GEMM=plain` and a torch without the ops keep the plain path, saying why."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from gapless.model import cpu_gemm
from gapless.model.cpu_gemm import PackedLinear, pack_cpu_gemms
from gapless.model.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear, _Linear
from gapless.model.loader import load_model

# float32 sums of a few hundred products, reordered: ~1e-6 relative each, so well inside these
TOL = dict(rtol=1e-5, atol=1e-5)


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, (_Linear, ParallelLMHead))]


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear_at_every_row_count(bias: bool) -> None:
    """One packing (for 8 rows) computes x W^T + b at 0, 1, 3, 8 and 33 rows and on 3-D input, within
    float32 reassociation of `F.linear` on the loaded weight, whose storage the packing frees."""
    torch.manual_seed(0)
    layer = ColumnParallelLinear(96, 80, bias=bias)
    torch.nn.init.normal_(layer.weight)
    if bias:
        torch.nn.init.normal_(layer.bias)
    before = layer(torch.ones(1, 96))  # the plain path, before packing
    weight = layer.weight.detach().clone()
    pack_cpu_gemms(torch.nn.Sequential(layer))
    assert isinstance(layer.cpu_gemm, PackedLinear)
    assert layer.weight.numel() == 0  # the packed copy replaced it
    for x in [torch.randn(n, 96) for n in (0, 1, 3, 8, 33)] + [torch.randn(2, 5, 96)]:
        got = layer(x)
        assert got.shape == (*x.shape[:-1], 80)
        torch.testing.assert_close(got, F.linear(x, weight, layer.bias), **TOL)
    torch.testing.assert_close(layer(torch.ones(1, 96)), before, **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_a_lone_row_gets_its_result_among_other_rows_bit_for_bit(dtype: torch.dtype, bias: bool) -> None:
    """A one-row GEMM (a one-request decode) equals that row's result in a batch of 2, 5 or 33 rows (a
    speculative verify, a decode batch), bit for bit, on SmolLM2's down-projection shape, where oneDNN's
    own one-row kernel sums in another order: a lone row goes in as copies of itself.

    Except bfloat16 with a bias, on a CPU that computes bfloat16 (the GPU machine's 16-core AVX-512 Xeon
    of 2026-11-25; none here): the products' sums are still the same bits (bias=False passes there), but
    oneDNN adds the bias inside its float32 accumulator for some row counts and to the bfloat16 result for
    others, so the two differ by that rounding of the sum before the bias (at most a bfloat16 step of
    |sum| <= |result| + |bias|) and the result's own (a step of |result|). Adding
    the bias outside oneDNN in bfloat16 would make it bit for bit there too (a change to
    `gapless.model.cpu_gemm`, proposed to its owner)."""
    if dtype == torch.bfloat16 and not cpu_gemm.native_bf16():
        dtype = torch.float32  # bfloat16 is not packed there (the plain path is tested above)
    torch.manual_seed(4)
    layer = RowParallelLinear(1536, 576, bias=bias).to(dtype)
    torch.nn.init.normal_(layer.weight, std=0.02)
    if bias:
        torch.nn.init.normal_(layer.bias)
    pack_cpu_gemms(torch.nn.Sequential(layer))
    x = torch.randn(33, 1536, dtype=dtype)
    exact = dtype == torch.float32 or not bias
    for rows in (2, 5, 33):
        batch = layer(x[:rows])
        for r in range(rows):
            alone = layer(x[r : r + 1])
            if exact:
                assert torch.equal(alone, batch[r : r + 1])
            else:  # one rounding apart: within a bfloat16 step (2**-7 relative) of the sum and the result
                one = batch[r : r + 1].float()
                step = (2 * one.abs() + layer.bias.float().abs()) * 2**-7
                assert ((alone.float() - one).abs() <= step).all()


def test_load_model_packs_every_linear_and_the_lm_head_and_logits_agree(ckpt_factory, monkeypatch) -> None:
    """A tiny Qwen2 (q/k/v biases, tied head) loaded on the CPU in float32 has every projection and its LM
    head packed; its logits equal the plain-weight model's (`GAPLESS_CPU_GEMM=plain`) within float32."""
    path = ckpt_factory("qwen2")
    packed = load_model(path, torch.float32, torch.device("cpu"))
    monkeypatch.setenv(cpu_gemm.ENV, "plain")
    plain = load_model(path, torch.float32, torch.device("cpu"))
    layers = _layers(packed)
    assert len(layers) == 4 * packed.cfg.num_layers + 1
    assert all(isinstance(m.cpu_gemm, PackedLinear) for m in layers)
    assert all(m.cpu_gemm is None for m in _layers(plain))
    hidden = torch.randn(5, packed.cfg.hidden_size)
    torch.testing.assert_close(packed.logits(hidden), plain.logits(hidden), **TOL)
    # the packed copy replaces each loaded weight, except the tied head's (it is the embedding table)
    assert packed.lm_head.weight is packed.model.embed_tokens.weight
    assert packed.model.embed_tokens.weight.numel() == packed.cfg.vocab_size * packed.cfg.hidden_size
    assert all(m.weight.numel() == 0 for m in layers if m is not packed.lm_head)


@pytest.mark.parametrize("case", ["float16", "bf16_emulated", "plain", "no_onednn", "no_ops", "probe_fails"])
def test_plain_path_kept_where_packing_does_not_apply(case: str, monkeypatch, caplog) -> None:
    """float16, bfloat16 on a CPU without its instructions, turned off, or a torch without oneDNN or its
    ops (torch builds differ): nothing is packed, the layers still compute, and the log says why."""
    dtype = {"float16": torch.float16, "bf16_emulated": torch.bfloat16}.get(case, torch.float32)
    if case == "bf16_emulated":
        monkeypatch.setattr(cpu_gemm, "native_bf16", lambda: False)
    elif case == "plain":
        monkeypatch.setenv(cpu_gemm.ENV, "plain")
    elif case == "no_onednn":
        monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    elif case == "no_ops":
        monkeypatch.setattr(cpu_gemm, "_OPS", ("_reorder_linear_weight", "_no_such_op"))
    elif case == "probe_fails":

        def broken(*args: object) -> torch.Tensor:
            raise RuntimeError("no primitive for this ISA")

        monkeypatch.setattr(PackedLinear, "__call__", broken)
    model = torch.nn.Sequential(
        ColumnParallelLinear(16, 24, bias=True), RowParallelLinear(24, 16), ParallelLMHead(40, 16)
    ).to(dtype)
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.2)  # the bias too (torch.empty); float16 stays finite
    with caplog.at_level(logging.INFO, logger="gapless.model.cpu_gemm"):
        pack_cpu_gemms(model)
    assert all(m.cpu_gemm is None for m in model)
    reason = {
        "float16": "dtype torch.float16",
        "bf16_emulated": "without AVX512-BF16 or AMX",
        "plain": "GAPLESS_CPU_GEMM=plain",
        "no_onednn": "without oneDNN",
        "no_ops": "_no_such_op",
        "probe_fails": "no primitive for this ISA",
    }[case]
    assert "weights not prepacked" in caplog.text and reason in caplog.text
    x = torch.randn(3, 16, dtype=dtype)
    want = F.linear(F.linear(F.linear(x, model[0].weight, model[0].bias), model[1].weight), model[2].weight)
    assert torch.equal(model(x), want)


@pytest.mark.skipif(not cpu_gemm.native_bf16(), reason="needs a CPU with AVX512-BF16 or AMX")
def test_bfloat16_is_packed_where_the_cpu_computes_it() -> None:
    """bfloat16 weights on a CPU with bf16 dot products are packed; the result is the plain GEMM's within
    bfloat16 rounding of the output (both accumulate in float32)."""
    torch.manual_seed(3)
    layer = ColumnParallelLinear(128, 64, bias=True).to(torch.bfloat16)
    torch.nn.init.normal_(layer.weight, std=0.1)
    torch.nn.init.normal_(layer.bias)
    weight = layer.weight.detach().clone()
    pack_cpu_gemms(torch.nn.Sequential(layer))
    assert isinstance(layer.cpu_gemm, PackedLinear)
    x = torch.randn(8, 128, dtype=torch.bfloat16)
    torch.testing.assert_close(layer(x), F.linear(x, weight, layer.bias))
