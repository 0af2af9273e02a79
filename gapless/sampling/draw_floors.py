"""The sort-free draw's floors on the torch side (`gapless.sampling.triton_sample` has the kernels): what
they are (`Floors`), the window that finds them for rows whose filters lie among their largest logits
without the kernels' searches (`window_floors`), and the tokens a set of floors keeps (`kept`, the
kernels' check)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

WINDOW = 64  # a row whose top-k is at most this takes its floors from its WINDOW largest logits
HALF = (torch.bfloat16, torch.float16)  # the logits' dtypes the window serves


@dataclass(frozen=True)
class Floors:
    """Each row's filters as `floors` leaves them, on the device: what `draw_with` keeps."""

    row_max: torch.Tensor  # [B] float32: the row's largest scaled logit (min-p's floor is relative to it)
    keys: torch.Tensor  # [B, 4] int32: top-k's range (lo, hi), then top-p's; once searched, lo == hi
    row_mass: torch.Tensor | None = None  # [B] float32: exp(y - row_max) summed (where the window needs it)


def window_floors(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    found: Floors,
    w: int,
) -> None:
    """Set in `found.keys` the floors of the sampled rows whose filters lie in their `w` largest logits,
    as `_search_kernel` finds them. A row with top-k of at most `w`: top-k's floor is its k-th largest
    scaled logit (not below its lowest finite one), top-p's the smallest kept value whose mass above
    (tokens of larger value) is under p times the kept mass (the window's tokens above the k-th, and every
    token tied with it, counted over the row). A row with top-p and no top-k, where the window's mass
    above its last value already reaches p times the row's (`found.row_mass`): top-p's floor by the same
    rule. Nothing syncs."""
    vocab = logits.shape[1]
    x = logits.topk(w, dim=-1).values  # [B, w], descending
    k = top_k.clamp(1, w).unsqueeze(1) - 1  # each row's k-th largest, at its place in the window
    kth = x.gather(1, k)
    y = x.float() / temperature.masked_fill(temperature <= 0, 1.0).unsqueeze(1)  # the kernels' division
    e = torch.exp(y - y[:, :1])
    above = (e.unsqueeze(1) * (y.unsqueeze(1) > y.unsqueeze(2))).sum(-1)  # [B, w]: the mass over each value
    sampled = temperature > 0
    rows = sampled & (top_k <= w)
    kept = (x >= kth) | ~rows.unsqueeze(1)
    ties = (logits >= kth).sum(-1, keepdim=True) - (x > kth).sum(-1, keepdim=True)
    total = e.masked_fill(x <= kth, 0.0).sum(-1, keepdim=True) + ties * e.gather(1, k)
    p_rows = rows
    if found.row_mass is not None:
        mass = found.row_mass.unsqueeze(1)
        free = sampled & (top_k >= vocab) & (above[:, -1:] >= top_p.unsqueeze(1) * mass).squeeze(1)
        total = torch.where(rows.unsqueeze(1), total, mass)
        p_rows = rows | free
    passing = kept & (above < top_p.unsqueeze(1) * total)
    nucleus = keys_of(y.masked_fill(~passing, float("inf")).amin(-1))
    k_floor = torch.maximum(keys_of(y.gather(1, k).squeeze(1)), found.keys[:, 0])
    keys = found.keys
    keys[:, :2] = torch.where(rows.unsqueeze(1), k_floor.unsqueeze(1), keys[:, :2])
    p_rows = p_rows & (top_p < 1.0)
    keys[:, 2:] = torch.where(p_rows.unsqueeze(1), nucleus.unsqueeze(1), keys[:, 2:])


def keys_of(y: torch.Tensor) -> torch.Tensor:
    """The kernels' `_key` by torch ops: float32 -> int32 whose signed order is the floats' order."""
    bits = (y + 0.0).view(torch.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def kept(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, found: Floors
) -> torch.Tensor:
    """bool [B, V]: the tokens `draw_with` keeps under `found`, by torch ops on the same numbers (the
    kernels' check)."""
    t = temperature.masked_fill(temperature == 0, 1.0)[:, None]
    y = logits.float() / t
    key = keys_of(y)
    floor = found.keys[:, 0].where(top_p >= 1.0, torch.maximum(found.keys[:, 0], found.keys[:, 2]))
    return (key >= floor[:, None]) & (y >= found.row_max[:, None] + min_p.log()[:, None])
