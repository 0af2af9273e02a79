"""Which GEMM an int4/int8 weight-only layer runs (`GAPLESS_INT4_KERNEL`), each holding the weight in its
own layout, built from the one unpacked form `W = (q - zero) * scale` (`int4_layouts.Unpacked`). On CUDA:

- `auto` (the default): a layer tinygemm can run holds two copies of its weight, tinygemm's for up to
  `TINYGEMM_ROWS` rows (decode) and the Triton GEMM's for more (prefill, larger batches), as long as the
  second copies take at most `SECOND_COPY_SHARE` of the GPU's memory (`for_model`); else, and for every
  layer tinygemm cannot run, the Triton GEMM alone.
- `triton`: gapless's Triton GEMM (`int4_triton`), every bit width, group and dtype.
- `tinygemm`: torch's own int4 GEMM (`torch.ops.aten._weight_int4pack_mm`, sm_80+), 4 bits, bfloat16,
  groups of 32, 64, 128 or 256, N a multiple of 8 and K of 32. It computes `(q - 8) * scale + offset`
  per group, so the zero is held as `offset = (8 - zero) * scale`, rounded to bfloat16: within half a
  bfloat16 step of that product of the exact weight (the Triton GEMM's weight is the exact one, rounded
  once).
- `gemlite`: gemlite's Triton kernels (`pip install gemlite`; GEMV kernels at one row, split-K ones at a
  few), 4 or 8 bits, fed the same `(q - zero) * scale` form unchanged (`fma_mode=False`). Its split-K
  kernels add their partial sums with atomics: the last bits of a product may differ between runs.

On the CPU, `auto` runs torch's CPU kernels where they take a layer (`CPU_KERNEL`; `cpu_runs`), the
activations as bfloat16 (their vectorized path) and the scales and zeros rounded to bfloat16:

- 4 bits in groups of 32-256: `_weight_int4pack_mm_for_cpu` (`gguf_cpu.CpuInt4`, as GGUF's int4 layers);
- 8 bits in groups of 32-256: the same kernel over each value's two nibbles (`CpuInt8Groups`);
- 4 or 8 bits one group a row: `_weight_int8pack_mm` (`CpuInt8`).

Any other choice, and a layer they do not take, runs the reference path (`int4.Int4LinearMethod`), which
dequantizes the whole weight each call: exact against the dequantized model, for tests, ~650x slower at
one row on a 2048 x 8192 layer.

Measured on an H100 (bench/results/h100-2026-11-26/quant): Qwen3-8B's TPOT at batch 1 with AWQ int4
weights is 0.50x bf16's on tinygemm, 0.59x on gemlite, 0.89x on the Triton GEMM; at one row tinygemm takes
0.38-0.53x the Triton GEMM's time on Llama-3-8B's layers, at 16 rows 1.3-1.8x (`python -m
gapless.bench.int4_gemm --kernels triton tinygemm gemlite`), and torchao reports tinygemm 6-13x slower
than fp16 in batched serving (pytorch/ao#3496): so one copy each way, each where it is the faster. A
kernel named that cannot run the checkpoint's scheme (bits, dtype, group; `check`) is refused in one line
before any weight loads, one that cannot take a layer's shape as the layer is built.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import TYPE_CHECKING, Any

import torch

from gapless import env
from gapless.model.quant.base import WeightKernel
from gapless.model.quant.formats import QuantFormatError
from gapless.model.quant.gguf_cpu import CpuInt4

if TYPE_CHECKING:
    from gapless.model.quant.int4_layouts import Int4Spec, Unpacked

log = logging.getLogger(__name__)

KERNELS = ("auto", "triton", "tinygemm", "gemlite")  # (`env.INT4_KERNEL`'s choices)
CPU_KERNEL = "torch-cpu"  # (what `auto` runs on the CPU where `cpu_runs`)
TINYGEMM_GROUPS = (32, 64, 128, 256)
# under `auto`, the rows up to which a layer runs its tinygemm copy: where the H100's times at 1 and 16
# rows cross, taken as linear between (6-11 rows on Llama-3-8B's layers)
TINYGEMM_ROWS = 8
SECOND_COPY_SHARE = 0.2  # under `auto`, the most of the GPU's memory the tinygemm copies may take


def chosen() -> str:
    """The kernel `GAPLESS_INT4_KERNEL` names (default `auto`)."""
    return env.INT4_KERNEL.get()


def for_layer(
    choice: str, bits: int, group: int, dtype: torch.dtype, n: int, k: int, device: torch.device
) -> str:
    """What a layer of `bits`, `group` and weight [n, k] in `dtype` runs on `device` under the model's
    `choice` (`for_model`): on CUDA the kernel named, or under `auto` `tinygemm+triton` (both copies)
    where tinygemm runs the layer, else `triton`; elsewhere, under `auto`, torch's CPU kernels where
    they take the layer (`cpu_runs`), else `triton` (the reference path, which dequantizes the Triton
    GEMM's layout)."""
    if device.type != "cuda":
        return CPU_KERNEL if choice == "auto" and cpu_runs(bits, group, k) else "triton"
    if choice != "auto":
        return choice
    fits = bits == 4 and dtype == torch.bfloat16 and group in TINYGEMM_GROUPS  # (K: groups, so 32s)
    fits = fits and n % 8 == 0 and k % group == 0
    return "tinygemm+triton" if fits else "triton"


def wants_bfloat16(spec: Int4Spec | None, device: torch.device) -> bool:
    """Whether a model of `spec`'s int4 layers on `device` should run in bfloat16 where its checkpoint
    says float16 (as AutoAWQ and AutoGPTQ save theirs): tinygemm, the decode GEMM `auto` gives such layers
    (`for_layer`), takes bfloat16 alone, so in float16 every layer would run the Triton GEMM at every row
    (on an H100, Qwen3-8B's AWQ TPOT 0.89x bf16's where tinygemm's was 0.50x). A GPU with bfloat16
    (sm_80+), 4 bits in groups tinygemm takes, and the kernel left to `auto` or named `tinygemm`."""
    if spec is None or device.type != "cuda" or chosen() not in ("auto", "tinygemm"):
        return False
    if spec.bits != 4 or spec.group_size not in TINYGEMM_GROUPS:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)


def cpu_runs(bits: int, group: int, k: int) -> bool:
    """Whether torch's CPU kernels take a layer of `bits` (4 or 8) in groups of `group` over `k` inputs:
    groups of 32-256, or one group a row with `k` a multiple of 32 (the int8 kernel reads wrong memory,
    or crashes, where K is no multiple of 16)."""
    return k % group == 0 and (group in TINYGEMM_GROUPS or group == k and k % 32 == 0)


def for_model(numel: int, bits: int, dtype: torch.dtype, device: torch.device) -> str:
    """The model's choice (`GAPLESS_INT4_KERNEL`), where `auto` falls to `triton` (logged) if the second
    copies of its `numel` int4 linear weights (`int4.is_quantized_linear`; a mixture's experts keep one)
    would take more than `SECOND_COPY_SHARE` of the GPU's memory: a large model's KV cache comes first."""
    kernel = chosen()
    if kernel != "auto" or device.type != "cuda" or bits != 4 or dtype != torch.bfloat16:
        return kernel  # (`auto` gives no layer a second copy but a 4-bit bfloat16 one: `for_layer`)
    copy, total = numel * bits // 8, torch.cuda.get_device_properties(device).total_memory
    if copy <= SECOND_COPY_SHARE * total:
        return kernel
    log.warning(
        "int4: one copy of the weights, the Triton GEMM's: tinygemm's for decode would take %.1f GB more, "
        "over %.0f%% of the GPU (GAPLESS_INT4_KERNEL=tinygemm holds tinygemm's alone)",
        copy / 1e9,
        100 * SECOND_COPY_SHARE,
    )
    return "triton"


def _refuse(kernel: str, label: str, what: str) -> QuantFormatError:
    return QuantFormatError(f"GAPLESS_INT4_KERNEL={kernel}: {label} {what}; unset it for the Triton GEMM")


def check(kernel: str, bits: int, group: int, dtype: torch.dtype, label: str) -> None:
    """Refuse, in one line, a scheme `kernel` cannot run whatever the layer's shape (`group` -1: one group
    a row, which tinygemm does not take); a layer's shape is checked as it is built."""
    if kernel == "tinygemm":
        if bits != 4 or dtype != torch.bfloat16:
            raise _refuse(kernel, label, f"in {dtype}: tinygemm runs 4 bits in bfloat16 only")
        if group not in TINYGEMM_GROUPS:
            raise _refuse(
                kernel, label, f"groups of {group}: it takes {', '.join(map(str, TINYGEMM_GROUPS))}"
            )
    elif kernel == "gemlite":
        if importlib.util.find_spec("gemlite") is None:
            raise _refuse(kernel, label, "needs the gemlite package (the `gemlite` extra)")
        if dtype not in (torch.bfloat16, torch.float16) or 0 < group < 32:
            raise _refuse(kernel, label, f"in {dtype}: gemlite takes bfloat16 or float16, groups of >= 32")


def check_load(spec: Int4Spec | None, dtype: torch.dtype, device: torch.device | str) -> None:
    """`check` for a load of `spec` (None: not an int4/int8 checkpoint) in `dtype` on `device`, where the
    variable names a library and the device is CUDA (the CPU keeps its reference path)."""
    kernel = chosen()
    if spec is not None and kernel not in ("auto", "triton") and torch.device(device).type == "cuda":
        check(kernel, spec.bits, spec.group_size, dtype, spec.label)


def tinygemm_form(w: Unpacked, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(q's nibbles two to a byte, [N, K / 2] uint8, even k in the high nibble: what
    `_convert_weight_to_int4pack` takes; scales and offsets [K / G, N, 2] in `dtype`)."""
    q = w.q.to(torch.uint8)
    nibbles = (q[:, ::2] << 4) | q[:, 1::2]
    scale = w.scale.to(dtype).float()  # (as the Triton GEMM holds it)
    offset = (8.0 - w.zero) * scale
    return nibbles, torch.stack([scale.t(), offset.t()], dim=2).to(dtype).contiguous()


class TinyGemm:
    """A layer's weight for torch's `_weight_int4pack_mm` (the module's docstring)."""

    def __init__(self, w: Unpacked, bits: int, dtype: torch.dtype, device: torch.device, label: str) -> None:
        n, k = w.q.shape
        group = k // w.scale.shape[1]
        check("tinygemm", bits, group, dtype, label)
        if n % 8 or k % 32:
            raise _refuse("tinygemm", label, f"weight [{n}, {k}]: it takes N a multiple of 8 and K of 32")
        inner_k_tiles = next(t for t in (8, 4, 2) if k % (t * 16) == 0)
        nibbles, self.scales_zeros = tinygemm_form(w, dtype)
        self.scales_zeros = self.scales_zeros.to(device)
        self.packed = torch.ops.aten._convert_weight_to_int4pack(nibbles.to(device), inner_k_tiles)
        self.group = group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm(x, self.packed, self.group, self.scales_zeros)

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed, self.scales_zeros]


class GemLite:
    """A layer's weight for gemlite's `GemLiteLinearTriton` (the module's docstring)."""

    def __init__(self, w: Unpacked, bits: int, dtype: torch.dtype, device: torch.device, label: str) -> None:
        n, k = w.q.shape
        check("gemlite", bits, k // w.scale.shape[1], dtype, label)
        if k % 32:
            raise _refuse("gemlite", label, f"weight [{n}, {k}]: it takes K a multiple of 32")
        import gemlite

        dtypes = {torch.bfloat16: gemlite.DType.BF16, torch.float16: gemlite.DType.FP16}
        group = k // w.scale.shape[1]
        self.layer: Any = gemlite.GemLiteLinearTriton(
            bits,
            group_size=group,
            in_features=k,
            out_features=n,
            input_dtype=dtypes[dtype],
            output_dtype=dtypes[dtype],
        )
        self.layer.pack(
            w.q.to(torch.uint8).to(device),
            w.scale.to(dtype).to(device),
            w.zero.to(dtype).to(device),
            bias=None,
            fma_mode=False,
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def tensors(self) -> list[torch.Tensor]:
        return [self.layer.W_q, self.layer.scales, self.layer.zeros]


class CpuInt8:
    """A layer's 4- or 8-bit weight, one group a row, for torch's CPU `_weight_int8pack_mm`: the values as
    signed int8 `q - mid` (mid = 2^(bits - 1)) and the scales in bfloat16, so `W = (q - mid) * scale +
    offset` with a row's `offset = (mid - zero) * scale`, added as x's row sums times it (none where
    symmetric)."""

    def __init__(self, w: Unpacked, bits: int) -> None:
        mid = 1 << (bits - 1)
        self.q = (w.q.to(torch.int32) - mid).to(torch.int8).contiguous()
        self.scale = w.scale[:, 0].to(torch.bfloat16).contiguous()
        offset = (mid - w.zero[:, 0]) * self.scale.float()
        self.offset = offset if bool(offset.any()) else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.bfloat16)
        y = torch.ops.aten._weight_int8pack_mm(x, self.q, self.scale)
        return y if self.offset is None else y + x.float().sum(-1, keepdim=True) * self.offset

    def tensors(self) -> list[torch.Tensor]:
        return [self.q, self.scale] + ([self.offset] if self.offset is not None else [])


class CpuInt8Groups:
    """A layer's 8-bit weight in groups of 32-256 for torch's CPU int4 GEMM (`CpuInt4`), over K doubled:
    each value `q = 16 hi + lo` as its high nibbles (scaled 16x) beside its low ones, x beside itself, so
    `W = (hi - 8) * 16 s + (lo - 8) * s + offset` with a group's `offset = (136 - zero) * s` (s its scale
    rounded to bfloat16) in the low nibbles' zeros. The kernel rounds those to bfloat16, exact where
    symmetric (8 s); what it loses is added as x's group sums times it."""

    def __init__(self, w: Unpacked) -> None:
        n, k = w.q.shape
        self.groups = w.scale.shape[1]
        q, scale = w.q.to(torch.int32), w.scale.to(torch.bfloat16).float()
        offset = (136.0 - w.zero) * scale
        zeros = torch.cat([torch.zeros_like(offset), offset], dim=1)
        self.kernel = CpuInt4(
            torch.cat([q >> 4, q & 15], dim=1), torch.cat([16 * scale, scale], dim=1), zeros, k // self.groups
        )
        lost = offset - offset.to(torch.bfloat16).float()
        self.lost = lost.t().contiguous() if bool(lost.any()) else None  # [K / G, N]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.bfloat16)
        y = self.kernel(torch.cat([x, x], dim=-1))
        if self.lost is None:
            return y
        return y + x.float().view(x.shape[0], self.groups, -1).sum(-1) @ self.lost

    def tensors(self) -> list[torch.Tensor]:
        return self.kernel.tensors() + ([self.lost] if self.lost is not None else [])


def library_kernel(
    kernel: str, w: Unpacked, bits: int, dtype: torch.dtype, device: torch.device, label: str
) -> WeightKernel:
    """The library `kernel`'s form of one layer's weight `w` (`tinygemm`, `gemlite`, or `CPU_KERNEL`:
    `CpuInt8` one group a row, else `CpuInt4` at 4 bits and `CpuInt8Groups` at 8)."""
    if kernel == CPU_KERNEL:
        if w.scale.shape[1] == 1:
            return CpuInt8(w, bits)
        if bits == 8:
            return CpuInt8Groups(w)
        return CpuInt4(w.q, w.scale, (8.0 - w.zero) * w.scale, w.q.shape[1] // w.scale.shape[1])
    return (TinyGemm if kernel == "tinygemm" else GemLite)(w, bits, dtype, device, label)
