"""Building blocks of the decoder.

The linear and embedding layers carry their tensor-parallel roles (column-parallel: split by output
features; row-parallel: split by input features, partial sums all-reduced; vocab-parallel: split by
vocabulary rows), so the model code says where tensor parallelism shards it and nothing else. Each takes
its rank and world size from the process's group (`gapless.model.parallel.current()`) when it is made,
holds its piece of the weight, and cuts that piece out of the whole checkpoint tensor in `load_shard`.
With one rank (the default) they hold whole weights and no collective runs. Each parameter carries a
`weight_loader` that copies it (or its fused shard) out of a checkpoint tensor.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gapless.model import parallel
from gapless.model.quant.base import UNQUANTIZED, LinearMethod, PendingNorm


def _set_loader(param: nn.Parameter, loader: Callable[..., None]) -> nn.Parameter:
    param.weight_loader = loader  # type: ignore[attr-defined]  # an attribute torch's Parameter lacks
    return param


def set_weight_loader(param: nn.Parameter, loader: Callable[..., None]) -> nn.Parameter:
    """`param`, carrying `loader` as its `weight_loader` (for layers defined outside this module)."""
    return _set_loader(param, loader)


_DEFERRED = contextvars.ContextVar("deferred_weights", default=False)


@contextlib.contextmanager
def deferred_weights() -> Iterator[None]:
    """Build layers whose weights (`new_weight`: the linear layers', the experts') hold no memory until a
    float tensor is loaded into them (`materialize`): a quantized layer's weight is replaced by its
    quantized form without its float one ever being allocated, so a quantized checkpoint loads in about
    its own size, not the float model's."""
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def new_weight(*shape: int) -> nn.Parameter:
    """An uninitialized weight of `shape` in the default dtype and device; inside `deferred_weights` a
    placeholder of that shape, dtype and device whose elements all share one (`is_placeholder`)."""
    if _DEFERRED.get():
        return nn.Parameter(torch.empty(()).expand(*shape))
    return nn.Parameter(torch.empty(*shape))


def is_placeholder(t: torch.Tensor) -> bool:
    """Whether `t` is a deferred weight not yet given its memory (`new_weight`)."""
    return t.numel() > 1 and all(s == 0 for s in t.stride())


def materialize(param: nn.Parameter) -> None:
    """Give a deferred weight its memory (uninitialized, for a loader to fill); any other is left as it is."""
    if is_placeholder(param):
        param.data = torch.empty(param.shape, dtype=param.dtype, device=param.device)


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"weight shape {tuple(loaded.shape)} does not fit parameter {tuple(param.shape)}")
    param.data.copy_(loaded)


class _Linear(nn.Module):
    """y = x W^T + b, with W and b loaded whole from the checkpoint (through `load_shard`), computed by the
    layer's `linear_method` (`gapless.model.quant`; the float weight unless the loader chose another)."""

    # the CPU's prepacked GEMM of this layer, set after loading (`gapless.model.cpu_gemm`); None: plain
    cpu_gemm: Callable[[torch.Tensor], torch.Tensor] | None = None
    linear_method: LinearMethod = UNQUANTIZED
    # the layer's resident LoRA adapters (`gapless.lora.table.LoRALayer`), whose delta is added to the
    # output; None: no adapters
    lora: Any = None
    # an int4 act-order MLP's intermediate order, on its gate/up and down: gate/up's rows (of each shard)
    # and down's inputs hold that width reordered at load (`gapless.model.quant.int4.takes_down_order`), its
    # column j the checkpoint's `inter_order[j]`; LoRA adapters are taken in it. None: as stored
    inter_order: torch.Tensor | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = _set_loader(new_weight(out_features, in_features), self.load_shard)
        self.bias = _set_loader(nn.Parameter(torch.empty(out_features)), self.load_shard) if bias else None

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor | PendingNorm, gated: str | None = None) -> torch.Tensor:
        """`gated` (a `GATED_ACTIVATIONS` key, where `takes_gated`): x is that activation's input, [gate,
        up], which the layer's method applies as it reads x. x a `PendingNorm` (where `takes_norm`): the
        layer's method norms it as it reads it."""
        method: Any = self.linear_method  # (`takes_gated`'s and `takes_norm`'s take more arguments)
        if isinstance(x, PendingNorm):
            return method.apply(self, x.x, norm=x)
        if gated is not None:
            return method.apply(self, x, gated)
        y = self.linear_method.apply(self, x)
        return y if self.lora is None else self.lora.add(x, y)

    def takes_gated(self, rows: int) -> bool:
        """Whether this layer's method takes x of `rows` rows as a gated activation's input (the FP8 GEMV
        makes act(gate) * up as it loads x: no activation launch before it); never with a LoRA adapter,
        which needs x itself."""
        ask = getattr(self.linear_method, "takes_gated", None)
        return self.lora is None and ask is not None and ask(self, rows)

    def takes_norm(self, rows: int) -> bool:
        """Whether this layer's method takes x of `rows` rows as an RMSNorm's input (`PendingNorm`: the FP8
        GEMV adds the residual and norms x as it loads it, no norm launch before it); never with a LoRA
        adapter, which needs the normed x itself."""
        ask = getattr(self.linear_method, "takes_norm", None)
        return self.lora is None and ask is not None and ask(self, rows)

    def input_rounding(self, rows: int) -> int:
        """The column group in which this layer's method would round x of `rows` rows to e4m3 before its
        GEMM (0: it would not), for the fused kernel before the layer to do it as it writes x
        (`gapless.model.quant.base.RoundedRows`)."""
        ask = getattr(self.linear_method, "input_rounding", None)
        return 0 if ask is None else ask(self, rows)

    def input_order(self) -> torch.Tensor | None:
        """The order this layer's method reads x's columns in (int4 act-order; None: as they are), for the
        fused kernel before the layer to write them so beside x (`quant.base.OrderedColumns`)."""
        return getattr(self.linear_method, "written_order", None)


class ColumnParallelLinear(_Linear):
    """A linear layer split by output features (W's rows): each rank computes its slice of y, with no
    communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        tp = parallel.current()
        super().__init__(in_features, out_features // tp.size, bias)
        self.tp = tp

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        default_weight_loader(param, self.tp.part(loaded, self.tp.size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul (gate+up, q+k+v).

    `shard_sizes` maps each checkpoint shard name to its whole output size; the fused weight is the
    concatenation of this rank's piece of each shard, in that order, and each checkpoint tensor is cut and
    loaded into its place. A shard splits into one piece per rank, or into `shard_parts[name]` pieces
    shared by several ranks (KV heads fewer than ranks: each rank keeps the head its queries read).
    """

    def __init__(
        self,
        in_features: int,
        shard_sizes: dict[str, int],
        bias: bool = False,
        shard_parts: dict[str, int] | None = None,
    ) -> None:
        tp = parallel.current()
        self.shard_parts = {name: (shard_parts or {}).get(name, tp.size) for name in shard_sizes}
        local = {name: size // self.shard_parts[name] for name, size in shard_sizes.items()}
        _Linear.__init__(self, in_features, sum(local.values()), bias)
        self.tp = tp
        # where each shard sits in this rank's fused weight, and in a checkpoint tensor that fuses them whole
        self.shard_offsets = _offsets(local)
        self.checkpoint_offsets = _offsets(shard_sizes)
        self.output_sizes = list(local.values())

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        off, n = self.shard_offsets[shard_id]
        default_weight_loader(param.data.narrow(0, off, n), self.tp.part(loaded, self.shard_parts[shard_id]))


def _offsets(sizes: dict[str, int]) -> dict[str, tuple[int, int]]:
    """(offset, size) of each piece of a concatenation of pieces of `sizes`, in order."""
    offsets, off = {}, 0
    for name, size in sizes.items():
        offsets[name] = (off, size)
        off += size
    return offsets


class RowParallelLinear(_Linear):
    """A linear layer split by input features (W's columns): each rank's partial sums are all-reduced.
    The bias is added once: rank 0 holds it, the others a zero bias, so the GEMM call stays the plain
    layer's."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        tp = parallel.current()
        super().__init__(in_features // tp.size, out_features, bias)
        self.tp = tp

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if param.dim() == 2:
            default_weight_loader(param, self.tp.part(loaded, self.tp.size, dim=1))
        else:
            default_weight_loader(param, loaded if self.tp.rank == 0 else torch.zeros_like(loaded))

    def forward(self, x: torch.Tensor | PendingNorm, gated: str | None = None) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x, gated))


class ReplicatedLinear(_Linear):
    """A linear layer every tensor-parallel rank will hold whole (a mixture-of-experts router, Qwen2-MoE's
    shared-expert gate: small, and needed in full on each rank)."""


class VocabParallelEmbedding(nn.Module):
    """The embedding table, split by vocabulary rows: each rank holds `ceil(vocab / ranks)` rows, looks up
    the ids in its rows, gives zeros for the others, and the ranks' lookups are all-reduced. Rows past the
    checkpoint's table are zero."""

    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.tp = tp = parallel.current()
        self.vocab_size = vocab_size
        self.rows = -(-vocab_size // tp.size)
        self.first = tp.rank * self.rows
        self.weight = _set_loader(nn.Parameter(torch.empty(self.rows, dim)), self.load_shard)
        # this rank's rows kept quantized, where the loader chose so (a GGUF file's table): `lookup(ids,
        # dtype)` gives them as floats
        self.quantized_rows: Any = None

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        rows = loaded[self.first : min(self.first + self.rows, self.vocab_size)]
        param.data.zero_()
        param.data[: rows.shape[0]].copy_(rows)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quantized_rows is not None:
            return self.quantized_rows.lookup(ids, self.weight.dtype)
        return F.embedding(ids, self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._lookup(ids)
        local = ids - self.first
        outside = (local < 0) | (local >= self.rows)
        out = self._lookup(local.masked_fill(outside, 0))
        return self.tp.all_reduce(out.masked_fill_(outside[:, None], 0.0))


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection to vocabulary logits, split by vocabulary rows: each rank projects onto its
    rows and the logits are gathered, so every rank holds all of them (and samples the same token)."""

    cpu_gemm: Callable[[torch.Tensor], torch.Tensor] | None = None  # as `_Linear.cpu_gemm`
    linear_method: LinearMethod = UNQUANTIZED  # as `_Linear.linear_method`

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.linear_method.apply(self, hidden)
        if self.tp.size == 1:
            return logits
        return torch.cat(self.tp.all_gather(logits), dim=-1)[:, : self.vocab_size]


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, as Hugging Face does, then cast back.

    `norm(x)` is the norm of x; `norm(x, residual)` adds x to the residual stream first and returns
    (norm of the sum, the sum): vLLM's shape, which lets the fused kernel do the add and the norm in one
    pass over the row (`gapless.model.fused`, set in `fused` when chosen; torch otherwise). `feeds`: the
    linear layer the norm's output goes to, whose x the fused kernel rounds to e4m3 as it writes it where
    the layer asks (`_Linear.input_rounding`: an FP8 layer that would launch that rounding itself), or
    writes in the layer's column order beside it (`_Linear.input_order`: int4 act-order's gather). Where
    the layer takes the norm's input itself (`_Linear.takes_norm`: the FP8 GEMV at one row), nothing is
    launched: a `PendingNorm` stands in for the norm's output, and the layer writes the new residual."""

    kind = "llama"  # the arithmetic's name, a key of `RMS_NORMS` (and of the fused kernel's kinds)
    fused: Any = None  # the fused-kernels module when the model runs them (`gapless.model.fused`)

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _set_loader(nn.Parameter(torch.ones(dim)), default_weight_loader)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, feeds: _Linear | None = None
    ) -> torch.Tensor | PendingNorm | tuple[torch.Tensor | PendingNorm, torch.Tensor]:
        if self.fused is not None:
            if feeds is None:
                return self.fused.rms_norm(x, self.weight, self.eps, self.kind, residual)
            rows = x.numel() // x.shape[-1]
            if feeds.takes_norm(rows):
                return self._left_to_layer(x, residual)
            group = feeds.input_rounding(rows)
            return self.fused.rms_norm(
                x, self.weight, self.eps, self.kind, residual, group, feeds.input_order()
            )
        if residual is None:
            return self.normalize(x)
        residual = x + residual
        return self.normalize(residual), residual

    def _left_to_layer(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> PendingNorm | tuple[PendingNorm, torch.Tensor]:
        """The norm as the layer it feeds will compute it (`PendingNorm`), and with `residual`, the new
        residual: an empty tensor, which that layer writes."""
        out = None if residual is None else torch.empty(residual.shape, dtype=x.dtype, device=x.device)
        pending = PendingNorm(x, residual, self.weight, self.eps, self.kind, out)
        return pending if out is None else (pending, out)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """The torch reference: the norm of x alone."""
        if x.dtype == torch.float32:  # the same ops without the two no-op casts (each a dispatch on a CPU)
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Fp32ProductRMSNorm(RMSNorm):
    """OLMo 2's RMSNorm: the weight multiplies the fp32 normed values and the product is cast back
    (Llama's casts first, then multiplies), as transformers' OLMo 2 does; the same in fp32, not in bf16."""

    kind = "fp32"

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return (self._scale() * self._normed(x)).to(x.dtype)

    def _normed(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)

    def _scale(self) -> torch.Tensor:
        return self.weight


class OffsetRMSNorm(Fp32ProductRMSNorm):
    """Gemma's RMSNorm: the checkpoint stores weight - 1, so it scales by (1 + weight), in fp32 before the
    cast back, as transformers' Gemma does."""

    kind = "gemma"

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        self.weight.data.zero_()

    def _scale(self) -> torch.Tensor:
        return 1.0 + self.weight.float()


# a family's `norm_kind` -> its RMSNorm
RMS_NORMS: dict[str, type[RMSNorm]] = {"llama": RMSNorm, "fp32": Fp32ProductRMSNorm, "gemma": OffsetRMSNorm}


def make_rms_norm(dim: int, eps: float, kind: str) -> RMSNorm:
    """The family's RMSNorm (`RMS_NORMS`): Llama's, OLMo 2's fp32 product, or Gemma's `1 + weight`."""
    return RMS_NORMS[kind](dim, eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies of rotary embeddings, with `linear`, `llama3` or `freq_factors` scaling applied
    (the last each frequency divided by its own factor, a GGUF file's `rope_freqs`)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "freq_factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope scaling type {kind!r} is not supported")


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE with a cos/sin table precomputed for every position.

    q and k are rotated together, in one pass: per layer one gather of the table and four elementwise ops
    instead of two of each per tensor, which on a CPU (eager dispatch of every small op) is a visible
    share of a decode step. The table keeps sin with the sign of rotate-half folded in (`-sin` on the
    first half), so `x * cos + swap_halves(x) * sin` is bit for bit `x * cos + rotate_half(x) * sin`
    (negation is exact, in every dtype)."""

    cos_sin: torch.Tensor  # a buffer (register_buffer), which nn.Module's attribute typing cannot see

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        sin = emb.sin()
        sin[:, : head_dim // 2] *= -1
        # [positions, 2, head_dim]: cos, then rotate-half's signed sin
        self.register_buffer("cos_sin", torch.stack([emb.cos(), sin], dim=1), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, heads, d], k: [T, kv_heads, d]; positions: [T]."""
        return self.rotate(self.cos_sin[positions], q, k)

    def rotate(
        self, cos_sin: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k rotated by each token's row of the table (`cos_sin`: [T, 2, d])."""
        cos, sin = cos_sin.to(q.dtype).unsqueeze(2).unbind(1)  # each [T, 1, d]
        qk = torch.cat([q, k], dim=1)
        out = qk * cos + _swap_halves(qk) * sin
        return out.split([q.shape[1], k.shape[1]], dim=1)


class MRotaryEmbedding(RotaryEmbedding):
    """Qwen2-VL's multimodal RoPE (M-RoPE): the frequencies split into sections (`mrope_section`, cycled
    over time, height and width), each section rotated by its own position. Positions [3, T] (an extend
    whose prompt holds images: `gapless.model.vision.mrope`) or [T] (every section at the same
    position: plain RoPE, as in a decode)."""

    section: torch.Tensor  # a buffer: per column of the table, the row of the positions it takes

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        sections: tuple[int, ...],
    ) -> None:
        super().__init__(head_dim, max_positions, theta, scaling)
        if sum(sections) != head_dim // 2:
            raise ValueError(f"mrope_section {list(sections)} does not sum to head_dim / 2 = {head_dim // 2}")
        half = torch.cat([torch.full((n,), i % 3, dtype=torch.int64) for i, n in enumerate(sections)])
        self.register_buffer("section", torch.cat([half, half]), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().forward(positions, q, k)
        table = self.cos_sin[positions]  # [3, T, 2, d]: each section's rows, then column by column
        index = self.section.expand(1, *table.shape[1:])
        return self.rotate(table.gather(0, index).squeeze(0), q, k)


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    """[x2, x1] for x = [x1, x2] along the last dimension (rotate-half without its sign)."""
    half = x.shape[-1] // 2
    return x.unflatten(-1, (2, half)).flip(-2).flatten(-2)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU with the tanh approximation of GELU (Gemma's `gelu_pytorch_tanh`)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


GATED_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": silu_and_mul,
    "gelu_pytorch_tanh": gelu_tanh_and_mul,
}
