"""M-RoPE positions of a prompt (Qwen2.5-VL), as transformers' `get_rope_index` gives them: text tokens
count on by one in all three sections (time, height, width); an image's rows, a (t, h, w) grid of merged
blocks, take `start + (t, h, w)` with `start` the position after the text before it, and the text after
it goes on from `start + max(h, w)`. So a prompt with images ends below its length: every position after
its last image (the rest of the prompt, then each generated token) is its index plus `delta` (<= 0), in
every section: plain RoPE there, which the decode's 1-D positions give once the delta is added
(`gapless.engine.runner`).

Host side, torch only: the scheduler slices a request's positions for each extend chunk (`rope_rows`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class PromptRope(NamedTuple):
    """A prompt's M-RoPE positions [3, prompt length] and the delta of every position after them."""

    positions: torch.Tensor
    delta: int


def prompt_rope(length: int, images: list[tuple[int, int, torch.Tensor]], merge: int) -> PromptRope:
    """The positions of a prompt of `length` tokens whose images are (start, run length, (t, h, w) grid in
    patches), in order; each image's run is its t * (h / merge) * (w / merge) rows."""
    parts, pos, at = [], 0, 0  # pos: the next text position; at: the next token
    for start, run, grid in images:
        t, h, w = (int(n) for n in grid.tolist())
        gh, gw = h // merge, w // merge
        if start < at:
            raise ValueError("images overlap, or are not in prompt order")
        if run != t * gh * gw:
            raise ValueError(f"an image's run of {run} tokens for a grid of {t * gh * gw} rows")
        parts.append(torch.arange(start - at).expand(3, -1) + pos)
        pos += start - at
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
        parts.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
        pos += max(gh, gw)
        at = start + t * gh * gw
    if at > length:
        raise ValueError(f"an image's rows run past the prompt's end ({at} > {length} tokens)")
    parts.append(torch.arange(length - at).expand(3, -1) + pos)
    positions = torch.cat(parts, dim=1)
    return PromptRope(positions, pos - at)


def rope_rows(rope: PromptRope | None, lo: int, hi: int) -> torch.Tensor:
    """The [3, hi - lo] positions of tokens [lo, hi) of a sequence (its prompt's, then generated ones);
    `rope` None: a prompt without images (every position its index)."""
    if rope is None:
        return torch.arange(lo, hi).expand(3, -1)
    n = rope.positions.shape[1]
    tail = torch.arange(max(lo, n), max(hi, n)).expand(3, -1) + rope.delta
    return torch.cat([rope.positions[:, min(lo, n) : min(hi, n)], tail], dim=1)
