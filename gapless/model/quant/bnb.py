"""bitsandbytes 4-bit checkpoints (`quant_method: bitsandbytes`, `load_in_4bit`: unsloth's `*-bnb-4bit`
repositories, QLoRA merges), read as float weights: each quantized weight is dequantized as its tensors
arrive and goes on as the float `...weight` it was, then kept in 4 bits where a kernel takes them (`kept`,
below). NF4 and FP4 are codebooks (16 float values), not the evenly spaced levels of AWQ's and GPTQ's
`W = (q - zero) * scale`.

As Hugging Face's bitsandbytes integration stores a layer's weight (the `weight` of an `nn.Linear`):

- `weight`: the codes, two to a byte, the first in the high nibble, over the weight flattened row by row
  (uint8 [N * K / 2, 1]; stored in `bnb_4bit_quant_storage`'s dtype where that is not uint8);
- `weight.quant_map` float32 [16]: the codebook (NF4's or FP4's);
- `weight.absmax`: one scale per `blocksize` values (float32), or, double-quantized, uint8 codes into
  `weight.nested_quant_map` [256] times `weight.nested_absmax` (one per `nested_blocksize` scales) plus
  `nested_offset`;
- `weight.quant_state.bitsandbytes__nf4` (or `__fp4`): uint8 bytes of a JSON object with `quant_type`,
  `blocksize`, `shape`, `dtype` and, double-quantized, `nested_blocksize` and `nested_offset`.

Value i is `quant_map[code_i] * absmax[i // blocksize]` in float32, as bitsandbytes computes it. The
8-bit form (`load_in_8bit`, int8 weights and a per-row `SCB`) stays quantized on the int8 path instead
(`gapless.model.quant.int4_layouts`).

Where a kernel keeps them (`kept`), each linear layer is quantized again as its float weight becomes whole
(the loader's online rounding, as `--quantization fp8` does): quantizing in the checkpoint's blocks gives
back the very codes and scales of a weight dequantized from them (each block's largest value is its scale
times a code of +-1; double-quantized scales are kept as float32), which is checked, so a layer the
checkpoint kept in float, or whose blocks span rows (or a rank's share of them), stays float. Then:

- on CUDA, the int4 path's Triton GEMM with the codebook (`codes`; `int4_triton`: each value a lookup in
  the 16 levels), every rank's shard of a layer its own; no bitsandbytes needed; never timed on a GPU. A
  mixture's experts likewise (`_hold_experts`), for the grouped GEMM (`moe_triton`), where the checkpoint
  quantized each expert's projections (transformers 4 wrote one `nn.Linear` an expert);
- on a one-rank CPU with bitsandbytes installed and its fused CPU kernel usable (AVX512-BF16),
  bitsandbytes' own `Linear4bit` (x in bfloat16): one thread, 0.18-0.22x bfloat16 torch.mm's time at one
  row on Llama-3-8B's layers, 0.46-0.50x at eight (`bench/results/bnb_cpu`).

Elsewhere its weights run as float layers, and so do a mixture's experts on bitsandbytes' CPU kernel.

`--quantization bitsandbytes` on a float checkpoint (vLLM's in-flight 4-bit, `QuantSpec.online`) quantizes
every linear layer but the routers, and every mixture's experts, to NF4 in blocks of 64 (`ONLINE_BLOCK`) as
each becomes whole, as bitsandbytes' `quantize_4bit` does with its defaults (each value times the
reciprocal of its block's absolute maximum, to the nearest level; the scales float32: vLLM double-quantizes
them and expands them again at load, so its scales carry an 8-bit rounding these do not), then holds them
as above; where nothing keeps 4 bits, the float layer takes NF4's values in their place (`representable`),
so every device computes the same model. A layer whose inputs (this rank's) are no multiple of 64 is
refused by name before anything loads (bitsandbytes' blocks would run across its rows)."""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
from collections.abc import Collection, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gapless import env
from gapless.model.quant.formats import QuantFormatError, QuantSpec

if TYPE_CHECKING:
    from gapless.model.quant.int4_layouts import Unpacked

log = logging.getLogger(__name__)

# bitsandbytes' codebooks (`bitsandbytes.functional`'s NF4 and FP4 maps), by code
NF4 = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
)  # fmt: skip
FP4 = (
    0.0, 0.005208333333, 0.66666667, 1.0, 0.33333333, 0.5, 0.16666667, 0.25,
    -0.0, -0.005208333333, -0.66666667, -1.0, -0.33333333, -0.5, -0.16666667, -0.25,
)  # fmt: skip
TABLES = {"nf4": NF4, "fp4": FP4}
STATE = ".quant_state.bitsandbytes__"  # + the quant type: the tensor holding a weight's JSON state
PARTS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")  # `weight.<part>`
QUANT_TYPES = ("nf4", "fp4")


def _split(name: str) -> tuple[str, str] | None:
    """(the weight's name, its part: "state" or one of `PARTS`) for a 4-bit weight's side tensor; None
    for every other tensor."""
    if STATE in name:
        return name.split(STATE, 1)[0], "state"
    weight, _, part = name.rpartition(".")
    return (weight, part) if part in PARTS and weight.endswith("weight") else None


def _state(t: torch.Tensor, where: str) -> dict[str, Any]:
    try:
        state = json.loads(bytes(t.to(torch.uint8).flatten().tolist()))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise QuantFormatError(f"{where}: its bitsandbytes quant_state is not readable JSON: {e}") from None
    kind = state.get("quant_type") if isinstance(state, dict) else None
    if kind not in QUANT_TYPES:
        raise QuantFormatError(
            f"{where}: bitsandbytes quant_type {kind!r} is not read; {' or '.join(QUANT_TYPES)}"
        )
    return state


def _blockwise(values: torch.Tensor, scales: torch.Tensor, block: int, where: str) -> torch.Tensor:
    """values (float32, flat) times one scale per `block` of them (the last block may be short)."""
    n = values.numel()
    if block < 1:
        raise QuantFormatError(f"{where}: a quant_state blocksize of {block}")
    if scales.numel() != -(-n // block):
        raise QuantFormatError(f"{where}: {scales.numel()} scales for {n} values in blocks of {block}")
    return values * scales.repeat_interleave(block)[:n]


def dequantize(parts: dict[str, torch.Tensor], where: str) -> torch.Tensor:
    """One weight in float32 from its tensors (`weight`: the packed codes, the rest by part name, `state`
    the JSON's tensor), as bitsandbytes' own `dequantize_4bit` computes it."""
    missing = _missing(parts, where)
    if missing:
        named = ["quant_state" if p == "state" else p for p in missing]
        raise QuantFormatError(f"{where}: the bitsandbytes 4-bit checkpoint lacks its {', '.join(named)}")
    state = _state(parts["state"], where)
    nested = "nested_blocksize" in state
    shape = [int(s) for s in state["shape"]]
    n = 1
    for s in shape:
        n *= s
    absmax = parts["absmax"].float().flatten()
    if nested:
        codes = parts["nested_quant_map"].float()[parts["absmax"].flatten().long()]
        nested_absmax = parts["nested_absmax"].float().flatten()
        absmax = _blockwise(codes, nested_absmax, int(state["nested_blocksize"]), where)
        absmax = absmax + float(state["nested_offset"])
    packed = parts["weight"].contiguous().view(torch.uint8).flatten()
    if packed.numel() * 2 < n:
        raise QuantFormatError(f"{where}: {packed.numel()} bytes of codes for a weight of {shape}")
    codes = torch.stack([packed >> 4, packed & 15], dim=1).flatten()[:n].long()
    table = parts["quant_map"].float().flatten()
    if table.numel() != 16:
        raise QuantFormatError(f"{where}: a quant_map of {table.numel()} values (a 4-bit codebook has 16)")
    return _blockwise(table[codes], absmax, int(state["blocksize"]), where).view(shape)


def dequantized(weights: Iterable[tuple[str, Any]], device: torch.device) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors with each 4-bit weight's tensors (wherever in the stream they come)
    replaced by that weight in float32 on `device` (where the model is: a GPU dequantizes an 8B model's
    weights in a moment, where a CPU thread takes ~10 ns a value), yielded as its last tensor arrives;
    every other tensor as it is. A weight whose tensors have not all come by the end is refused by name."""
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    count, numel = 0, 0
    for name, tensor in weights:
        hit = _split(name)
        if hit is None and not (name in waiting or _packed(name, tensor)):
            yield name, tensor
            continue
        weight, part = hit if hit is not None else (name, "weight")
        parts = waiting.setdefault(weight, {})
        parts[part] = tensor
        if not _missing(parts, weight):
            w = dequantize({k: t.to(device) for k, t in waiting.pop(weight).items()}, weight)
            count, numel = count + 1, numel + w.numel()
            yield weight, w
    for weight, parts in waiting.items():  # (each lacks a tensor: refused, naming it)
        dequantize(parts, weight)
    log.info("bitsandbytes 4-bit: %d weights (%.1fM values) read as floats", count, numel / 1e6)


def _packed(name: str, tensor: Any) -> bool:
    """Whether a `...weight` tensor is 4-bit codes: one column of bytes (or of the quant storage's dtype),
    where a float weight is [N, K]."""
    return (
        name.endswith("weight")
        and isinstance(tensor, torch.Tensor)
        and tensor.dim() == 2
        and tensor.shape[1] == 1
    )


def _missing(parts: dict[str, torch.Tensor], where: str) -> list[str]:
    """The parts a 4-bit weight's tensors still lack (the nested scales' where its state names them)."""
    need = ["weight", "state", "absmax", "quant_map"]
    if "state" in parts and "nested_blocksize" in _state(parts["state"], where):
        need += ["nested_absmax", "nested_quant_map"]
    return [p for p in need if p not in parts]


# the loader's scheme protocol (`gapless.model.quant.formats`), for a load that keeps 4-bit weights (`kept`)
SCALE_NAMES: tuple[str, ...] = ()  # (the checkpoint's side tensors never reach the loader: `dequantized`)
BLOCKS = (64, 128, 256, 512, 1024, 2048, 4096)  # bitsandbytes' block sizes, its default first
ONLINE_BLOCK = BLOCKS[0]  # `--quantization bitsandbytes` at load: NF4 in bitsandbytes' default blocks


@functools.cache
def _fused_cpu_kernel() -> bool:
    """Whether bitsandbytes is installed and runs its fused 4-bit kernel on this CPU (where it does not, its
    layers dequantize their whole weight on every call: slower than a float layer)."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return False
    import bitsandbytes

    with torch.device("meta"):
        probe = bitsandbytes.nn.Linear4bit(64, 64, bias=False)
    return bool(getattr(probe, "support_avx512bf16_for_cpu", False))


def kept(device: torch.device) -> str | None:
    """What keeps a load's 4-bit weights quantized on `device` (the module's docstring): "triton" on CUDA
    (and on the CPU where the tests run the Triton GEMM there, `int4.TRITON_ON_CPU`), "bitsandbytes" on a
    one-rank CPU where its fused kernel runs; None: float layers."""
    from gapless.model import parallel
    from gapless.model.quant import int4

    if env.BNB_WEIGHTS.get() != "auto":
        return None
    if device.type == "cuda" or device.type == "cpu" and int4.TRITON_ON_CPU:
        return "triton"
    if device.type != "cpu" or parallel.current().size != 1:
        return None
    return "bitsandbytes" if _fused_cpu_kernel() else None


class Bnb4LinearMethod:
    """`x W^T + b` through bitsandbytes' `Linear4bit` holding W's codes and scales (x in bfloat16)."""

    quant_method = "bitsandbytes"

    def __init__(self, codes: torch.Tensor, state: Any, kind: str) -> None:
        import bitsandbytes

        n, k = state.shape
        with torch.device("meta"):
            self.linear: Any = bitsandbytes.nn.Linear4bit(
                k, n, bias=False, compute_dtype=torch.bfloat16, quant_type=kind
            )
        self.linear.weight = bitsandbytes.nn.Params4bit(
            codes, quant_state=state, quant_type=kind, blocksize=state.blocksize, compress_statistics=False,
            bnb_quantized=True, module=self.linear,
        )  # fmt: skip
        self.linear.eval()
        with torch.no_grad():  # (its first call lays the codes out for its CPU kernel: here, not in a
            self.linear(torch.zeros(1, k, dtype=torch.bfloat16))  # compiled graph's first run)
        self.name = f"bitsandbytes {kind} b{state.blocksize} (bitsandbytes' CPU kernel)"

    def apply(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x.to(torch.bfloat16)).to(x.dtype)
        bias = getattr(layer, "bias", None)
        return y if bias is None else y + bias

    def tensors(self) -> list[torch.Tensor]:
        state = self.linear.weight.quant_state
        return [self.linear.weight.data, state.absmax, state.code]


def usual_targets(model: nn.Module) -> list[str]:
    """`int4.usual_targets`: every linear layer but the routers, and every mixture's experts."""
    from gapless.model.quant import int4

    return int4.usual_targets(model)


def quantized_modules(model: nn.Module, spec: QuantSpec, targets: set[str]) -> list[str]:
    """`usual_targets`; quantized at load (`spec.online`), each one's inputs (this rank's) in whole blocks
    of `ONLINE_BLOCK`, else a one-line QuantFormatError naming the layer."""
    from gapless.model.quant import int4

    modules = usual_targets(model)
    if spec.online:
        blocks = f"bitsandbytes' blocks of {ONLINE_BLOCK}"
        int4.check_inputs(model, modules, ONLINE_BLOCK, "bitsandbytes", blocks)
    return modules


def prepare(model: nn.Module, spec: QuantSpec, modules: list[str]) -> None:
    """Nothing: the layers load their float weights (dequantized as read), `finish_module` keeps them."""


def _gives_back(back: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether weights quantized again, `back` (in w's dtype), are `w`: exactly in float32, else within
    that dtype's rounding of the float32 product (its last bit)."""
    return torch.equal(back, w) or w.dtype != torch.float32 and torch.allclose(back, w, rtol=2**-7, atol=0)


def _in_blocks(w: torch.Tensor, kind: str, block: int) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor]]:
    """For each slice of `w`'s rows [N, K] (a few million values: bounded memory on any device), the
    slice, its codes in codebook `kind` (int16: each value's nearest level once divided by its block's
    absolute maximum, blocks of `block` along the rows) and those absolute maxima (float32 [rows, K /
    block])."""
    table = torch.tensor(TABLES[kind], dtype=torch.float32, device=w.device)
    order = table.argsort()
    bounds = (table[order][1:] + table[order][:-1]) / 2
    by_rank = order.to(torch.int16)
    n, k = w.shape
    step = max(1, (1 << 22) // k)
    for r in range(0, n, step):
        rows = slice(r, r + step)
        blocks = w[rows].float().view(-1, k // block, block)
        absmax = blocks.abs().amax(-1)
        # (times the reciprocal, as bitsandbytes' `quantize_4bit`: the same codes at its levels' midpoints)
        normalized = blocks * (1.0 / absmax.clamp(min=torch.finfo(torch.float32).tiny))[..., None]
        yield rows, by_rank[torch.bucketize(normalized, bounds, out_int32=True)].view(-1, k), absmax


def _values(q: torch.Tensor, absmax: torch.Tensor, kind: str) -> torch.Tensor:
    """The float32 weights codes `q` [rows, K] and their blocks' `absmax` [rows, K / block] stand for."""
    table = torch.tensor(TABLES[kind], dtype=torch.float32, device=q.device)
    return (table[q.long()].view(*absmax.shape, -1) * absmax[..., None]).view_as(q)


def codes(
    w: torch.Tensor, kind: str, block: int, check: bool = True
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(codes int16 [N, K], absmax float32 [N, K / block]) of `w` [N, K] in codebook `kind`, blocks of
    `block` along its rows (K a multiple of it), that give `w` back (`_gives_back`); None where none do
    (a weight not so quantized, or in other blocks). Without `check` (a float weight quantized at load),
    its nearest codes, whatever they give back."""
    out, scales = torch.empty(w.shape, dtype=torch.int16, device=w.device), list[torch.Tensor]()
    for rows, q, absmax in _in_blocks(w, kind, block):
        if check and not _gives_back(_values(q, absmax, kind).to(w.dtype), w[rows]):
            return None
        out[rows] = q
        scales.append(absmax)
    return out, torch.cat(scales)


def representable(w: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """`w` [..., K] (a layer's weight, or a mixture's experts' [E, N, K]) as the nearest weight `spec`'s
    codebook holds in bitsandbytes' default blocks of 64 (where K allows; else `w`): a `--load-format
    dummy` load's random weights (`gapless.bench.quant`'s `-nf4` shapes), which `finish_module` then keeps
    as a checkpoint's."""
    if w.shape[-1] % BLOCKS[0]:
        return w
    rows = w.reshape(-1, w.shape[-1])
    out = torch.empty_like(rows)
    for sl, q, absmax in _in_blocks(rows, spec.codebook, BLOCKS[0]):
        out[sl] = _values(q, absmax, spec.codebook).to(w.dtype)
    return out.view_as(w)


def _blocks(k: int, spec: QuantSpec) -> tuple[int, ...]:
    """The block sizes to try, in order, on a weight of `k` inputs: `ONLINE_BLOCK` quantized at load; else
    each of `BLOCKS` dividing `k` (the checkpoint's is the one that gives its weight back)."""
    return (ONLINE_BLOCK,) if spec.online else tuple(b for b in BLOCKS if k % b == 0)


def finish_module(layer: Any, spec: QuantSpec) -> None:
    """`layer`'s float weight quantized again in the first block size that gives back the same weight
    (to within its dtype's rounding, for a model below float32), held by what `kept` names and freed; a
    weight none gives back (a layer the checkpoint kept in float) stays float. A mixture's experts
    likewise for the Triton GEMM (`_hold_experts`); bitsandbytes' kernel takes none. Quantized at load
    (`spec.online`): in `ONLINE_BLOCK`s, unchecked; where nothing keeps 4 bits, its values in place."""
    from gapless.model.moe import Experts

    if isinstance(layer, Experts):
        if kept(layer.gate_up_proj.device) == "triton":
            _hold_experts(layer, spec)
        elif spec.online:
            for w in (layer.gate_up_proj.data, layer.down_proj.data):
                w.copy_(representable(w, spec))
        return
    w = layer.weight.data
    where = kept(w.device)
    if where is None and spec.online:
        w.copy_(representable(w, spec))
        return
    hold = _hold_for_triton if where == "triton" else _hold_for_bitsandbytes
    for block in _blocks(w.shape[1], spec):
        if hold(layer, w, spec.codebook, block, not spec.online):
            return


def _hold_for_triton(layer: Any, w: torch.Tensor, kind: str, block: int, check: bool) -> bool:
    """Whether `w` is `kind`'s in blocks of `block` (`codes`; not `check`ed: taken as it rounds); if so
    `layer` holds its codes for the int4 path's Triton GEMM (`int4.Int4LinearMethod` with the codebook's
    levels), its float weight freed."""
    from gapless.model.quant import int4
    from gapless.model.quant.int4_layouts import Int4Spec

    found = codes(w, kind, block, check)
    if found is None:
        return False
    spec = Int4Spec("bitsandbytes", 4, block, sym=True, codebook=kind)
    int4.hold(layer, _unpacked(found, kind), spec, w.dtype, "triton")
    return True


Codes = tuple[torch.Tensor, torch.Tensor]  # (codes int16 [N, K], absmax float32 [N, K / block]): `codes`


def _unpacked(found: Codes, kind: str) -> Unpacked:
    """`codes`' result as the int4 path's form (`int4_layouts.Unpacked`): the codes, each block's absolute
    maximum its scale, no zeros, codebook `kind`'s levels."""
    from gapless.model.quant.int4_layouts import Unpacked

    q, absmax = found
    return Unpacked(
        q, absmax, torch.zeros_like(absmax), levels=torch.tensor(TABLES[kind], dtype=torch.float32)
    )


def _expert_codes(weights: torch.Tensor, spec: QuantSpec) -> tuple[int, list[Codes]] | None:
    """(the block, each expert's `codes`) of a mixture's float weights [E, N, K] in the first block size
    that gives back every expert's weight (quantized at load: `ONLINE_BLOCK`'s); None where none does."""
    for block in _blocks(weights.shape[2], spec):
        found: list[Codes] = []
        for w in weights:  # (the first expert not given back ends the block's try)
            code = codes(w, spec.codebook, block, not spec.online)
            if code is None:
                break
            found.append(code)
        else:
            return block, found
    return None


def _hold_experts(experts: Any, qspec: QuantSpec) -> None:
    """A mixture's `Experts` (this rank's float weights) held as codes for the grouped GEMM with the
    codebook (`int4_experts.install_experts`, its weights not cut again), gate/up and down each in its own
    first block size that gives back every expert's weight; where either gives none back (experts the
    checkpoint kept in float), they stay float."""
    from gapless.model.quant import int4_experts
    from gapless.model.quant.int4_layouts import Int4Spec

    kind = qspec.codebook
    gate_up, down = (_expert_codes(w.data, qspec) for w in (experts.gate_up_proj, experts.down_proj))
    if gate_up is None or down is None:
        return
    shards: dict[tuple[int, str], Unpacked] = {}
    for e, (gu, dn) in enumerate(zip(gate_up[1], down[1])):
        both = _unpacked(gu, kind)  # (gate's rows, then up's)
        shards[(e, "gate")] = both.map(lambda t: t[: experts.inter])
        shards[(e, "up")] = both.map(lambda t: t[experts.inter :])
        shards[(e, "down")] = _unpacked(dn, kind)
    spec, down_spec = (Int4Spec("bitsandbytes", 4, b, sym=True, codebook=kind) for b in (gate_up[0], down[0]))
    dtype = experts.gate_up_proj.dtype
    int4_experts.install_experts(experts, shards, spec, dtype, "bitsandbytes experts", down_spec, cut=False)


def _hold_for_bitsandbytes(layer: Any, w: torch.Tensor, kind: str, block: int, check: bool) -> bool:
    """As `_hold_for_triton`, by bitsandbytes' own quantizer, for its `Linear4bit` (`Bnb4LinearMethod`)."""
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    q, state = quantize_4bit(w.float(), blocksize=block, compress_statistics=False, quant_type=kind)
    if check and not _gives_back(dequantize_4bit(q, state).to(w.dtype), w):
        return False
    layer.linear_method = Bnb4LinearMethod(q, state, kind)
    layer.weight.data = w.new_empty(0)
    return True


def finish(model: nn.Module, spec: QuantSpec, modules: list[str], done: Collection[str] = ()) -> None:
    """After loading: `finish_module` on each of `modules` not `done` (the loader's rounding finishes each
    layer as it becomes whole); how many layers were kept logged."""
    for name in modules:
        if name not in done:
            finish_module(model.get_submodule(name), spec)
    from gapless.model.moe import Experts

    layers = [model.get_submodule(n) for n in modules]
    methods = [getattr(m, "linear_method", None) for m in layers]
    kept_layers = sum(getattr(m, "quant_method", None) == "bitsandbytes" for m in methods)
    experts = [m for m in layers if isinstance(m, Experts)]
    log.info(
        "bitsandbytes %s: %d of %d linear layers and %d of %d mixtures' experts kept in 4 bits (%s)",
        spec.codebook,
        kept_layers,
        len(modules) - len(experts),
        sum(e.int_quant is not None for e in experts),
        len(experts),
        "bitsandbytes' CPU kernel" if any(isinstance(m, Bnb4LinearMethod) for m in methods) else "Triton",
    )
