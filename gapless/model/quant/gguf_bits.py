"""Fields of GGUF blocks read with torch's integer ops (`gguf_blocks`, `gguf_iq`): each takes uint8 bytes on
its last axis, as llama.cpp's structs lay them out (little-endian)."""

from __future__ import annotations

import torch


def f16(raw: torch.Tensor) -> torch.Tensor:
    """Little-endian f16 fields (last axis: 2 bytes each) as float32."""
    return raw.contiguous().view(torch.float16).float().squeeze(-1)


def words(raw: torch.Tensor) -> torch.Tensor:
    """Little-endian unsigned words (last axis: their bytes) as int64."""
    return (raw.long() << (8 * torch.arange(raw.shape[-1], device=raw.device))).sum(-1)


def nibbles(raw: torch.Tensor) -> torch.Tensor:
    """Every byte's low nibble, then every byte's high one: 32 weights from 16 bytes (low: weights 0-15)."""
    return torch.cat([raw & 15, raw >> 4], dim=-1)


def each_nibble(raw: torch.Tensor) -> torch.Tensor:
    """Each byte's low nibble, then its high one, byte by byte (a block's 4-bit scales)."""
    return torch.stack([raw & 15, raw >> 4], dim=-1).flatten(-2)


def bits(raw: torch.Tensor, count: int) -> torch.Tensor:
    """Bits 0 .. count - 1 of each byte (last axis), bit k along a new axis before it."""
    shifts = torch.arange(count, device=raw.device, dtype=torch.uint8)[:, None]
    return (raw[..., None, :] >> shifts) & 1


def signed(values: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
    """`values` [..., 8] negated where each sign byte's bit k (`raw` [...]) is set: value k's sign."""
    shifts = torch.arange(8, device=raw.device, dtype=torch.uint8)
    return torch.where(((raw.to(torch.uint8)[..., None] >> shifts) & 1).bool(), -values, values)
