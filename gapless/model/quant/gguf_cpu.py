"""GGUF's quantized matrices kept quantized on the CPU, through torch's quantized kernels.

A matrix is read from the file as its blocks (`GGUFBlocks`, the bytes as stored, rows in Hugging Face
order) and converted, without a float copy of the whole weight, into one of two layouts (which layer takes
which: `int4_for`; by default, on an AVX-512 CPU, int4 wherever exact, elsewhere int4 for the gate/up
projections of int4 types and int8 rows for the rest: `layout`):

- **int4, groups of 32** (`Int4LinearMethod`, `torch.ops.aten._weight_int4pack_mm_for_cpu`): Q4_0, Q4_1
  and Q4_K, whose blocks are all `w = q * scale + offset` over 32 weights with a 4-bit q, which is the
  kernel's `w = (q - 8) * scale + zero` with `zero = offset + 8 * scale`. The 4-bit values are exact; the
  kernel takes its scales and zeros in bfloat16, so each group's scale and zero are rounded to bfloat16
  (f16 in the file: 3 bits of mantissa lost, <= 2^-8 relative). The activations go in as bfloat16.
- **int8, one scale per row** (`Int8Rows`): every other type (Q8_0, Q5_0, Q5_1, Q2_K, Q3_K, Q5_K, Q6_K),
  which have no exact image in a 4-bit layout and whose per-block scales no int8 kernel here (one scale
  per output row) can hold, and the int4 types' layers that `int4_for` runs faster as int8. Each row is
  dequantized (in chunks of rows) and requantized to `round(w / s)` with `s` its largest |w| / 127
  rounded up to bfloat16: a rounding of at most s/2 per weight, against the file's own step (Q8_0: its
  block's max / 127). Two kernels run it (`GAPLESS_GGUF_ACTIVATIONS`):
  - `int8` (default, `Int8DynamicLinearMethod`): fbgemm's int8 x int8 GEMM
    (`torch.ops.quantized.linear_dynamic`), as llama.cpp quantizes activations to 8 bits: a decode step
    of 32 rows 1.28x (1.46x with every layer int8 rows) the weight-only kernels', of one row 0.9x
    (`bench/results/gguf_int8_act/step_layouts.log`). fbgemm quantizes its input over one range for the
    whole batch and, on AVX2, to 7 bits; taken as it is, that raised the default model's perplexity from
    29.7 to 79.8, and over one range per row to 31.9 (prototypes of this class, their logs not kept). So
    each row is scaled to its own range, pinned to [-1, 1] by one extra row, and split into its 7-bit
    value and the remainder, both rows of the same GEMM: per row, ~14 bits (29.77:
    `bench/results/gguf_int8_act/quality_mixed.log`), and a row's result does not depend on the other
    rows of its batch.
  - `bfloat16` (`Int8LinearMethod`): `torch.ops.aten._weight_int8pack_mm`, the activations as bfloat16.

Both weight-only kernels are vectorized on x86 for bfloat16 activations only (float32 runs a scalar loop
~10x slower), so the activations go in as bfloat16 and the result, computed in float32 inside the kernel
and returned as bfloat16, comes back as float32. Tests compare against the dequantized float model
(tests/model/test_quant_gguf.py), greedy tokens equal or diverging at near-ties only.

`GAPLESS_GGUF_LAYOUT=groups` keeps no layer here: every projection goes the GPU's way
(`gapless.model.quant.gguf_int4`), each type in its own values and groups, on torch's CPU int4 kernel.

Embedding tables are read from the file where they lie (`FileRows`: the blocks memory-mapped, as llama.cpp
reads them, each lookup dequantizing its rows), so a tied LM head's own layout holds the table's weights
once.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from gapless import env
from gapless.model import opaque_gemm
from gapless.model.quant.gguf_blocks import (
    GROUP,
    QUANTIZED_TYPES,
    GGUFBlocks,
    dequantize_rows,
    int4_parts,
    int8_rows,
    is_int4,
    label,
)

LAYOUT_ENV = env.GGUF_LAYOUT.name  # "auto" (default), "mixed", "int4", "int8", "groups": see `layout`
ACTIVATIONS_ENV = env.GGUF_ACTIVATIONS.name  # "int8" (default) or "bfloat16": the int8 rows' kernel
_ROW_MULTIPLE = 16  # the int4 packing's N must be a multiple of this; other shapes are padded with zero rows

# the kernels' overloads, looked up once (a decode step calls them ~120 times, and on a CPU each Python-side
# lookup through `torch.ops` is a visible cost)
_INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu.default
_INT8_MM = torch.ops.aten._weight_int8pack_mm.default


def _finish(y: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The kernel's bfloat16 result `y` plus the float32 bias, in `dtype`: one op where it can be."""
    if bias is not None:
        y = torch.add(bias, y)  # float32
    return y if y.dtype == dtype else y.to(dtype)


class CpuInt4:
    """A weight of 4-bit values `q` [N, K] (0..15) with `w = (q - 8) * scale + zero` per `group` columns
    (scale and zero [N, K / group]), as torch's CPU int4 GEMM holds it (`_weight_int4pack_mm_for_cpu`:
    groups of 32, 64, 128 or 256, scales and zeros in bfloat16, N a multiple of 16, so the rows are padded).
    Called on rows x [M, K], it returns x W^T [M, N] in bfloat16, x taken as bfloat16."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int) -> None:
        n = q.shape[0]
        self.out_features, self.group = n, group
        pad = -n % _ROW_MULTIPLE
        if pad:
            q = torch.cat([q, torch.full((pad, q.shape[1]), 8, dtype=q.dtype)])
            scale, zero = (torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (scale, zero))
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        self.scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
        self.padded = bool(pad)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = _INT4_MM(x.to(torch.bfloat16), self.packed, self.group, self.scales_zeros)
        return y[:, : self.out_features] if self.padded else y

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed, self.scales_zeros]


class Int4LinearMethod:
    """Weight-only int4 GEMM, groups of 32 (see the module's docstring). `parts`: the matrices whose rows
    the layer's weight stacks (a fused q/k/v or gate/up), each of an int4 type."""

    quant_method = "gguf"

    def __init__(self, parts: list[GGUFBlocks], bias: torch.Tensor | None) -> None:
        self.name = f"{label(parts)} as int4 g{GROUP}"
        q, scale, zero = (torch.cat(t) for t in zip(*(int4_parts(p) for p in parts)))
        self.weight = CpuInt4(q, scale, zero, GROUP)
        self.out_features = q.shape[0]
        self.bias = None if bias is None else bias.detach().float()

    def apply(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self.apply(layer, x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.out_features)
        return _finish(self.weight(x), self.bias, x.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return self.weight.tensors()


class Int8Rows:
    """int8 rows with one bfloat16 scale each: the int8 GEMMs' weight."""

    def __init__(self, parts: list[GGUFBlocks]) -> None:
        self.qtype = label(parts)
        q, scale = zip(*(int8_rows(p) for p in parts))
        self.q, self.scale = torch.cat(q), torch.cat(scale)

    def tensors(self) -> list[torch.Tensor]:
        return [self.q, self.scale]


class Int8LinearMethod:
    """Weight-only int8 GEMM, one scale per output row (see the module's docstring)."""

    quant_method = "gguf"

    def __init__(self, rows: Int8Rows, bias: torch.Tensor | None) -> None:
        self.name = f"{rows.qtype} as int8 per-row"
        self.rows = rows
        self.out_features = rows.q.shape[0]
        self.bias = None if bias is None else bias.detach().float()

    def apply(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self.apply(layer, x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.out_features)
        return _finish(_INT8_MM(x.to(torch.bfloat16), self.rows.q, self.rows.scale), self.bias, x.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return self.rows.tensors()


class FileRows:
    """An embedding table read from its GGUF blocks where they lie (a memory-mapped file): a lookup
    dequantizes the rows it asks for (`dequantize_rows`)."""

    def __init__(self, blocks: GGUFBlocks) -> None:
        self.qtype, self.blocks = blocks.qtype, blocks

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `ids` in `dtype` (computed in float32)."""
        b = self.blocks
        picked = GGUFBlocks(b.qtype, b.cols, b.data[ids.reshape(-1).cpu().numpy()])
        return dequantize_rows(picked, 0, picked.rows).view(*ids.shape, b.cols).to(dtype)

    def tensors(self) -> list[torch.Tensor]:
        return []  # the file's pages, not held


def has_int8_gemm() -> bool:
    """Whether this torch has fbgemm's int8 GEMM (x86 builds); elsewhere int8 rows take bfloat16
    activations."""
    engines = torch.backends.quantized.supported_engines
    return ("fbgemm" in engines or "x86" in engines) and hasattr(torch.ops.quantized, "linear_dynamic")


_DYN_MM: Any = torch.ops.quantized.linear_dynamic.default if has_int8_gemm() else None
_PINS: dict[int, torch.Tensor] = {}  # width -> the row that pins fbgemm's input range to [-1, 1]
_Q = 63.5  # fbgemm's 7-bit input grid over [-1, 1]: q / 63.5 for integers q in [-64, 63]
_C_SPAN, _C_Q, _C_HI, _C_2 = (torch.tensor(c) for c in (1.01, _Q, 1 / _Q, 2.0))


def _pin(cols: int) -> torch.Tensor:
    if cols not in _PINS:
        _PINS[cols] = torch.zeros(1, cols)
        _PINS[cols][0, :2] = torch.tensor([1.0, -1.0])
    return _PINS[cols]


class Int8DynamicLinearMethod:
    """int8 weights (one scale per output row) times int8 activations: fbgemm's dynamic-quantized linear,
    each row over its own range and in two parts (see the module's docstring)."""

    quant_method = "gguf"

    def __init__(self, rows: Int8Rows, bias: torch.Tensor | None) -> None:
        self.name = f"{rows.qtype} as int8 per-row, int8 activations"
        n = self.out_features = rows.q.shape[0]
        with warnings.catch_warnings():  # torch marks its quantized tensors deprecated; this is the way in
            warnings.simplefilter("ignore", UserWarning)
            qw = torch._make_per_channel_quantized_tensor(
                rows.q, rows.scale.double(), torch.zeros(n, dtype=torch.long), 0
            )
        self.packed = torch.ops.quantized.linear_prepack(qw, None)  # fbgemm's own layout, ~1 byte a weight
        self.opaque_bytes = rows.q.numel() + 8 * n
        self.bias = None if bias is None else bias.detach().float()
        self.handle = opaque_gemm.register(self)
        # made here, not at the first call: a compiled graph traced before it existed would be traced again
        self.pin = _pin(rows.q.shape[1])

    def apply(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self.apply(layer, x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.out_features)
        n = x.shape[0]
        x32 = x if x.dtype == torch.float32 else x.float()
        # each row over its own span: t = x * 63.5 / span lies within (-63.5, 63.5), so that its rounding
        # r is on fbgemm's grid (exact there) and the remainder t - r, doubled, fills [-1, 1] in turn
        # (the constants are tensors: a Python float costs a conversion op per use)
        span = torch.linalg.vector_norm(x32, float("inf"), -1, True).clamp_min_(1e-30).mul_(_C_SPAN)
        t = x32 * torch.div(_C_Q, span)
        r = torch.round(t)
        y = opaque_gemm.call(self, torch.cat([r * _C_HI, (t - r).mul_(_C_2), self.pin]))
        y = torch.add(y[:n], y[n : 2 * n], alpha=1 / (2 * _Q)).mul_(span)
        if self.bias is not None:
            y += self.bias
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        """fbgemm's GEMM of rows `x` on its 7-bit grid (`apply` makes them): float32 [M, out_features]."""
        return _DYN_MM(x, self.packed, True)

    def tensors(self) -> list[torch.Tensor]:
        return []  # fbgemm's packed weight is no tensor: `opaque_bytes` counts it


LinearMethod = Int4LinearMethod | Int8LinearMethod | Int8DynamicLinearMethod


def linear_method(parts: list[GGUFBlocks], bias: torch.Tensor | None, int4: bool = True) -> LinearMethod:
    """The method a weight stacked from GGUF matrices runs with: int4 where every part is of an int4 type
    (exact) and `int4` allows it, else int8 rows, with int8 or bfloat16 activations (`ACTIVATIONS_ENV`)."""
    unknown = sorted({p.qtype for p in parts} - set(QUANTIZED_TYPES))
    if unknown:
        raise ValueError(
            f"GGUF type {', '.join(unknown)} is not run quantized; types: {', '.join(QUANTIZED_TYPES)}"
        )
    if int4 and is_int4(parts):
        return Int4LinearMethod(parts, bias)
    if env.GGUF_ACTIVATIONS.get() == "int8" and has_int8_gemm():
        return Int8DynamicLinearMethod(Int8Rows(parts), bias)
    return Int8LinearMethod(Int8Rows(parts), bias)


def layout() -> str:
    """`LAYOUT_ENV`'s layout, `auto` chosen for this CPU: "int4" where torch's kernels run AVX-512, "mixed"
    elsewhere. On AVX2 the int8 weight-only kernel took 0.26-0.63x the int4 kernel's time on the default
    model's projections at one row (`bench/results/gguf_cpu/kernels.log`); on AVX-512 the two kernels
    take the same (15 and 16 us on q/k/v), and the int8 rows' per-call activation arithmetic makes
    "mixed" the slower: the default model's decode step took 0.80x "mixed"'s time at batch 1 in "int4",
    0.85x at 8, 0.97x at 32, its weights 95.2 MB against 115.6 (`bench/results/gguf_cpu_avx512/`)."""
    chosen = env.GGUF_LAYOUT.get()
    if chosen != "auto":
        return chosen
    return "int4" if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else "mixed"


def int4_for(module_name: str) -> bool:
    """Whether a layer whose GGUF matrices are of an int4 type keeps the int4 layout (`layout`).

    "mixed" keeps int4 for the fused gate/up projections only, the largest matrices (half a layer's
    weights), so the weights stay within 1.2x the file's size (issue 35's bound; int8 rows take 1 byte a
    weight against int4's 0.625 with its scales), and runs the rest as int8 rows, a rounding of the file's
    4-bit weights to per-row 8-bit ones (`bench/results/gguf_cpu/quality_mixed.log`). "int8" makes every
    layer int8 rows (about 1.4x the file's bytes); "int4" keeps int4 wherever it is exact (the fewest
    bytes: 0.96x the default model's file)."""
    chosen = layout()
    return chosen == "int4" or (chosen == "mixed" and module_name.endswith("gate_up_proj"))
