"""Weight-only int4/int8 checkpoints (w4a16, w8a16, group-wise scales and zeros) kept quantized: AWQ (GEMM
layout), GPTQ (no act-order) and compressed-tensors `pack-quantized`.

Each layout's tensors are unpacked at load into one form (`Unpacked`: q [N, K] unsigned, scale and zero
[N, K / G], `W = (q - zero) * scale`), cut for tensor parallelism and stacked for fused projections there,
then packed into the one layout the GEMM reads (`gapless.model.quant.int4_triton`'s docstring). The layouts,
as their writers (AutoAWQ, AutoGPTQ/GPTQModel, compressed-tensors) store them:

- **AWQ** (`quant_method: awq`, `version: gemm`, 4 bits): `qweight` int32 [K, N / 8] packed along N,
  the 8 columns of an int32 interleaved: nibble i (bits 4i..4i+3) holds column `AWQ_ORDER[i]` of its 8
  (0, 2, 4, 6, 1, 3, 5, 7); `qzeros` int32 [K / G, N / 8] the same way; `scales` [K / G, N]. The zeros are
  the integer zero points as they are.
- **GPTQ** (`quant_method: gptq`): `qweight` int32 [K / P, N] packed along K, value k at bits
  `bits * (k % P)` of row k // P (P = 32 / bits); `qzeros` int32 [K / G, N / P] packed along N the same
  way; `scales` [K / G, N]; `g_idx` [K] (k // G without act-order). The zeros are stored minus one
  (`checkpoint_format: gptq`, the default, AutoGPTQ's `zeros -= 1` before packing) or as they are
  (`gptq_v2`); a symmetric checkpoint's zero is 2^(bits-1).
- **compressed-tensors** `pack-quantized` (`quant_method: compressed-tensors`): `weight_packed` int32
  [N, K / P] packed along K (value k at bits `bits * (k % P)`), each value stored as q + 2^(bits-1) with q
  signed; `weight_scale` [N, K / G]; `weight_zero_point` int32 [N / P, K / G] packed along N the same way,
  only when asymmetric (symmetric: zero 0, i.e. 2^(bits-1) unsigned); `weight_shape` [2] = (N, K).

On CUDA the layer runs the Triton GEMM. Elsewhere (the CPU) `apply` is a reference path: it dequantizes
the whole weight to the activations' dtype on every call and multiplies with torch, so the quantized
checkpoint is exact against a float model holding the same dequantized weights (tests), at a float GEMM's
cost plus the dequantization: for parity, not speed.

A mixture's experts (`...experts.3.gate_proj.qweight`, Mixtral's `w1`/`w3`/`w2`) are unpacked the same way
and stacked by `install_experts` into the layer's `Experts`, each expert in the GEMM's layout; the grouped
GEMM (`gapless.model.moe_triton`) unpacks them on CUDA, the CPU multiplies with them dequantized at load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from gapless.model.quant import int4_kernels
from gapless.model.quant.formats import QuantFormatError  # (every format's one error)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ's GEMM packing: nibble i of an int32 holds column AWQ_ORDER[i]
METHODS = ("awq", "gptq", "compressed-tensors")
TENSORS = {
    "awq": ("qweight", "qzeros", "scales"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "compressed-tensors": (
        "weight_packed",
        "weight_scale",
        "weight_zero_point",
        "weight_shape",
        "weight_g_idx",
    ),
}


# the tests set this under Triton's interpreter: the layers then run the Triton GEMM on CPU tensors too
TRITON_ON_CPU = False


@dataclass(frozen=True)
class Int4Spec:
    """A checkpoint's weight-only integer quantization, as `int4_spec_from_config` reads it."""

    method: str  # one of METHODS
    bits: int  # 4 or 8
    group_size: int  # -1: one group per output channel (the whole row)
    sym: bool
    zero_offset: int = 0  # added to the stored zero points (GPTQ's v1 format: 1)

    @property
    def label(self) -> str:
        group = "channel" if self.group_size < 0 else f"g{self.group_size}"
        return f"{self.method} w{self.bits}a16 {group}"

    def group_for(self, k: int) -> int:
        return k if self.group_size < 0 else self.group_size


def _refuse(method: str, what: str) -> QuantFormatError:
    return QuantFormatError(f"quantization_config ({method}): {what}")


def _check_bits_group(method: str, bits: Any, group: Any, allowed: tuple[int, ...]) -> tuple[int, int]:
    if bits not in allowed:
        raise _refuse(method, f"bits={bits} is not run; bits: {', '.join(map(str, allowed))}")
    if group is None:
        group = -1
    if not isinstance(group, int) or not (group == -1 or (group >= 16 and group & (group - 1) == 0)):
        raise _refuse(method, f"group_size={group} is not run; a power of two >= 16, or -1 (per channel)")
    return int(bits), group


def _awq(qc: dict[str, Any]) -> Int4Spec:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse("awq", f"version={version!r} is not read; only the GEMM layout (version 'gemm')")
    bits, group = _check_bits_group(
        "awq", qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size")), (4,)
    )
    if qc.get("zero_point", True) is False:
        raise _refuse("awq", "zero_point=false is not read; AWQ's GEMM layout with zero points only")
    return Int4Spec("awq", bits, group, sym=False)


def _gptq(qc: dict[str, Any]) -> Int4Spec:
    if qc.get("desc_act"):
        raise _refuse("gptq", "desc_act=true (act-order) is not built; quantize with desc_act=false")
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse("gptq", f"checkpoint_format={fmt!r} is not read; gptq or gptq_v2")
    if qc.get("lm_head"):
        raise _refuse("gptq", "lm_head=true (a quantized LM head) is not built")
    bits, group = _check_bits_group("gptq", qc.get("bits"), qc.get("group_size"), (4, 8))
    sym = bool(qc.get("sym", True))
    return Int4Spec("gptq", bits, group, sym, zero_offset=1 if fmt == "gptq" else 0)


def _compressed(qc: dict[str, Any]) -> Int4Spec | None:
    groups = list((qc.get("config_groups") or {}).values())
    if not groups:
        raise _refuse("compressed-tensors", "no config_groups")
    formats = {str(g.get("format") or qc.get("format")) for g in groups}
    if formats != {"pack-quantized"}:
        return None  # another compressed-tensors format (float-quantized: the FP8 method's)
    schemes = {repr(sorted(g.get("weights", {}).items())) for g in groups}
    if len(schemes) != 1:
        raise _refuse("compressed-tensors", "config_groups with different weight schemes are not run")
    w = groups[0].get("weights") or {}
    if any(g.get("input_activations") for g in groups):
        raise _refuse(
            "compressed-tensors", "pack-quantized with quantized activations is not run (w4a16/w8a16 only)"
        )
    if w.get("type", "int") != "int":
        raise _refuse("compressed-tensors", f"weights of type {w.get('type')!r} are not run; int only")
    if w.get("actorder") not in (None, False):
        raise _refuse("compressed-tensors", f"actorder={w.get('actorder')!r} (act-order) is not built")
    if w.get("dynamic"):
        raise _refuse("compressed-tensors", "dynamic weight quantization is not run")
    strategy = w.get("strategy")
    if strategy not in ("group", "channel"):
        raise _refuse("compressed-tensors", f"strategy={strategy!r} is not run; group or channel")
    targets = {t for g in groups for t in g.get("targets", [])}
    if targets - {"Linear"}:
        raise _refuse("compressed-tensors", f"targets {sorted(targets)} are not run; Linear only")
    group_size = w.get("group_size") if strategy == "group" else -1
    bits, group = _check_bits_group("compressed-tensors", w.get("num_bits"), group_size, (4, 8))
    return Int4Spec(
        "compressed-tensors",
        bits,
        group,
        bool(w.get("symmetric", True)),
    )


def int4_spec_from_config(qc: dict[str, Any] | None) -> Int4Spec | None:
    """The weight-only integer scheme a checkpoint's `quantization_config` names; None when it names none
    (or another method: FP8). Raises `QuantFormatError`, one line naming the field, for a scheme of these
    methods that is not run (act-order, bits other than 4/8, a group size that is not a power of two)."""
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "awq":
        return _awq(qc)
    if method == "gptq":
        return _gptq(qc)
    if method == "compressed-tensors":
        return _compressed(qc)
    return None


class Unpacked(NamedTuple):
    """One projection's weight as `W = (q - zero) * scale`: q int16 [N, K] (unsigned values), scale
    float32 and zero float32 [N, K / G]."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """W float32 [N, K]."""
        group = self.q.shape[1] // self.scale.shape[1]
        zero, scale = (t.repeat_interleave(group, dim=1) for t in (self.zero, self.scale))
        return (self.q.float() - zero) * scale


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned values from int32s packed along `dim` (0 or 1), value j of an int32 at bits `bits * j`."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    mask = (1 << bits) - 1
    if dim == 0:  # [R, C] -> [R * per, C]
        v = (packed.unsqueeze(1) >> shifts.view(1, per, 1)) & mask
        return v.reshape(packed.shape[0] * per, packed.shape[1]).to(torch.int16)
    v = (packed.unsqueeze(2) >> shifts.view(1, 1, per)) & mask
    return v.reshape(packed.shape[0], packed.shape[1] * per).to(torch.int16)


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The inverse of `unpack_int32`: values (0 .. 2^bits - 1) packed along `dim` into int32s."""
    per = 32 // bits
    v = values.to(torch.int64)
    if dim == 0:
        v = v.reshape(v.shape[0] // per, per, v.shape[1]).transpose(1, 2)
    else:
        v = v.reshape(v.shape[0], v.shape[1] // per, per)
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=v.device)
    word = (v << shifts).sum(-1)
    word = torch.where(word >= 2**31, word - 2**32, word)  # as int32's two's complement
    return word.to(torch.int32)


def _awq_columns(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's [R, C / 8] int32s (interleaved) as [R, C] nibbles in column order."""
    nibbles = unpack_int32(packed, 4, dim=1).view(packed.shape[0], -1, 8)
    inverse = [AWQ_ORDER.index(c) for c in range(8)]  # column c sits at nibble inverse[c]
    return nibbles[..., inverse].reshape(packed.shape[0], -1)


def unpack(spec: Int4Spec, parts: dict[str, torch.Tensor], where: str) -> Unpacked:
    """One checkpoint module's tensors (`TENSORS[spec.method]` by suffix) as `Unpacked`; `where` names
    the module in errors."""
    need = TENSORS[spec.method][: 2 if spec.method == "compressed-tensors" else 3]  # the rest optional
    missing = [n for n in need if n not in parts]
    if missing:
        raise QuantFormatError(f"{where}: the {spec.method} checkpoint lacks {', '.join(missing)}")
    if spec.method == "awq":
        q = _awq_columns(parts["qweight"]).t()  # [K, N] -> [N, K]
        zero = _awq_columns(parts["qzeros"]).t().float()
        scale = parts["scales"].float().t()
    elif spec.method == "gptq":
        q = unpack_int32(parts["qweight"], spec.bits, dim=0).t()
        if "g_idx" in parts:
            _check_g_idx(parts["g_idx"], q.shape[1], spec.group_for(q.shape[1]), where)
        # v1 adds the 1 back without wrapping, as AutoGPTQ's and vLLM's kernels do (a zero of 0 was
        # stored as 15 and reads as 16: those checkpoints' own flaw, read as every reader reads it)
        zero = (unpack_int32(parts["qzeros"], spec.bits, dim=1).float() + spec.zero_offset).t()
        scale = parts["scales"].float().t()
    else:
        if "weight_g_idx" in parts:
            raise QuantFormatError(f"{where}: weight_g_idx (act-order) is not built")
        q = unpack_int32(parts["weight_packed"], spec.bits, dim=1)
        scale = parts["weight_scale"].float()
        if "weight_shape" in parts:
            n, k = (int(v) for v in parts["weight_shape"].tolist())
            q = q[:n, :k]
        half = float(1 << (spec.bits - 1))
        if spec.sym or "weight_zero_point" not in parts:
            zero = torch.full_like(scale, half)
        else:
            zero = unpack_int32(parts["weight_zero_point"], spec.bits, dim=0)[: q.shape[0]].float()
    q = q.contiguous()
    n, k = q.shape
    group = spec.group_for(k)
    if k % group or scale.shape != (n, k // group) or zero.shape != scale.shape:
        raise QuantFormatError(
            f"{where}: {spec.label} weight [{n}, {k}] with scales {tuple(scale.shape)} and zeros "
            f"{tuple(zero.shape)}: not groups of {group} along the input"
        )
    return Unpacked(q, scale.contiguous(), zero.contiguous())


def _check_g_idx(g_idx: torch.Tensor, k: int, group: int, where: str) -> None:
    """GPTQ's g_idx must be the plain k // G (no act-order); anything else is refused by name."""
    plain = torch.arange(k, dtype=torch.int64) // group
    if g_idx.shape != (k,) or not torch.equal(g_idx.to(torch.int64).cpu(), plain):
        raise QuantFormatError(f"{where}: g_idx is not k // group_size (act-order), which is not built")


class Int4LinearMethod:
    """`x W^T + b` with W held packed (`int4_triton`'s layout): the Triton GEMM on CUDA, the dequantizing
    reference path elsewhere (the module's docstring); on CUDA where the model's kernel choice gives the
    layer a library's GEMM (`int4_kernels.for_layer`; `kernel`: that choice, default the variable's), the
    weight in that library's layout too, or instead: `auto` runs tinygemm's copy up to
    `int4_kernels.TINYGEMM_ROWS` rows and the Triton GEMM above. `tensors()`: what is held."""

    def __init__(
        self, w: Unpacked, spec: Int4Spec, dtype: torch.dtype, device: torch.device, kernel: str | None = None
    ) -> None:
        n, k = w.q.shape
        self.name, self.quant_method = spec.label, spec.method
        self.bits, self.group = spec.bits, k // w.scale.shape[1]
        self.out_features, self.in_features, self.dtype = n, k, dtype
        if k % (32 // spec.bits):
            raise QuantFormatError(f"{spec.label}: in_features {k} is not a multiple of {32 // spec.bits}")
        choice = kernel or int4_kernels.chosen()
        library, _, also = int4_kernels.for_layer(
            choice, spec.bits, self.group, dtype, n, k, device
        ).partition("+")
        self.library, self.library_rows = None, int4_kernels.TINYGEMM_ROWS if also else None
        self.triton_held = library == "triton" or also == "triton"  # (the Triton GEMM's layout held)
        if library != "triton":
            self.library = int4_kernels.library_kernel(library, w, spec.bits, dtype, device, spec.label)
            rows = f" to {self.library_rows} rows, triton above" if also else ""
            self.name = f"{spec.label} ({library}{rows})"
        if not self.triton_held:
            return
        self.qweight = pack_int32(w.q.t(), spec.bits, dim=0).to(device)
        self.scales = w.scale.t().to(dtype).contiguous().to(device)
        self.zeros = w.zero.t().to(dtype).contiguous().to(device)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """W [N, K] in `dtype` (the reference path's weight)."""
        q = unpack_int32(self.qweight, self.bits, dim=0)  # [K, N]
        zero, scale = (t.repeat_interleave(self.group, dim=0) for t in (self.zeros, self.scales))
        return ((q.float() - zero.float()) * scale.float()).t().to(dtype)  # as the GEMM: fp32, one rounding

    def apply(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self.apply(layer, x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.out_features)
        if self.library is not None and (self.library_rows is None or x.shape[0] <= self.library_rows):
            y = self.library(x.to(self.dtype)).to(x.dtype)
        elif x.is_cuda or TRITON_ON_CPU:
            from gapless.model.quant.int4_triton import w4a16_matmul

            y = w4a16_matmul(
                x.to(self.scales.dtype), self.qweight, self.scales, self.zeros, self.group, self.bits
            )
            y = y.to(x.dtype)
        else:
            y = torch.mm(x, self.dequantized(x.dtype).t())
        bias = getattr(layer, "bias", None)
        return y if bias is None else y + bias

    def tensors(self) -> list[torch.Tensor]:
        held = self.library.tensors() if self.library is not None else []
        return held + ([self.qweight, self.scales, self.zeros] if self.triton_held else [])


def split_name(name: str, spec: Int4Spec) -> tuple[str, str] | None:
    """(module, tensor) for a checkpoint tensor the scheme quantizes (`model.layers.0.mlp.down_proj`,
    `qweight`); None for every other tensor."""
    module, _, tensor = name.rpartition(".")
    return (module, tensor) if tensor in TENSORS[spec.method] else None


def split_rows(w: Unpacked, offsets: dict[Any, tuple[int, int]]) -> dict[Any, Unpacked]:
    """A fused projection's weight (Phi-3's qkv_proj) cut along its rows into its shards."""
    return {s: Unpacked(*(t.narrow(0, off, n) for t in w)) for s, (off, n) in offsets.items()}


def shard_for_rank(w: Unpacked, layer: Any, shard: Any, where: str) -> Unpacked:
    """This rank's piece of one (shard of a) projection, cut as the layer cuts its float weight: a
    column-parallel layer keeps its rows (scales and zeros with them), a row-parallel one its columns
    and the groups they fall in (so each rank's input slice must be whole groups)."""
    from gapless.model import layers

    tp = getattr(layer, "tp", None)
    if tp is None or tp.size == 1 or isinstance(layer, layers.ReplicatedLinear):
        return w
    if isinstance(layer, layers.RowParallelLinear):
        k, groups = w.q.shape[1], w.scale.shape[1]
        if groups % tp.size:
            raise QuantFormatError(
                f"{where}: {groups} groups of {k // groups} inputs do not split over {tp.size} ranks"
            )
        return Unpacked(tp.part(w.q, tp.size, dim=1), *(tp.part(t, tp.size, dim=1) for t in w[1:]))
    parts = layer.shard_parts[shard] if isinstance(layer, layers.MergedColumnParallelLinear) else tp.size
    return Unpacked(*(tp.part(t, parts) for t in w))


def install(
    layer: Any, shards: dict[Any, Unpacked], spec: Int4Spec, dtype: torch.dtype, where: str, kernel: str
) -> Int4LinearMethod:
    """Give `layer` (a `_Linear`) its quantized weight from its shards (checkpoint shard id -> whole
    unpacked weight), cut for this rank and stacked in the layer's shard order, for the model's `kernel`
    choice (`int4_kernels.for_model`); its float weight freed."""
    from gapless.model import layers

    if not isinstance(layer, layers._Linear):
        raise QuantFormatError(f"{where} ({type(layer).__name__}) has no {spec.method} form")
    order = list(getattr(layer, "shard_offsets", None) or [None])
    missing = [s for s in order if s not in shards]
    if missing:
        raise QuantFormatError(
            f"{where}: the checkpoint quantizes only some of its shards (missing {missing})"
        )
    pieces = [shard_for_rank(shards[s], layer, s, where) for s in order]
    w = Unpacked(*(torch.cat(ts) for ts in zip(*pieces)))
    if w.q.shape != tuple(layer.weight.shape):
        raise QuantFormatError(
            f"{where}: quantized weight {tuple(w.q.shape)} does not fit the layer's "
            f"{tuple(layer.weight.shape)}"
        )
    return _hold(layer, w, spec, dtype, kernel)


def _hold(layer: Any, w: Unpacked, spec: Int4Spec, dtype: torch.dtype, kernel: str) -> Int4LinearMethod:
    """`layer`'s method from its (this rank's) whole weight `w`; its float weight freed."""
    method = Int4LinearMethod(w, spec, dtype, layer.weight.device, kernel)
    layer.linear_method = method
    layer.weight.data = layer.weight.data.new_empty(0)
    return method


def install_experts(
    experts: Any, shards: dict[Any, Unpacked], spec: Int4Spec, dtype: torch.dtype, where: str
) -> None:
    """Give a mixture's `Experts` its quantized weights from each expert's projections (shard id
    (expert, "gate" | "up" | "down") -> whole unpacked weight): cut for this rank as the float experts are
    (gate/up by rows, down by columns: whole groups per rank), stacked, packed (`moe.WeightQuant`'s
    layout), and on the CPU dequantized beside for the reference path."""
    from gapless.model.moe import WeightQuant

    tp, e_count, inter = experts.tp, experts.num_experts, experts.inter
    hidden = experts.gate_up_proj.shape[2]
    want = [s for p in ("gate_up_proj", "down_proj") for s in experts.checkpoint_shards(p)]
    missing = [s for s in want if s not in shards]
    if missing:
        raise QuantFormatError(
            f"{where}: the checkpoint quantizes only some experts' projections: {missing[:4]}"
        )
    if hidden % 16 or inter % 16:
        raise QuantFormatError(
            f"{where}: {spec.label} experts of {hidden} x {inter} inputs: not multiples of 16"
        )

    def mine(e: int, proj: str) -> Unpacked:
        w = shards[(e, proj)]
        if tp.size > 1 and proj == "down":
            groups = w.scale.shape[1]
            if groups % tp.size:
                raise QuantFormatError(
                    f"{where}: expert {e} down's {groups} groups of {w.q.shape[1] // groups} inputs do not "
                    f"split over {tp.size} ranks"
                )
            return Unpacked(*(tp.part(t, tp.size, dim=1) for t in w))
        return Unpacked(*(tp.part(t, tp.size) for t in w)) if tp.size > 1 else w

    cpu = experts.gate_up_proj.device.type == "cpu"
    packed, quants, dequantized = [], [], []
    for projs, shape in ((("gate", "up"), (2 * inter, hidden)), (("down",), (hidden, inter))):
        qs, scales, zeros, floats = [], [], [], []
        for e in range(e_count):
            w = Unpacked(*(torch.cat(ts) for ts in zip(*(mine(e, p) for p in projs))))
            if w.q.shape != shape:
                raise QuantFormatError(
                    f"{where}: expert {e} {'/'.join(projs)} weight {tuple(w.q.shape)} does not fit {shape}"
                )
            # scales and zeros as held (the model's dtype), so the CPU's weights are the kernel's
            held = Unpacked(w.q, w.scale.to(dtype), w.zero.to(dtype))
            qs.append(pack_int32(w.q.t(), spec.bits, dim=0))
            scales.append(held.scale.t().contiguous())
            zeros.append(held.zero.t().contiguous())
            if cpu:
                floats.append(Unpacked(w.q, held.scale.float(), held.zero.float()).dequantize().to(dtype))
        packed.append(torch.stack(qs))
        group = shape[1] // scales[0].shape[0]
        quants.append(WeightQuant(torch.stack(scales), group, torch.stack(zeros), spec.bits))
        if cpu:
            dequantized.append(torch.stack(floats))
    experts.hold_int(
        (packed[0], packed[1]),
        (quants[0], quants[1]),
        (dequantized[0], dequantized[1]) if cpu else None,
        spec.label,
    )


def random_unpacked(n: int, k: int, spec: Int4Spec, device: torch.device) -> Unpacked:
    """A random [N, K] weight in the scheme's form: values uniform over the 2^bits levels, zero at the
    middle, one scale per group such that W's standard deviation is 0.02 (as `--load-format dummy`'s float
    weights)."""
    group, levels = spec.group_for(k), 1 << spec.bits
    if k % group:
        raise QuantFormatError(f"{spec.label}: {k} inputs are not whole groups of {group}")
    q = torch.randint(0, levels, (n, k), dtype=torch.int16, device=device)
    scale = torch.full((n, k // group), 0.02 * 12**0.5 / levels, device=device)
    return Unpacked(q, scale, torch.full_like(scale, levels / 2))


def is_quantized_linear(module: Any) -> bool:
    """Whether an int4/int8 checkpoint quantizes `module`: a linear layer but a router (not the head)."""
    from gapless.model import layers

    return isinstance(module, layers._Linear) and not isinstance(module, layers.ReplicatedLinear)


def install_random(model: Any, spec: Int4Spec, dtype: torch.dtype, kernel: str) -> None:
    """A `--load-format dummy` load of a checkpoint of this scheme: random weights in its form
    (`random_unpacked`) for the layers such a checkpoint quantizes, every linear layer but the routers
    (and the LM head, which is not one) and every mixture's experts, cut for this rank as a loaded
    checkpoint is. For benchmarks of shapes no quantized checkpoint is written for."""
    from gapless.model.moe import Experts

    for name, module in model.named_modules():
        if isinstance(module, Experts):
            device, tp = module.gate_up_proj.device, module.tp
            hidden, inter = module.gate_up_proj.shape[2], module.inter * tp.size
            shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
            shards = {
                (e, p): random_unpacked(*shapes[p], spec, device)
                for e in range(module.num_experts)
                for p in shapes
            }
            install_experts(module, shards, spec, dtype, name)
        elif is_quantized_linear(module):
            n, k = module.weight.shape
            _hold(module, random_unpacked(n, k, spec, module.weight.device), spec, dtype, kernel)
