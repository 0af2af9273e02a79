"""x in an int4 act-order layer's column order, written by the kernel before the layer
(`gapless.model.quant.base.OrderedColumns`).

An act-order layer reads x's columns in its weight's order (GPTQ `desc_act`: the inputs sorted by group).
Where the fused RMSNorm or gated activation writes x, it writes those columns in that order beside it,
with the same arithmetic, so the layer skips its own gather (one launch fewer a layer at decode); only
o's input, written by attention, is still gathered. (An MLP's down usually holds no order: its order is
taken onto gate/up's rows at load, `int4.takes_down_order`.) Without a GPU the kernels run under Triton's
interpreter (tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from gapless.model import loader
from gapless.model.layers import _Linear
from gapless.model.quant.base import OrderedColumns, attach_order, in_order
from gapless.testing.quant_checkpoints import write_quantized
from gapless.testing.triton import import_kernels_or_skip

fk = import_kernels_or_skip("gapless.model.fused.triton_kernels")

from gapless.model import fused  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16]


def _rand(*shape: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)


def _order(n: int, seed: int = 5) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def _carries(out: torch.Tensor, order: torch.Tensor) -> None:
    """`out` carries its own columns in `order`, bit for bit, for that order tensor alone."""
    carried = in_order(out, order)
    assert carried.data_ptr() != out.data_ptr() and torch.equal(carried, out[:, order])
    again = order.clone()  # (the same values, another tensor: gathered, not the carried copy)
    assert in_order(out, again).data_ptr() != carried.data_ptr()
    assert torch.equal(in_order(out, again), carried)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["llama", "fp32", "gemma"])
@pytest.mark.parametrize("n", [37, 256])
@torch.inference_mode()
def test_the_fused_norm_writes_its_columns_in_a_layers_order(dtype, kind, n):
    """With and without the residual add, odd and power-of-two widths: the norm and the residual as
    without an order, and the norm's columns in that order beside it."""
    x, res, w = _rand(3, n, dtype=dtype), _rand(3, n, dtype=dtype, seed=1), _rand(n, dtype=dtype, seed=2)
    order = _order(n)
    plain, plain_res = fk.rms_norm(x, w, 1e-6, kind, res)
    out, new_res = fk.rms_norm(x, w, 1e-6, kind, res, order=order)
    assert torch.equal(out, plain) and torch.equal(new_res, plain_res)
    _carries(out, order)
    _carries(fk.rms_norm(x, w, 1e-6, kind, order=order), order)  # (no residual)


@pytest.mark.parametrize("n", [1500, 40])
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@torch.inference_mode()
def test_the_fused_activation_writes_its_columns_in_a_layers_order(n, act):
    """Across several programs' blocks of a row (1,500 columns: two of 1,024), and one narrow block."""
    x, order = _rand(2, 2 * n), _order(n)
    out = fk.act_and_mul(x, act, order=order)
    assert torch.equal(out, fk.act_and_mul(x, act))
    _carries(out, order)


def test_an_order_travels_only_on_the_tensor_it_was_made_for():
    x, order = torch.arange(8.0).view(2, 4), torch.tensor([3, 1, 0, 2])
    assert torch.equal(in_order(x, order), x[:, order])  # (carries none: gathered)
    cols = OrderedColumns(torch.zeros(2, 4), order)  # (a marker: not x's columns)
    assert attach_order(x, cols) is x and in_order(x, order) is cols.x
    assert torch.equal(in_order(x.view(2, 4), order), x[:, order])  # (a new tensor: carries nothing)


class _CountedGathers:
    """`torch.Tensor.index_select` with its calls counted."""

    def __init__(self, monkeypatch):
        self.calls, real = 0, torch.Tensor.index_select

        def counted(t, *args, **kwargs):
            self.calls += 1
            return real(t, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "index_select", counted)


def _keep_downs_order(monkeypatch) -> None:
    """Loads after this keep each MLP's down in its own order (as where gate/up add a bias, or a rank's cut
    would split down's groups), so the gated activation writes x in it."""
    from gapless.model.quant import int4

    monkeypatch.setattr(int4, "takes_down_order", lambda gate_up, down, groups: False)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("down_keeps_its_order", [False, True])
@torch.inference_mode()
def test_an_act_order_layer_takes_x_in_order_from_its_fused_norms_and_activation(
    ckpt_factory, tmp_path, monkeypatch, rows, down_keeps_its_order
):
    """A Qwen3 layer of a GPTQ act-order checkpoint with the fused kernels: qkv and gate/up read x in
    their order as the norms wrote it, o gathers its own, and down reads x as it is (its order on gate/up's
    rows): 1 gather, against 3 when no kernel writes the order. Where down keeps its order, the activation
    writes x in it: 1 gather against 4. The outputs' bits unchanged."""
    if down_keeps_its_order:
        _keep_downs_order(monkeypatch)
    qdir, _ = write_quantized(ckpt_factory("qwen3"), tmp_path, "gptq", group=32, act_order=True)
    model = loader.load_model(qdir, torch.bfloat16, DEVICE)
    fused.set_fused(model, fk)
    layer, cfg = model.model.layers[0], model.cfg
    ordered = {n for n, m in layer.named_modules() if isinstance(m, _Linear) and m.input_order() is not None}
    assert ordered == {"self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj"} | (
        {"mlp.down_proj"} if down_keeps_its_order else set()
    )
    x, residual = _rand(rows, cfg.hidden_size), _rand(rows, cfg.hidden_size, seed=1)
    attn = _rand(rows, cfg.q_size, seed=2)

    def run() -> tuple[torch.Tensor, ...]:
        h, res = layer._add_norm(0, x, residual, layer.self_attn.qkv_proj)
        return (layer.self_attn.qkv_proj(h), *layer.after_attention(attn.view(rows, -1, cfg.head_dim), res))

    gathers = _CountedGathers(monkeypatch)
    in_order_out = run()
    assert gathers.calls == 1
    monkeypatch.setattr(_Linear, "input_order", lambda self: None)  # (no kernel writes the order)
    gathers.calls = 0
    plain = run()
    assert gathers.calls == len(ordered)
    for a, b in zip(in_order_out, plain, strict=True):
        assert torch.equal(a, b)


@torch.inference_mode()
def test_the_fused_start_up_check_runs_the_ordered_norm_into_the_mlp(ckpt_factory, tmp_path, monkeypatch):
    """`gapless.model.fused.disagreement` takes the norm into the MLP through the kernels: with act-order
    layers (down keeping its order, so the activation writes one) the columns the norm and activation
    write in order agree with the layers' own gathers, and a wrong order (columns shifted by one) is
    found, so the model would run torch's kernels instead."""
    _keep_downs_order(monkeypatch)
    qdir, _ = write_quantized(ckpt_factory("qwen3"), tmp_path, "gptq", group=32, act_order=True)
    model = loader.load_model(qdir, torch.bfloat16, DEVICE)
    assert fused.disagreement(model, fk, DEVICE) is None
    real = fk.act_and_mul

    def shifted(x, act, round_group=0, order=None):
        out = real(x, act, round_group, order)
        return (
            out
            if order is None
            else attach_order(out, OrderedColumns(in_order(out, order).roll(1, 1), order))
        )

    monkeypatch.setattr(fk, "act_and_mul", shifted)
    assert fused.disagreement(model, fk, DEVICE).startswith("norm_into_mlp: relative error")
