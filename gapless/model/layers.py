"""Building blocks of the decoder, written tensor-parallel-ready.

Linear and embedding layers are column- or row-parallel over a world of size `tp_size` (1 for now).
Each parameter carries a `weight_loader` that copies its shard out of a full checkpoint tensor, so
tensor parallelism over `torch.distributed` later changes `tp_rank`/`tp_size` and an all-reduce,
not the model code.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def _set_loader(param: nn.Parameter, loader: Callable[..., None]) -> nn.Parameter:
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"weight shape {tuple(loaded.shape)} does not fit parameter {tuple(param.shape)}")
    param.data.copy_(loaded)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split by output rows across ranks; each rank holds out_features/tp_size rows."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        super().__init__()
        assert out_features % tp_size == 0, "output features must divide by the tensor-parallel size"
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.out_per_rank = out_features // tp_size
        self.weight = _set_loader(nn.Parameter(torch.empty(self.out_per_rank, in_features)), self.load_shard)
        self.bias = (
            _set_loader(nn.Parameter(torch.empty(self.out_per_rank)), self.load_shard) if bias else None
        )

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        n = param.shape[0]
        default_weight_loader(param, loaded.narrow(0, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul (gate+up, q+k+v).

    `shard_sizes` maps each checkpoint shard name to its full output size; a rank's fused weight is
    the concatenation of its slice of every shard.
    """

    def __init__(
        self,
        in_features: int,
        shard_sizes: dict[str, int],
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias, tp_rank, tp_size)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        off = 0
        for name, size in shard_sizes.items():
            assert size % tp_size == 0
            self.shard_offsets[name] = (off, size // tp_size)
            off += size // tp_size
        self.output_sizes = [size for _, size in self.shard_offsets.values()]

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        off, n = self.shard_offsets[shard_id]
        default_weight_loader(param.data.narrow(0, off, n), loaded.narrow(0, self.tp_rank * n, n))


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split by input columns; partial sums are all-reduced across ranks."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        super().__init__()
        assert in_features % tp_size == 0, "input features must divide by the tensor-parallel size"
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.weight = _set_loader(
            nn.Parameter(torch.empty(out_features, in_features // tp_size)), self.load_shard
        )
        # the bias is added once, after the reduction
        self.bias = (
            _set_loader(nn.Parameter(torch.empty(out_features)), default_weight_loader) if bias else None
        )

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        n = param.shape[1]
        default_weight_loader(param, loaded.narrow(1, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.tp_size > 1:
            torch.distributed.all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; out-of-shard ids contribute zeros before the all-reduce."""

    def __init__(self, vocab_size: int, dim: int, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.rows_per_rank = math.ceil(vocab_size / tp_size)
        self.vocab_start = tp_rank * self.rows_per_rank
        self.vocab_size = vocab_size
        self.weight = _set_loader(nn.Parameter(torch.empty(self.rows_per_rank, dim)), self.load_shard)

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        rows = loaded[self.vocab_start : self.vocab_start + self.rows_per_rank]
        param.data.zero_()
        param.data[: rows.shape[0]].copy_(rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.rows_per_rank)
        y = F.embedding(local.clamp(0, self.rows_per_rank - 1), self.weight) * inside.unsqueeze(-1)
        torch.distributed.all_reduce(y)
        return y


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection split by vocabulary rows; logits are gathered across ranks."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        logits = F.linear(hidden, self.weight)
        if self.tp_size > 1:
            parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
            torch.distributed.all_gather(parts, logits)
            logits = torch.cat(parts, dim=-1)
        return logits[..., : self.vocab_size]


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, as Hugging Face does, then cast back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _set_loader(nn.Parameter(torch.ones(dim)), default_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies of rotary embeddings, with `linear` or `llama3` scaling applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
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
    """Neox-style (rotate-half) RoPE with a cos/sin table precomputed for every position."""

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, heads, d], k: [T, kv_heads, d]; positions: [T]."""
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
