"""The weight-only int4/int8 checkpoints' layouts (AWQ's GEMM layout, GPTQ's, compressed-tensors'
`pack-quantized`, ...): their scheme (`Int4Spec`, which `gapless.model.quant.int4_configs` reads from a
`quantization_config`), and each layer's tensors unpacked into one form (`Unpacked`: q [N, K] unsigned,
scale and zero [N, K / G], `W = (q - zero) * scale`), which `gapless.model.quant.int4` cuts, stacks and
packs for the GEMM. The layouts, as their writers (AutoAWQ, AutoGPTQ/GPTQModel, compressed-tensors; and
AutoRound, which writes GPTQ's or AWQ's) store them:

- **AWQ** (`quant_method: awq`, `version: gemm`, 4 bits): `qweight` int32 [K, N / 8] packed along N,
  the 8 columns of an int32 interleaved: nibble i (bits 4i..4i+3) holds column `AWQ_ORDER[i]` of its 8
  (0, 2, 4, 6, 1, 3, 5, 7); `qzeros` int32 [K / G, N / 8] the same way; `scales` [K / G, N]. The zeros are
  the integer zero points as they are.
- **GPTQ** (`quant_method: gptq`): `qweight` int32 [K / P, N] packed along K, value k at bits
  `bits * (k % P)` of row k // P (P = 32 / bits; 3 bits: 32 values in each 3 rows, a little-endian bit
  stream, value k at its bit 3 * (k % 32)); `qzeros` int32 [K / G, N / P] packed along N the same way;
  `scales` [K / G, N]; `g_idx` [K], input k's group (k // G without act-order). The zeros are stored
  minus one (`checkpoint_format: gptq`, the default, AutoGPTQ's `zeros -= 1` before packing) or as they
  are (`gptq_v2`); a symmetric checkpoint's zero is 2^(bits-1). 2 and 3 bits are held as 4
  (`Int4Spec.stored_bits`): the kernels take 4 and 8.
- **compressed-tensors** `int-quantized` (its W8A8 INT8 checkpoints, `*-quantized.w8a8`): `weight` int8
  [N, K] holding the signed values as they are, `weight_scale` [N, K / G] (per tensor: [1]),
  `weight_zero_point` int8 likewise, only when asymmetric. Run as w8a16: the activations stay in the
  model's dtype, the checkpoint's int8 activation scheme unused (closer to the float model than W8A8).
- **compressed-tensors** `pack-quantized` (`quant_method: compressed-tensors`): `weight_packed` int32
  [N, K / P] packed along K (value k at bits `bits * (k % P)`), each value stored as q + 2^(bits-1) with q
  signed; `weight_scale` [N, K / G]; `weight_zero_point` int32 [N / P, K / G] packed along N the same way,
  only when asymmetric (symmetric: zero 0, i.e. 2^(bits-1) unsigned); `weight_shape` [2] = (N, K);
  `weight_g_idx` [K] as GPTQ's g_idx, with `actorder: group`.
- **bitsandbytes** 8-bit (`quant_method: bitsandbytes`, `load_in_8bit`: LLM.int8's checkpoints): `weight`
  int8 [N, K] signed, `SCB` float32 [N], each row's absolute maximum (`W = weight * SCB / 127`),
  `weight_format` the layout's code (0: row-major, the only one bitsandbytes still writes). Run as w8a16,
  as int-quantized is: not LLM.int8's int8 activations and float outlier columns.

- **NVFP4** (ModelOpt's `quant_algo: NVFP4`; compressed-tensors' `nvfp4-pack-quantized`): uint8 [N, K /
  2], two FP4 (e2m1) codes a byte, the first in the low nibble (sign bit 3, magnitudes 0, 0.5, 1, 1.5, 2, 3,
  4, 6); `weight_scale` float8_e4m3 [N, K / 16]; a per-tensor float32: ModelOpt's `weight_scale_2`
  (`W = e2m1 * weight_scale * weight_scale_2`, codes in `weight`), compressed-tensors'
  `weight_global_scale` (`W = e2m1 * weight_scale / weight_global_scale`, codes in `weight_packed`). Run
  as w4a16 with the codes' values as a codebook (`Unpacked.levels`): the checkpoint's FP4 activation
  scheme (Blackwell's tensor cores) unused, as int-quantized's int8 activations are.
- **MXFP4** (compressed-tensors' `mxfp4-pack-quantized`): NVFP4's codes in `weight_packed`, `weight_scale`
  uint8 [N, K / 32], each an e8m0 power of two's biased exponent (`W = e2m1 * 2^(scale - 127)`), no
  per-tensor scale; run as NVFP4 is, in groups of 32. AMD Quark's MXFP4: the same in `weight`.
- **AMD Quark** (`quant_method: quark`, `gapless.model.quant.quark_configs`): int4 per group in AWQ's
  layout under `weight`, `weight_scale`, `weight_zero_point` (each word's values interleaved as AWQ's, or
  in order: `reorder`), per channel packed along the inputs instead (`_quark_int4`); uint4 values with
  their zero points, or int4's two's complement values (zero 8 once unsigned); int8 as int-quantized's.

Act-order (GPTQ's `desc_act: true`, compressed-tensors' `actorder: group`) puts each input in a group by
its g_idx, not by its position: the unpacked form sorts q's columns by group (`act_order`), so the groups
are contiguous again, and keeps the inputs' order, by which the layer gathers x before its GEMM.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from gapless.model.quant.formats import QuantFormatError  # (every format's one error)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ's GEMM packing: nibble i of an int32 holds column AWQ_ORDER[i]
METHODS = ("awq", "gptq", "compressed-tensors", "bitsandbytes", "modelopt", "quark")
TENSORS = {
    "awq": ("qweight", "qzeros", "scales"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),  # (g_idx: act-order's, `act_order`)
    "compressed-tensors": (
        "weight_packed",
        "weight_scale",
        "weight_zero_point",
        "weight_shape",
        "weight_g_idx",
    ),
    "bitsandbytes": ("weight", "SCB", "weight_format"),  # (8-bit; its 4-bit form: `gapless.model.quant.bnb`)
    "quark": ("weight", "weight_scale", "weight_zero_point"),
}
UNPACKED_TENSORS = ("weight", "weight_scale", "weight_zero_point", "weight_g_idx")  # int-quantized's
FP4_TENSORS = {  # (codes, block scales[, the per-tensor scale]) by (codebook, method)
    ("nvfp4", "modelopt"): ("weight", "weight_scale", "weight_scale_2"),
    ("nvfp4", "compressed-tensors"): ("weight_packed", "weight_scale", "weight_global_scale"),
    ("mxfp4", "compressed-tensors"): ("weight_packed", "weight_scale"),
    ("mxfp4", "quark"): ("weight", "weight_scale"),
}
# FP4 e2m1's values by code: sign bit 3, magnitude bits 0-2
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
NVFP4_GROUP = 16
MXFP4_GROUP = 32
FP4_CODEBOOKS = ("nvfp4", "mxfp4")  # (e2m1 codes: NVFP4's e4m3 group scales, MXFP4's e8m0 ones)


@dataclass(frozen=True)
class Int4Spec:
    """A checkpoint's weight-only integer quantization, as `int4_configs.int4_spec_from_config` reads it."""

    method: str  # one of METHODS, or "rtn" (`gapless.model.quant.rtn`: rounded at load, no checkpoint layout)
    bits: int  # 4 or 8: the bits a value is held in
    group_size: int  # -1: one group per output channel (the whole row)
    sym: bool
    zero_offset: int = 0  # added to the stored zero points (GPTQ's v1 format: 1)
    act_order: bool = False  # the config names act-order (each layer's g_idx says its order: `act_order`)
    packed: bool = True  # False: int8 values as they are (compressed-tensors' int-quantized, bitsandbytes)
    per_tensor: bool = False  # int-quantized's strategy tensor: one scale, read as one per row (group -1)
    # what a file holds where it is not a checkpoint's scheme: a GGUF file's block types ("Q4_K"), which
    # the label names as `gguf_cpu`'s layers do ("Q4_K as int4 g32", "Q6_K as int8 per-row")
    source: str = ""
    # a codebook's name ("nf4", "fp4", "nvfp4"; GGUF's "iq4_nl", "iq3_xxs", "iq2"): the values are its
    # levels (`Unpacked.levels`)
    codebook: str = ""
    # the tool that wrote the checkpoint where its layout is another method's (AutoRound writes GPTQ's or
    # AWQ's: `int4_configs`), which the label names; its GPTQ layout stores no g_idx
    producer: str = ""
    # the config quantizes the LM head too (GPTQModel's `lm_head`, AutoRound's `extra_config`): what a
    # `--load-format dummy` load makes of it (a checkpoint's load reads the head's own tensors)
    lm_head: bool = False
    # Quark's int4: each int32's 8 columns interleaved as AWQ's (its `pack_method: reorder`), or in order
    reorder: bool = True
    # the checkpoint's bits where fewer than those held (GPTQ's 2 and 3, held as 4); 0: `bits`
    stored_bits: int = 0

    @property
    def checkpoint_bits(self) -> int:
        """The bits a value takes in the checkpoint (`stored_bits` where they are fewer than those held)."""
        return self.stored_bits or self.bits

    @property
    def label(self) -> str:
        scheme = f"w{self.checkpoint_bits}a16"  # (and the bits held, where they differ)
        held = f" as int{self.bits}" if self.stored_bits else ""
        if self.producer:
            group = "channel" if self.group_size < 0 else f"g{self.group_size}"
            return f"{self.producer} {scheme} {group}{held} ({self.method} layout)"
        if self.source:
            form = f"{self.codebook} codes" if self.codebook else f"int{self.bits}"
            return f"{self.source} as {form} " + ("per-row" if self.group_size < 0 else f"g{self.group_size}")
        if self.codebook:
            return f"{self.method} {self.codebook} g{self.group_size}"
        group = "tensor" if self.per_tensor else "channel" if self.group_size < 0 else f"g{self.group_size}"
        method = self.method + (
            " int-quantized" if self.method == "compressed-tensors" and not self.packed else ""
        )
        return f"{method} {scheme} {group}{held}" + (" act-order" if self.act_order else "")

    @property
    def tensors(self) -> tuple[str, ...]:
        """The checkpoint tensors (last part of the name) a quantized layer of this layout has."""
        if self.codebook in FP4_CODEBOOKS:
            return FP4_TENSORS[(self.codebook, self.method)]
        return UNPACKED_TENSORS if self.int_quantized else TENSORS[self.method]

    @property
    def int_quantized(self) -> bool:
        """compressed-tensors' `int-quantized` layout (int8 `weight` and `weight_scale`), or Quark's int8."""
        return self.method in ("compressed-tensors", "quark") and not self.packed

    def group_for(self, k: int) -> int:
        return k if self.group_size < 0 else self.group_size


class Unpacked(NamedTuple):
    """One projection's weight as `W = (q - zero) * scale`: q int16 [N, K] (unsigned values), scale
    float32 and zero float32 [N, K / G]; column j of q in group j // G. `order` (act-order, `act_order`):
    column j of q is input `order[j]` (so x[:, order] meets q); None: input j. `levels` (a codebook's:
    float32 [2^bits]: bitsandbytes' NF4 or FP4, GGUF's IQ4, NVFP4's e2m1): `W = levels[q] * scale`, the
    zeros 0."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    order: torch.Tensor | None = None
    levels: torch.Tensor | None = None

    def dequantize(self) -> torch.Tensor:
        """W float32 [N, K], its columns the inputs' (in input order)."""
        group = self.q.shape[1] // self.scale.shape[1]
        zero, scale = (t.repeat_interleave(group, dim=1) for t in (self.zero, self.scale))
        values = self.q.float() if self.levels is None else self.levels.float()[self.q.long()]
        w = (values - zero) * scale
        if self.order is None:
            return w
        return torch.empty_like(w).index_copy_(1, self.order, w)

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.q, self.scale, self.zero

    def centered(self, bits: int) -> Unpacked:
        """The same weight, q and zero moved by one integer so that q's values sit about the middle of
        `bits`' range (values of fewer bits held in more: GPTQ's 2 and 3 bits, GGUF's trits and Q3_K):
        exact where the zeros are integers, and what the kernels that take a zero as an offset from the
        middle, `(q - 2^(bits-1)) * scale + offset` with the offset in bfloat16 (tinygemm, torch's CPU
        int4 kernel), need to keep that offset a small multiple of the scale. A codebook's, or fractional
        zeros, as they are."""
        if self.levels is not None or self.q.numel() == 0 or not torch.equal(self.zero, self.zero.round()):
            return self
        lo, hi = int(self.q.min()), int(self.q.max())
        shift = min(max((1 << (bits - 1)) - (lo + hi + 1) // 2, -lo), (1 << bits) - 1 - hi)
        if shift == 0:
            return self
        return Unpacked(self.q + shift, self.scale, self.zero + shift, self.order, self.levels)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Unpacked:
        """q, scale and zero each through `fn` (a cut along rows or groups), the inputs' order and the
        levels kept."""
        return Unpacked(fn(self.q), fn(self.scale), fn(self.zero), self.order, self.levels)

    def rows_in(self, order: torch.Tensor) -> Unpacked:
        """The same weight, its row j the row `order[j]` (its scales and zeros with it)."""
        return self.map(lambda t: t.index_select(0, order.to(t.device)))


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned values from int32s packed along `dim` (0 or 1): the words along `dim` a little-endian bit
    stream, value j at bit `bits * j`: 2, 4 or 8 bits whole values an int32 (value j of a word at bits
    `bits * j`), 3 bits 32 values in 3 words, two of them across a word's end (GPTQ's packing)."""
    mask = (1 << bits) - 1
    if 32 % bits:
        w = packed.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
        at = torch.arange(w.shape[-1] * 32 // bits, device=packed.device) * bits
        word, shift = at // 32, at % 32
        # a value's bits in its word, and those past the word's end at the bottom of the next
        spill = w[..., (word + 1).clamp(max=w.shape[-1] - 1)] << (32 - shift)
        return (((w[..., word] >> shift) | spill) & mask).movedim(-1, dim).to(torch.int16)
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    if dim == 0:  # [R, C] -> [R * per, C]
        v = (packed.unsqueeze(1) >> shifts.view(1, per, 1)) & mask
        return v.reshape(packed.shape[0] * per, packed.shape[1]).to(torch.int16)
    v = (packed.unsqueeze(2) >> shifts.view(1, 1, per)) & mask
    return v.reshape(packed.shape[0], packed.shape[1] * per).to(torch.int16)


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The inverse of `unpack_int32`: values (0 .. 2^bits - 1) packed along `dim` into int32s."""
    v = values.to(torch.int64)
    if 32 % bits:  # (3 bits: a bit stream, some values across two words)
        v = v.movedim(dim, -1)
        at = torch.arange(v.shape[-1], device=v.device) * bits
        index, shift = (at // 32).expand_as(v), at % 32
        word = torch.zeros(*v.shape[:-1], v.shape[-1] * bits // 32 + 1, dtype=torch.int64, device=v.device)
        word.scatter_add_(-1, index, (v << shift) & 0xFFFFFFFF)  # (no two values share a bit)
        word.scatter_add_(-1, index + 1, v >> (32 - shift))  # (the bits that cross a word's end)
        word = word[..., :-1].movedim(-1, dim)
    else:
        per = 32 // bits
        if dim == 0:
            v = v.reshape(v.shape[0] // per, per, v.shape[1]).transpose(1, 2)
        else:
            v = v.reshape(v.shape[0], v.shape[1] // per, per)
        word = (v << torch.arange(0, 32, bits, dtype=torch.int64, device=v.device)).sum(-1)
    word = torch.where(word >= 2**31, word - 2**32, word)  # as int32's two's complement
    return word.to(torch.int32).contiguous()


def _awq_columns(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's [R, C / 8] int32s (interleaved) as [R, C] nibbles in column order."""
    nibbles = unpack_int32(packed, 4, dim=1).view(packed.shape[0], -1, 8)
    inverse = [AWQ_ORDER.index(c) for c in range(8)]  # column c sits at nibble inverse[c]
    return nibbles[..., inverse].reshape(packed.shape[0], -1)


def whole_tensors(spec: Int4Spec) -> tuple[str, ...]:
    """The tensors a checkpoint module of `spec` is whole with, as its layout's writers store them: every
    one `unpack` reads for this scheme (GPTQ's g_idx always, compressed-tensors' weight_shape always, its
    zero points where asymmetric and g_idx with act-order by group), so none it reads comes later."""
    if spec.producer:  # (AutoRound's GPTQ layout: no g_idx, or a trivial one after the rest)
        return tuple(t for t in spec.tensors if t != "g_idx")
    if spec.method not in ("compressed-tensors", "quark") or spec.codebook:
        return spec.tensors
    names = ["weight", "weight_scale"]
    if spec.packed and spec.method == "compressed-tensors":
        names = ["weight_packed", "weight_scale", "weight_shape"]
    return (
        *names,
        *(["weight_zero_point"] if not spec.sym else []),
        *(["weight_g_idx"] if spec.act_order else []),
    )


def unpack(spec: Int4Spec, parts: dict[str, torch.Tensor], where: str) -> Unpacked:
    """One checkpoint module's tensors (`spec.tensors` by suffix) as `Unpacked`; `where` names the
    module in errors."""
    if spec.codebook in FP4_CODEBOOKS:
        return _fp4(spec, parts, where)
    _check_kinds(spec, parts, where)
    short = spec.method in ("compressed-tensors", "bitsandbytes", "quark")  # (their other tensors: optional)
    missing = [n for n in spec.tensors[: 2 if short else 3] if n not in parts]
    if missing:
        # (an unpacked layout's `weight` is its integer values: a float one is read as a float layer's)
        floats = " (as integers; a float weight there is a float layer's)" if "weight" in missing else ""
        raise QuantFormatError(f"{where}: the {spec.method} checkpoint lacks {', '.join(missing)}{floats}")
    half = float(1 << (spec.bits - 1))
    if spec.method == "bitsandbytes":
        layout = int(parts.get("weight_format", torch.tensor(0)).item())
        if layout != 0:
            raise QuantFormatError(f"{where}: bitsandbytes weight_format {layout} is not read; 0 (row-major)")
        q = (parts["weight"].to(torch.int16) + int(half)).contiguous()
        scale = _per_row(parts, "SCB", q.shape[0], where) / 127.0
        zero = torch.full_like(scale, half)
    elif not spec.packed:  # int-quantized: the signed values and zero points as they are
        q = (parts["weight"].to(torch.int16) + int(half)).contiguous()
        scale = _per_row(parts, "weight_scale", q.shape[0], where)
        zero = torch.full_like(scale, half)
        if not spec.sym and "weight_zero_point" in parts:
            zero = _per_row(parts, "weight_zero_point", q.shape[0], where) + half
    elif spec.method == "quark":
        q, scale, zero = _quark_int4(spec, parts, where)
    elif spec.method == "awq":
        q = _awq_columns(parts["qweight"]).t()  # [K, N] -> [N, K]
        zero = _awq_columns(parts["qzeros"]).t().float()
        scale = parts["scales"].float().t()
    elif spec.method == "gptq":
        bits = spec.checkpoint_bits
        q = unpack_int32(parts["qweight"], bits, dim=0).t()
        # v1 adds the 1 back without wrapping, as AutoGPTQ's and vLLM's kernels do (a zero of 0 was
        # stored as 2^bits - 1 and reads as 2^bits: those checkpoints' own flaw, read as every reader does)
        zero = (unpack_int32(parts["qzeros"], bits, dim=1).float() + spec.zero_offset).t()
        scale = parts["scales"].float().t()
    else:
        q = unpack_int32(parts["weight_packed"], spec.bits, dim=1)
        scale = parts["weight_scale"].float()
        if "weight_shape" in parts:
            n, k = (int(v) for v in parts["weight_shape"].tolist())
            q = q[:n, :k]
        if spec.sym or "weight_zero_point" not in parts:
            zero = torch.full_like(scale, half)
        else:
            zero = unpack_int32(parts["weight_zero_point"], spec.bits, dim=0)[: q.shape[0]].float()
    return _checked(spec, q, scale, zero, parts.get("g_idx", parts.get("weight_g_idx")), where)


def _checked(
    spec: Int4Spec,
    q: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    g_idx: torch.Tensor | None,
    where: str,
) -> Unpacked:
    """`unpack`'s result once its values, groups and act-order are checked against the config."""
    n, k = q.shape
    if not spec.packed and q.numel() and (int(q.min()) < 0 or int(q.max()) >= 1 << spec.bits):
        raise QuantFormatError(f"{where}: values out of {spec.bits} bits' range (the config's num_bits)")
    group = spec.group_for(k)
    if k % group or scale.shape != (n, k // group) or zero.shape != scale.shape:
        raise QuantFormatError(
            f"{where}: {spec.label} weight [{n}, {k}] with scales {tuple(scale.shape)} and zeros "
            f"{tuple(zero.shape)}: not groups of {group} along the input"
        )
    if g_idx is None and spec.act_order:  # (read as contiguous groups, its columns would be misplaced)
        name = "weight_g_idx" if spec.method == "compressed-tensors" else "g_idx"
        raise QuantFormatError(f"{where}: the config names act-order, but the checkpoint lacks {name}")
    order = None if g_idx is None else act_order(g_idx, k, group, where)
    if order is not None:
        q = q.index_select(1, order)
    return Unpacked(q.contiguous(), scale.contiguous(), zero.contiguous(), order)


_SCALES = ("scales", "weight_scale", "SCB")
_INDICES = ("g_idx", "weight_g_idx", "weight_shape", "weight_format")
_SIGNED = (torch.int8, torch.int16, torch.int32, torch.int64)
_WEIGHTS = ("qweight", "weight_packed", "weight")


def _check_kinds(spec: Int4Spec, parts: dict[str, torch.Tensor], where: str) -> None:
    """Refuse a tensor of another kind than its layout stores (QuantFormatError): scales are floats,
    indices integers, packed values and zero points int32 words, unpacked values signed integers (int8
    as written), each a matrix (or a scale's vector or scalar); anything else would be read as a cast no
    writer made."""
    for name, t in parts.items():
        if name in _SCALES:
            ok, want = t.is_floating_point() and t.dim() <= 2, "floats, at most 2-D"
        elif name in _INDICES:
            ok, want = not t.is_floating_point() and t.dim() <= 1, "integers, 1-D"
        elif spec.packed:  # (zero points: Quark's per channel a vector)
            matrix = name in _WEIGHTS
            ok = t.dtype == torch.int32 and (t.dim() == 2 if matrix else 1 <= t.dim() <= 2)
            want = "int32 words, 2-D" if matrix else "int32 words"
        elif name == "weight":  # (int8 as written; a wider signed integer holds the same values)
            ok, want = t.dtype in _SIGNED and t.dim() == 2, "signed integer values, 2-D"
        else:  # (int-quantized's zero points)
            ok, want = not t.is_floating_point() and t.dim() <= 2, "integers"
        if not ok:
            dtype = str(t.dtype).removeprefix("torch.")
            raise QuantFormatError(
                f"{where}.{name}: {dtype} {list(t.shape)}, where {spec.method}'s layout stores {want}"
            )


def _quark_int4(
    spec: Int4Spec, parts: dict[str, torch.Tensor], where: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Quark int4 module's (q [N, K], scale, zero): per group, AWQ's layout (packed along the outputs);
    per channel, `weight` [N, K / 8] packed along the inputs, `weight_scale` [N], `weight_zero_point` [N /
    8]; each word's 8 values interleaved as AWQ's or in order; int4's two's complement values made
    unsigned (zero 8), uint4's zero points read."""
    columns = _awq_columns if spec.reorder else lambda p: unpack_int32(p, 4, dim=1)
    channel = spec.group_size < 0
    q = columns(parts["weight"]) if channel else columns(parts["weight"]).t()  # ([K, N] -> [N, K])
    scale = parts["weight_scale"].float()
    scale = scale.reshape(-1, 1) if channel else scale.t()
    if spec.sym:
        return q ^ 8, scale, torch.full_like(scale, 8.0)
    if "weight_zero_point" not in parts:
        raise QuantFormatError(f"{where}: the quark uint4 checkpoint lacks weight_zero_point")
    zero = parts["weight_zero_point"]
    return q, scale, (columns(zero.reshape(1, -1)).reshape(-1, 1) if channel else columns(zero).t()).float()


def _fp4(spec: Int4Spec, parts: dict[str, torch.Tensor], where: str) -> Unpacked:
    """An NVFP4 or MXFP4 module's tensors (the module's docstring) as `Unpacked`: its codes, each group's
    scale in float32 (NVFP4: the e4m3 block scale times, or over, the tensor's; MXFP4: 2^(e8m0 - 127)),
    and FP4's values as the codebook."""
    missing = [n for n in spec.tensors if n not in parts]
    if missing:
        raise QuantFormatError(f"{where}: the {spec.label} checkpoint lacks {', '.join(missing)}")
    codes, blocks, *whole = spec.tensors
    packed = parts[codes].contiguous().view(torch.uint8)
    q = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1).to(torch.int16)
    block = parts[blocks]
    if spec.codebook == "mxfp4":  # (e8m0: a power of two's biased exponent; 255 is NaN, as the format)
        exponent = block.contiguous().view(torch.uint8).float()
        scale = torch.where(exponent == 255, float("nan"), torch.exp2(exponent - 127))
    else:
        block = (block.view(torch.float8_e4m3fn) if block.dtype == torch.uint8 else block).float()
        if parts[whole[0]].numel() != 1:
            raise QuantFormatError(f"{where}: {whole[0]} of {parts[whole[0]].numel()} values (one a tensor)")
        tensor = parts[whole[0]].float().reshape(())
        scale = block * tensor if spec.method == "modelopt" else block / tensor
    n, k = q.shape
    if scale.shape != (n, k // spec.group_size):
        raise QuantFormatError(
            f"{where}: {spec.label} weight [{n}, {k}] with scales {tuple(scale.shape)}: not groups of "
            f"{spec.group_size} along the input"
        )
    levels = torch.tensor(FP4_E2M1, dtype=torch.float32, device=q.device)
    return Unpacked(q.contiguous(), scale.contiguous(), torch.zeros_like(scale), levels=levels)


def act_order(g_idx: torch.Tensor, k: int, group: int, where: str) -> torch.Tensor | None:
    """The inputs' order that makes each group contiguous, from a layer's g_idx (input k's group): None
    where g_idx is already k // G (no act-order, or GPTQ's static groups) or all -1 (compressed-tensors'
    "no order"); else the stable sort of g_idx (int64 [K], on g_idx's device), which gives group j // G
    to column j when every group has exactly G inputs, as act-order's quantizers write it. Anything else
    is refused by name."""
    g = g_idx.to(torch.int64).cpu()
    if g.shape != (k,):
        raise QuantFormatError(f"{where}: g_idx of shape {tuple(g.shape)} for {k} inputs")
    plain = torch.arange(k, dtype=torch.int64) // group
    if torch.equal(g, plain) or bool((g == -1).all()):
        return None
    order = torch.sort(g, stable=True).indices
    if not torch.equal(g[order], plain):
        raise QuantFormatError(
            f"{where}: g_idx does not put exactly {group} inputs in each of {k // group} groups"
        )
    return order.to(g_idx.device)


def _per_row(parts: dict[str, torch.Tensor], name: str, n: int, where: str) -> torch.Tensor:
    """Scales or zero points `name` as float32 [N, groups]: one per tensor ([1] or a scalar) repeated for
    the N rows, a row's ([N]) as one column, [N, groups] as they are; any other shape refused."""
    t = parts[name].float()
    if t.numel() == 1:
        return t.reshape(1, 1).expand(n, 1).contiguous()
    if t.dim() in (1, 2) and t.shape[0] == n:
        return t.reshape(n, -1)
    raise QuantFormatError(f"{where}.{name}: shape {list(t.shape)}, for {n} rows (one, [N] or [N, groups])")


def split_name(name: str, spec: Int4Spec, dtype: torch.dtype) -> tuple[str, str] | None:
    """(module, tensor) for a checkpoint tensor (of `dtype`) the scheme quantizes
    (`model.layers.0.mlp.down_proj`, `qweight`); None for every other tensor (an int-quantized
    checkpoint's `weight` only where it is int8: its float layers' weights have the same name)."""
    module, _, tensor = name.rpartition(".")
    if tensor not in spec.tensors or tensor == "weight" and dtype.is_floating_point:
        return None
    return module, tensor
