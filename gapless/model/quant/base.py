"""The linear-method interface and its default, the unquantized method."""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn


class LinearMethod(Protocol):
    """What a linear layer (or the LM head) computes its output with."""

    name: str  # the weight format, as start-up prints it (e.g. "float32", "Q4_1 as int4 g32")
    quant_method: str  # the format's family, vLLM's name where it has one ("fp8", "gguf", "unquantized")

    def apply(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        """`x W^T + b` for `layer`'s weight and bias, x of shape [..., in_features]."""
        ...

    def tensors(self) -> list[torch.Tensor]:
        """The tensors this method holds beyond the layer's parameters (its quantized weight, scales)."""
        ...

    # A method may also define `input_rounding(layer, rows) -> int`: the column group in which it would
    # round x of `rows` rows to e4m3 before its GEMM (0: it would not), for the kernel before the layer
    # to do it instead (`RoundedRows`); `_Linear.input_rounding` asks it. And `order` (a tensor or None):
    # the order it reads x's columns in (int4 act-order), for that kernel to write them so beside x
    # (`OrderedColumns`); `_Linear.input_order` asks it. And `takes_gated(layer, rows) -> bool`: whether its
    # `apply(layer, x, gated)` takes x as a gated activation's input, [gate, up] (the FP8 GEMV's), so the
    # activation's launch is left out; `_Linear.takes_gated` asks it. And `takes_norm(layer, rows) -> bool`:
    # whether its `apply(layer, x, norm=...)` takes x as an RMSNorm's input (`PendingNorm`), so the norm's
    # launch is left out; `_Linear.takes_norm` asks it.


class WeightKernel(Protocol):
    """One weight as a library's kernel holds it (`gapless.model.quant.int4_kernels`): called on rows x
    [M, K], x W^T [M, N]."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def tensors(self) -> list[torch.Tensor]:
        """What the kernel's layout holds."""
        ...


class RoundedRows(NamedTuple):
    """x's rows rounded to e4m3 by the kernel that wrote x (the fused RMSNorm or gated activation,
    `gapless.model.fused`), for the FP8 layer after it, which would otherwise launch that rounding itself:
    `q` [M, K] e4m3 and `scales` [M, ceil(K / group)] float32, x ~ q * scale per row and `group` columns.

    It travels on x itself (`attach_rounding`, `rounding_of`): whatever op comes between the two makes a
    new tensor without it, and the layer then rounds x as before, so a stale or mismatched rounding can
    never be read."""

    q: torch.Tensor
    scales: torch.Tensor
    group: int


_ROUNDED = "_gapless_rounded_rows"  # the attribute on x that carries its `RoundedRows`


def attach_rounding(x: torch.Tensor, rows: RoundedRows) -> torch.Tensor:
    """x, carrying `rows` (its own rounding) for the layer it feeds."""
    setattr(x, _ROUNDED, rows)
    return x


def rounding_of(x: torch.Tensor, group: int) -> RoundedRows | None:
    """The rounding x carries in columns of `group` (`attach_rounding`); None: none, or another group."""
    rows = getattr(x, _ROUNDED, None)
    return rows if rows is not None and rows.group == group else None


class PendingNorm(NamedTuple):
    """An RMSNorm left to the layer it feeds (`_Linear.takes_norm`: the FP8 GEMV at one row, which norms x
    as it loads it, with no launch before it). The layer's input is the norm of `x` + `residual` (of `x`
    alone where residual is None) by `weight` and `eps`, in the arithmetic `kind` (a `layers.RMS_NORMS`
    key); the layer also writes x + residual, the residual stream after the add, into `residual_out` (an
    empty tensor like the residual, which the norm returned as the new residual; None without one).

    It is not a tensor: whatever else would read it as the norm's output fails, it cannot read x unnormed."""

    x: torch.Tensor
    residual: torch.Tensor | None
    weight: torch.Tensor
    eps: float
    kind: str
    residual_out: torch.Tensor | None


class OrderedColumns(NamedTuple):
    """x's columns in a layer's input order (int4 act-order: x[:, order]), written beside x by the kernel
    that wrote x (the fused RMSNorm or gated activation), for the layer after it, which would otherwise
    gather them itself. It travels on x as `RoundedRows` does (`attach_order`, `in_order`)."""

    x: torch.Tensor
    order: torch.Tensor


_ORDERED = "_gapless_ordered_columns"  # the attribute on x that carries its `OrderedColumns`


def attach_order(x: torch.Tensor, cols: OrderedColumns) -> torch.Tensor:
    """x, carrying `cols` (its own columns in a layer's order) for the layer it feeds."""
    setattr(x, _ORDERED, cols)
    return x


def in_order(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """x [M, K]'s columns in `order`: those x carries for that very order tensor (`attach_order`), else
    gathered here (one small copy)."""
    cols = getattr(x, _ORDERED, None)
    return cols.x if cols is not None and cols.order is order else x.index_select(1, order)


class UnquantizedLinearMethod:
    """The layer's own float `weight` (and `bias`): the CPU's prepacked GEMM where `gapless.model.cpu_gemm`
    set one, else torch's GEMM. Stateless: one instance serves every layer."""

    name = quant_method = "unquantized"

    def apply(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        if layer.cpu_gemm is not None:
            return layer.cpu_gemm(x)
        bias = getattr(layer, "bias", None)
        # the decoder's activations are [tokens, features]: call the GEMM itself, as F.linear does for 2-D
        # input (the same kernel, bit for bit), without its dispatch layers (linear, matmul), which on a
        # CPU cost a share of a small model's decode step
        if x.dim() == 2:
            if bias is None:
                return torch.mm(x, layer.weight.t())
            return torch.addmm(bias, x, layer.weight.t())
        return F.linear(x, layer.weight, bias)

    def tensors(self) -> list[torch.Tensor]:
        return []  # the layer's own weight (and the prepacked copy `cpu_gemm` holds)


UNQUANTIZED = UnquantizedLinearMethod()


def weights_held(model: nn.Module) -> tuple[dict[str, int], int]:
    """(weight format -> how many layers hold it, bytes of all the weights the model holds): parameters,
    prepacked and quantized forms, a tensor two modules share counted once."""
    formats: dict[str, int] = {}
    held: dict[int, int] = {}  # storage (or opaque tensor) -> bytes
    for module in model.modules():
        tensors = [p for p in module.parameters(recurse=False) if p.numel()]
        method = getattr(module, "linear_method", None)
        if method is not None:
            label = method.name if method is not UNQUANTIZED else str(module.weight.dtype).split(".")[-1]
            formats[label] = formats.get(label, 0) + 1
            tensors += method.tensors()
            if getattr(method, "opaque_bytes", 0):  # a kernel's own packed form, no tensor
                held[id(method)] = method.opaque_bytes
            packed = getattr(getattr(module, "cpu_gemm", None), "packed", None)
            tensors += [packed] if packed is not None else []
        rows = getattr(module, "quantized_rows", None)
        tensors += rows.tensors() if rows is not None else []
        if (label := getattr(module, "weight_format", None)) is not None:  # a mixture's stacked experts
            formats[label] = formats.get(label, 0) + 1
            tensors += getattr(module, "side_tensors", list)()  # (`Experts.side_tensors`)
        for t in tensors:
            if t.is_mkldnn:  # oneDNN's packed weight: no storage to share
                held[id(t)] = t.numel() * t.element_size()
            else:
                held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return formats, sum(held.values())


def quantization(model: nn.Module) -> str | None:
    """The quantized formats the model's layers run (their `quant_method`s, and a mixture's int experts',
    joined by "+"); None: none."""
    methods = {getattr(m, "linear_method", UNQUANTIZED).quant_method for m in model.modules()}
    methods |= {m.quant_method for m in model.modules() if isinstance(getattr(m, "quant_method", None), str)}
    methods -= {UNQUANTIZED.quant_method, ""}
    return "+".join(sorted(methods)) or None


def weights_summary(model: nn.Module, ranks: int = 1) -> str:
    """One line for start-up: the bytes of weights and the format of the layers; under tensor
    parallelism (`ranks` > 1) a rank's share, said so."""
    formats, total = weights_held(model)
    kinds = ", ".join(f"{n} {label}" for label, n in sorted(formats.items()))
    each = f" on each of {ranks} ranks" if ranks > 1 else ""
    return f"weights: {total / 1e6:.1f} MB{each} ({kinds})"
