"""x rounded to e4m3 by the kernel before an FP8 layer (`gapless.model.quant.base.RoundedRows`).

Where an FP8 layer would launch the rounding of its activations before its GEMM (2-128 rows, the tiles),
the fused RMSNorm and gated activation before it round them as they write them instead, with the GEMM's
own arithmetic (`fp8_rounding.round_rows`), so the layer computes the same bits without the launch. Without
a GPU the kernels run under Triton's interpreter (tests/conftest.py), whose own e4m3 conversion is off for
some values, so there `round_rows` rounds on the grid by hand (`fp8_rounding.fp8_grid`): torch's bits, which
the first test checks; on a GPU the other tests check the hardware's rounding.
"""

from __future__ import annotations

import pytest
import torch

from gapless.model import loader
from gapless.model.quant.base import PendingNorm, RoundedRows, attach_rounding, rounding_of
from gapless.model.quant.fp8 import activation_group, quantize_rows
from gapless.testing.triton import import_kernels_or_skip

fk = import_kernels_or_skip("gapless.model.fused.triton_kernels")

from gapless.model import fused  # noqa: E402
from gapless.model.quant import fp8_kernel  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
GPU_FP8 = not torch.cuda.is_available() or torch.cuda.get_device_capability() >= (8, 9)
pytestmark = pytest.mark.skipif(not GPU_FP8, reason="the FP8 GEMM needs sm_89+ on a GPU")


def _launched(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x's rows as the FP8 layer's own launch rounds them (`_fp8_quant_kernel`)."""
    m, k = x.shape
    q, s = fp8_kernel.rounding_buffers(m, k, group, x.device)
    fp8_kernel._fp8_quant_kernel[(m, s.shape[1])](x, q, s, k, x.stride(0), BK=group, PDL=False)
    return q, s


class _Counted:
    """`_fp8_quant_kernel` with its launches counted."""

    def __init__(self, real):
        self.real, self.launches = real, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.real[grid]


def _same_rounding(out: torch.Tensor, group: int) -> None:
    rows = rounding_of(out, group)
    assert rows is not None and rounding_of(out, group * 2) is None
    q, s = _launched(out.reshape(-1, out.shape[-1]), group)
    assert torch.equal(rows.q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(rows.scales, s)


def _rand(*shape: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="the interpreter's rounding; a GPU's divides as PTX does, not always torch's last bit",
)
@pytest.mark.parametrize("group", [16, 128])
def test_the_layers_launch_rounds_as_torch_does_bit_for_bit(group):
    """x rounded per row and group (`_fp8_quant_kernel`, `round_rows`) gives torch's e4m3 bits and scales
    (`fp8.quantize_groups`) over values spread across e4m3's whole range: those whose rounding carries into
    the next power of two (31.4 -> 32, which the interpreter's own conversion makes 16), e4m3's
    subnormals, zeros of either sign."""
    from gapless.model.quant.fp8 import quantize_groups

    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 256, generator=g) * torch.exp(torch.randn(24, 256, generator=g) * 3)
    x[0] = (x[0] * 0.1).clamp(-400, 400)
    x[0, :6] = torch.tensor([448.0, 31.4, -31.4, 1.97, -0.0, 0.0])  # (448: row 0's first scale is 1)
    x[0, 6:16] = 2.0 ** torch.arange(-12.0, -2.0)  # (under 2^-6 the subnormals, from 2^-9)
    q, s = _launched(x.to(DEVICE), group)
    want_q, want_s = quantize_groups(x, group)
    assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(s.cpu(), want_s)
    assert float(q[0, 1]) == 32.0 and float(q[0, 9]) == 2.0**-9  # (a carry; a subnormal)


@pytest.mark.parametrize(("n", "group"), [(200, 64), (256, 128), (12, 16)])
@pytest.mark.parametrize("kind", ["llama", "gemma"])
@torch.inference_mode()
def test_the_fused_norm_rounds_its_output_as_the_layers_launch_would(n, group, kind):
    """Rows whose width is no multiple of the group, and narrower than the smallest group."""
    x, res, w = _rand(3, n), _rand(3, n, seed=1), _rand(n, seed=2)
    plain, plain_res = fk.rms_norm(x, w, 1e-6, kind, res)
    out, new_res = fk.rms_norm(x, w, 1e-6, kind, res, round_group=group)
    assert torch.equal(out, plain) and torch.equal(new_res, plain_res)
    assert rounding_of(plain, group) is None
    _same_rounding(out, group)
    _same_rounding(fk.rms_norm(x, w, 1e-6, kind, round_group=group), group)  # (no residual)


@pytest.mark.parametrize(("n", "group"), [(1500, 128), (40, 64)])
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@torch.inference_mode()
def test_the_fused_activation_rounds_its_output_as_the_layers_launch_would(n, group, act):
    """Across several programs' blocks of a row (1,500 columns: two of 1,024), and one narrow block."""
    x = _rand(2, 2 * n)
    out = fk.act_and_mul(x, act, round_group=group)
    assert torch.equal(out, fk.act_and_mul(x, act))
    _same_rounding(out, group)


@torch.inference_mode()
def test_the_gemm_kernel_takes_x_rounded_before_it_instead_of_launching(monkeypatch):
    """Two rows through the tiles: with x's rounding given, the same bits and no rounding launch; a
    rounding of another shape refused by name; the GEMV (one row) rounds in its registers, never asks."""
    n, k, act = 48, 256, 128
    w, s = (t.to(DEVICE) for t in quantize_rows(torch.randn(n, k) * 0.05))
    x = _rand(2, k)
    rounded = _launched(x, act)
    counted = _Counted(fp8_kernel._fp8_quant_kernel)
    monkeypatch.setattr(fp8_kernel, "_fp8_quant_kernel", counted)
    assert fp8_kernel.rounds_before(2, n, k) and not fp8_kernel.rounds_before(1, n, k)
    want = fp8_kernel.fp8_gemm(x, w, s, 1, 0, act, None)
    assert counted.launches == 1
    assert torch.equal(fp8_kernel.fp8_gemm(x, w, s, 1, 0, act, None, rounded), want)
    assert counted.launches == 1
    with pytest.raises(ValueError, match=r"expected \(2, 256\) and \(2, 2\)"):
        fp8_kernel.fp8_gemm(x, w, s, 1, 0, act, None, (rounded[0][:1], rounded[1][:1]))
    monkeypatch.setenv("GAPLESS_FP8_UNFUSED_ROUNDING", "1")
    assert not fp8_kernel.rounds_before(2, n, k)


@pytest.mark.parametrize("by", ["program", "fp16"])
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@torch.inference_mode()
def test_the_gemv_takes_a_fused_gated_activation_as_it_loads_x(monkeypatch, act, by):
    """At one row the GEMV takes the gate/up projection's output [gate, up] and makes act(gate) * up as it
    loads x: the bits of the fused activation's output through the same GEMV (x rounded in its registers,
    or in fp16), with K split over programs and a partial last group; the tiles (two rows) are refused by
    name, and `GAPLESS_FP8_UNFUSED_ACTIVATION` turns it off."""
    n, k, act_group = 48, 200, 64
    w, s = (t.to(DEVICE) for t in quantize_rows(torch.randn(n, k) * 0.05))
    h, bias = _rand(1, 2 * k) * 3, _rand(n, seed=1)
    monkeypatch.setattr(fp8_kernel, "DECODE_X", by)
    assert fp8_kernel.takes_gated(1, n, k) and not fp8_kernel.takes_gated(2, n, k)
    assert fp8_kernel._splits(1, 1, 4, h.device) == 4
    want = fp8_kernel.fp8_gemm(fk.act_and_mul(h, act), w, s, 1, 0, act_group, bias)
    got = fp8_kernel.fp8_gemm(h, w, s, 1, 0, act_group, bias, gated=act)
    assert torch.equal(got, want)
    other = "silu" if act != "silu" else "gelu_pytorch_tanh"  # (the activation is what the kernel runs)
    assert not torch.equal(fp8_kernel.fp8_gemm(h, w, s, 1, 0, act_group, bias, gated=other), want)
    with pytest.raises(ValueError, match=r"no gated input at 2 rows of a weight \[48, 200\]"):
        fp8_kernel.fp8_gemm(_rand(2, 2 * k), w, s, 1, 0, act_group, bias, gated=act)
    monkeypatch.setenv("GAPLESS_FP8_UNFUSED_ACTIVATION", "1")
    assert not fp8_kernel.takes_gated(1, n, k)


def _same_product(got: torch.Tensor, want: torch.Tensor) -> None:
    """The same bits under the interpreter (both sides sum the squares alike); on a GPU the norm kernel's
    warps and the GEMV's may add a row's squares in another order (its rsqrt a step apart): close."""
    if DEVICE.type == "cpu":
        assert torch.equal(got, want)
    else:
        scale = float(want.float().abs().max())
        torch.testing.assert_close(got.float(), want.float(), rtol=0.0, atol=0.02 * scale)


@pytest.mark.parametrize("by", ["program", "fp16"])
@pytest.mark.parametrize("kind", ["llama", "gemma"])
@pytest.mark.parametrize("with_residual", [True, False])
@torch.inference_mode()
def test_the_gemv_takes_a_fused_rmsnorm_as_it_loads_x(monkeypatch, by, kind, with_residual):
    """At one row the GEMV takes an RMSNorm's input (`PendingNorm`): it adds the residual, writes the sum
    (the bits of the fused norm's new residual) and norms x as it loads it, giving the product of the
    fused norm's output through the same GEMV (x rounded in its registers, or in fp16), with K split over
    programs and a partial last group; another norm arithmetic gives other bits; two rows, and a norm
    with a gated input, are refused by name; `GAPLESS_FP8_UNFUSED_NORM` turns it off."""
    n, k, act_group, eps = 48, 200, 64, 1e-6
    w, s = (t.to(DEVICE) for t in quantize_rows(torch.randn(n, k) * 0.05))
    x, bias, weight = _rand(1, k) * 3, _rand(n, seed=1), _rand(k, seed=2)
    residual = _rand(1, k, seed=3) if with_residual else None
    monkeypatch.setattr(fp8_kernel, "DECODE_X", by)
    assert fp8_kernel.takes_norm(1, n, k) and not fp8_kernel.takes_norm(2, n, k)
    assert fp8_kernel._splits(1, 1, 4, x.device) == 4
    normed = fk.rms_norm(x, weight, eps, kind, residual)
    want = fp8_kernel.fp8_gemm(normed[0] if with_residual else normed, w, s, 1, 0, act_group, bias)
    out = torch.full_like(x, float("nan")) if with_residual else None
    norm = PendingNorm(x, residual, weight, eps, kind, out)
    _same_product(fp8_kernel.fp8_gemm(x, w, s, 1, 0, act_group, bias, norm=norm), want)
    if with_residual:
        assert torch.equal(out, normed[1])
    other = norm._replace(kind="llama" if kind == "gemma" else "gemma")
    assert not torch.equal(fp8_kernel.fp8_gemm(x, w, s, 1, 0, act_group, bias, norm=other), want)
    with pytest.raises(ValueError, match=r"no RMSNorm's input at 2 rows of a weight \[48, 200\]"):
        fp8_kernel.fp8_gemm(_rand(2, k), w, s, 1, 0, act_group, bias, norm=norm)
    with pytest.raises(ValueError, match=r"no RMSNorm's input at 1 rows"):
        fp8_kernel.fp8_gemm(torch.cat([x, x], 1), w, s, 1, 0, act_group, bias, gated="silu", norm=norm)
    monkeypatch.setenv("GAPLESS_FP8_UNFUSED_NORM", "1")
    assert not fp8_kernel.takes_norm(1, n, k)
    # compiled on a GPU (PDL off) the normed GEMV prefetches its weights into L2 before its norm's loads
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cuda = torch.device("cuda")
    assert fp8_kernel._prefetches(norm, cuda) and not fp8_kernel._prefetches(None, cuda)
    assert not fp8_kernel._prefetches(norm, torch.device("cpu"))


@torch.inference_mode()
def test_the_gemv_takes_a_fused_rmsnorm_of_each_of_several_rows(monkeypatch):
    """Up to `GEMV_ROWS` rows (3 here), x a view with rows wider than K: each row's norm and residual its
    own, as the fused norm writes them. No rows: an empty product, nothing launched (K was split over no
    tiles: a ZeroDivisionError)."""
    n, k, act_group, eps = 40, 256, 128, 1e-5
    w, s = (t.to(DEVICE) for t in quantize_rows(torch.randn(n, k) * 0.05))
    x, residual, weight = _rand(3, k + 8)[:, 8:], _rand(3, k, seed=1), _rand(k, seed=2)
    monkeypatch.setattr(fp8_kernel, "GEMV_ROWS", 3)
    monkeypatch.setattr(fp8_kernel, "DECODE_X", "program")
    normed, summed = fk.rms_norm(x.contiguous(), weight, eps, "llama", residual)
    out = torch.empty_like(residual)
    got = fp8_kernel.fp8_gemm(
        x, w, s, 1, 0, act_group, None, norm=PendingNorm(x, residual, weight, eps, "llama", out)
    )
    _same_product(got, fp8_kernel.fp8_gemm(normed, w, s, 1, 0, act_group, None))
    assert torch.equal(out, summed)
    none = PendingNorm(x[:0], residual[:0], weight, eps, "llama", out[:0])  # (no rows: nothing launched)
    assert fp8_kernel.fp8_gemm(x[:0], w, s, 1, 0, act_group, None, norm=none).shape == (0, n)


def test_a_rounding_travels_only_on_the_tensor_it_was_made_for():
    x = torch.zeros(2, 4)
    rows = RoundedRows(torch.zeros(2, 4, dtype=torch.float8_e4m3fn), torch.ones(2, 1), 4)
    assert attach_rounding(x, rows) is x and rounding_of(x, 4) is rows
    assert rounding_of(x.view(2, 4), 4) is None and rounding_of(x * 1, 4) is None


def _fp8_model(ckpt_factory):
    """The tiny Qwen3 with `--quantization fp8`, its layers on the Triton GEMM (on the CPU too, under the
    interpreter, not the reference)."""
    model = loader.load_model(ckpt_factory("qwen3"), torch.bfloat16, DEVICE, quantization="fp8")
    for module in model.modules():
        if getattr(getattr(module, "linear_method", None), "dequantized", None) is not None:
            module.linear_method.dequantized = None
    return model


@pytest.mark.parametrize("rows", [1, 3])
@torch.inference_mode()
def test_a_layer_with_fp8_linears_rounds_in_its_fused_norms_and_activation(ckpt_factory, monkeypatch, rows):
    """A Qwen3 layer quantized to FP8 (`--quantization fp8`) with the fused kernels and the Triton GEMM:
    at 3 rows the input norm rounds qkv's x, the post-attention norm gate/up's and the activation down's,
    leaving o's own launch alone, with the outputs' bits unchanged (against `GAPLESS_FP8_UNFUSED_ROUNDING=1`:
    four launches); at one row the GEMV rounds in its registers and nothing rounds before it."""
    model = _fp8_model(ckpt_factory)
    fused.set_fused(model, fk)
    layer = model.model.layers[0]
    cfg = model.cfg
    assert layer.mlp.down_proj.linear_method.act_group == activation_group(cfg.intermediate_size, 0)
    x, residual, attn = (
        _rand(rows, cfg.hidden_size),
        _rand(rows, cfg.hidden_size, seed=1),
        _rand(rows, cfg.q_size, seed=2),
    )
    counted = _Counted(fp8_kernel._fp8_quant_kernel)
    monkeypatch.setattr(fp8_kernel, "_fp8_quant_kernel", counted)

    def run() -> tuple[torch.Tensor, ...]:
        h, res = layer._add_norm(0, x, residual, layer.self_attn.qkv_proj)
        return (layer.self_attn.qkv_proj(h), *layer.after_attention(attn.view(rows, -1, cfg.head_dim), res))

    fused_out, fused_launches = run(), counted.launches
    monkeypatch.setenv("GAPLESS_FP8_UNFUSED_ROUNDING", "1")
    counted.launches = 0
    plain = run()
    for a, b in zip(fused_out, plain, strict=True):
        assert torch.equal(a, b)
    assert (fused_launches, counted.launches) == ((0, 0) if rows == 1 else (1, 4))


@torch.inference_mode()
def test_at_one_row_the_fp8_gemv_runs_the_mlps_activation_fused(ckpt_factory, monkeypatch):
    """A Qwen3 MLP quantized to FP8 with the fused kernels, at one row: the down projection's GEMV makes
    the activation as it loads x (no `act_and_mul` launch), the same bits as with the activation's launch
    (`GAPLESS_FP8_UNFUSED_ACTIVATION`); at 3 rows (the tiles), and with a LoRA adapter on the layer
    (which needs x itself), the launch stays."""
    model = _fp8_model(ckpt_factory)
    fused.set_fused(model, fk)
    mlp = model.model.layers[0].mlp
    calls = []
    real = fk.act_and_mul
    monkeypatch.setattr(fk, "act_and_mul", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    x = _rand(1, model.cfg.hidden_size)
    folded = mlp(x)
    assert calls == [] and mlp.down_proj.takes_gated(1) and not mlp.down_proj.takes_gated(3)
    monkeypatch.setenv("GAPLESS_FP8_UNFUSED_ACTIVATION", "1")
    assert torch.equal(mlp(x), folded) and calls == [1]
    monkeypatch.delenv("GAPLESS_FP8_UNFUSED_ACTIVATION")
    mlp(_rand(3, model.cfg.hidden_size))
    assert calls == [1, 3]
    monkeypatch.setattr(mlp.down_proj, "lora", object())
    assert not mlp.down_proj.takes_gated(1)


@torch.inference_mode()
def test_at_one_row_the_fp8_gemvs_run_the_layers_norms_fused(ckpt_factory, monkeypatch):
    """A Qwen3 layer quantized to FP8 with the fused kernels, at one row: qkv's and gate/up's GEMVs add the
    residual and norm x as they load it (no `rms_norm` launch), the outputs and the residual stream as
    with the norms' launches (`GAPLESS_FP8_UNFUSED_NORM`); the first layer's norm has no residual to add;
    at 3 rows (the tiles), and with a LoRA adapter on the layer (which needs the normed x), they stay."""
    model = _fp8_model(ckpt_factory)
    fused.set_fused(model, fk)
    layer, cfg = model.model.layers[0], model.model.layers[0].self_attn.cfg
    calls = []
    real = fk.rms_norm
    monkeypatch.setattr(fk, "rms_norm", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))

    def run(rows: int, first: bool = False) -> list[torch.Tensor]:
        x, residual = _rand(rows, cfg.hidden_size), _rand(rows, cfg.hidden_size, seed=1)
        attn = _rand(rows, cfg.q_size, seed=2).view(rows, -1, cfg.head_dim)
        h, res = layer._add_norm(0, x, None if first else residual, layer.self_attn.qkv_proj)
        return [layer.self_attn.qkv_proj(h), res, *layer.after_attention(attn, res)]

    for first in (False, True):
        folded = run(1, first)
        assert calls == [] and layer.self_attn.qkv_proj.takes_norm(1), first
        monkeypatch.setenv("GAPLESS_FP8_UNFUSED_NORM", "1")
        qkv, residual, mlp, after = run(1, first)
        _same_product(folded[0], qkv)
        _same_product(folded[2], mlp)
        assert torch.equal(folded[1], residual) and torch.equal(folded[3], after)  # (the residual stream)
        assert calls == [1, 1]
        monkeypatch.delenv("GAPLESS_FP8_UNFUSED_NORM")
        calls.clear()
    run(3)
    assert calls == [3, 3] and not layer.mlp.gate_up_proj.takes_norm(3)
    monkeypatch.setattr(layer.mlp.gate_up_proj, "lora", object())
    assert not layer.mlp.gate_up_proj.takes_norm(1) and layer.self_attn.qkv_proj.takes_norm(1)


@pytest.mark.slow  # (~6 s: every start-up probe under the interpreter, twice; the kit's CUDA step runs it)
@torch.inference_mode()
def test_the_start_up_check_runs_the_fused_rounding_into_the_mlp(ckpt_factory, monkeypatch):
    """`gapless.model.fused.disagreement` takes the norm into the MLP through the kernels: with FP8 layers
    their x rounded by the norm and activation agrees with the layers' own rounding, and a wrong rounding
    (scales off by 2) is found, so the model would run torch's kernels instead."""
    model = _fp8_model(ckpt_factory)
    assert fused.disagreement(model, fk, DEVICE) is None
    real = fk.act_and_mul

    def off_by_two(x, act, round_group=0, order=None):
        out = real(x, act, round_group, order)
        rows = rounding_of(out, round_group)
        return out if rows is None else attach_rounding(out, rows._replace(scales=rows.scales * 2))

    monkeypatch.setattr(fk, "act_and_mul", off_by_two)
    assert fused.disagreement(model, fk, DEVICE).startswith("norm_into_mlp: relative error")


@pytest.mark.slow  # (sm_90 compiles in a child process, ~20 s)
def test_the_rounding_norm_and_activation_compile_for_sm90():
    """Both ways the norm and activation write for the layer after them: x rounded for FP8, and x's
    columns in an int4 act-order layer's order (tests/model/test_ordered_columns.py); 2 dtypes each."""
    from gapless.testing.triton_compile import compile_cases

    built = compile_cases("fp8", "the norm and activation")
    if built is None:
        pytest.skip("this Triton has no NVIDIA backend to compile with")
    assert built.kernels == ["_act_and_mul_kernel", "_rms_norm_kernel"] and not built.failed, built
    assert built.compilations == 2 * 2 * 2, built  # (each kernel, each way, each dtype)
