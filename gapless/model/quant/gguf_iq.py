"""GGUF's i-quants (llama.cpp's IQ4_NL, IQ4_XS and the lattice types IQ3_S, IQ3_XXS, IQ2_S, IQ2_XS,
IQ2_XXS, IQ1_M, IQ1_S), and MXFP4 (llama.cpp's MXFP4_MOE files' experts), in the affine form the other
types take (`gguf_blocks.affine_parts`): each weight is a small integer times its group's scale, exactly,
though the file stores an index into a table (IQ4's 16 non-uniform levels, MXFP4's e2m1 values doubled) or
into a lattice of 4 or 8 values (`gguf`'s own grids) with signs apart.

`parts` reads a matrix's blocks as llama.cpp's `dequantize_row_iq*` read them (ggml-quants.c), into
unsigned values `u` and, a group, `scale` and `offset` with `w = u * scale + offset`:

- 8 bits (`u = v + 128`): IQ4_NL and IQ4_XS (levels -127 .. 113), MXFP4 (+-0 .. 12, times half its
  block's e8m0 power of two), IQ3_XXS (+-4 .. 62), IQ2_* (+-8, 25, 43);
- 4 bits, where the signed values are every other integer: IQ3_S (+-1, 3 .. 15: `u = (v + 15) / 2`) and
  IQ1_S/IQ1_M (`8 (g + delta)` = +-1, 7, 9 with g in {-1, 0, 1}: `u = (v + 9) / 2`), a fractional zero.

The types the affine form takes in 8 bits are also read as a 4-bit codebook (`codes`: each weight's
index into its type's levels, and its group's scale; `CODEBOOKS`), which the int4 path's Triton GEMM runs
(on a GPU: 4 bits a weight where the affine form takes 8). Each has at most 16 signed values: IQ4's 16
levels, MXFP4's e2m1 values (the checkpoints' MXFP4 codebook: the file's doubled values with twice its
scale), IQ3_XXS's lattice values +-4, 12 .. 52, 62 (16), IQ2_*'s +-8, 25, 43 (6 of the 16 entries).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from gapless.model.quant.gguf_bits import each_nibble, f16, nibbles, signed, words
from gapless.model.quant.int4_layouts import FP4_E2M1

# (bits the unsigned values take, the weights one scale covers), as `gguf_blocks.AFFINE`
FORMS = {
    "IQ4_NL": (8, 32),
    "IQ4_XS": (8, 32),
    "MXFP4": (8, 32),
    "IQ3_XXS": (8, 32),
    "IQ3_S": (4, 32),
    "IQ2_XXS": (8, 32),
    "IQ2_XS": (8, 16),
    "IQ2_S": (8, 16),
    "IQ1_S": (4, 32),
    "IQ1_M": (4, 16),
}
# the signed values' offset to unsigned and their step: `u = (v + shift) / step`
_UNSIGNED = {"IQ3_S": (15, 2), "IQ1_S": (9, 2), "IQ1_M": (9, 2)}
# the types held as 4-bit indices into a codebook on a GPU (`codes`), by the codebook's name (a spec's
# `codebook`): those the affine form takes in 8 bits
CODEBOOKS = {
    "IQ4_NL": "iq4_nl",
    "IQ4_XS": "iq4_nl",
    "MXFP4": "mxfp4",
    "IQ3_XXS": "iq3_xxs",
    "IQ2_XXS": "iq2",
    "IQ2_XS": "iq2",
    "IQ2_S": "iq2",
}
_CODEBOOK_SOURCE = {"iq4_nl": "IQ4_NL", "iq3_xxs": "IQ3_XXS", "iq2": "IQ2_XXS"}  # (whose table gives it)
# the types indexing a table of 16 levels, and whose table it is
_LEVELS = {"IQ4_NL": "IQ4_NL", "IQ4_XS": "IQ4_NL", "MXFP4": "MXFP4"}


@functools.cache
def _table(qtype: str, device: torch.device) -> torch.Tensor:
    """`qtype`'s levels (IQ4, MXFP4: int16 [16]) or lattice (int16 [points, 4 or 8]; IQ1's in {-1, 0, 1}),
    from the `gguf` package's tables, on `device` (kept: a lookup in a captured graph copies nothing)."""
    from gguf import quants

    if qtype in _LEVELS:
        return torch.tensor(getattr(quants, _LEVELS[qtype]).kvalues, dtype=torch.int16, device=device)
    kind = getattr(quants, qtype)
    kind.init_grid()
    return torch.from_numpy(np.asarray(kind.grid).reshape(kind.grid_shape).astype(np.int16)).to(device)


def _lookup(qtype: str, index: torch.Tensor) -> torch.Tensor:
    """The levels or lattice points at `index` (int16; a lattice's along a new last axis)."""
    return _table(qtype, index.device)[index.to(torch.int32)]


def _even_signs(index: torch.Tensor) -> torch.Tensor:
    """The sign byte of a 7-bit index (IQ2_XXS/IQ2_XS/IQ3_XXS): its bits, the eighth their parity
    (llama.cpp's `ksigns_iq2xs`)."""
    index = index.to(torch.int32)
    parity = index.clone()
    for shift in (4, 2, 1):
        parity ^= parity >> shift
    return (index | ((parity & 1) << 7)).to(torch.uint8)


def _e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """MXFP4's block scales: half each e8m0 byte's power of two, 2^(e - 128), float32 (subnormal for e < 2),
    as ggml's `e8m0_to_fp32_half`."""
    return torch.ldexp(torch.ones_like(e, dtype=torch.float32), e.to(torch.int32) - 128)


def _leveled(qtype: str, blk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index uint8 [rows, blocks, weights a block], scale float32 [rows, blocks, groups a block]) of the
    blocks of a type indexing a table of levels (`_LEVELS`): each weight's level index, and its group's
    scale, `w = levels[index] * scale`."""
    if qtype == "MXFP4":  # e8m0, 16 bytes of level indices
        return nibbles(blk[..., 1:17]), _e8m0_half(blk[..., 0:1])
    d = f16(blk[..., 0:2])[..., None]
    if qtype == "IQ4_NL":  # d, 16 bytes of level indices
        return nibbles(blk[..., 2:18]), d
    # IQ4_XS: d, 2 bytes of scales' high bits, 4 of their low nibbles, 8 x 16 bytes of indices
    rows, n = blk.shape[:2]
    high = (words(blk[..., 2:4])[..., None] >> (2 * torch.arange(8, device=blk.device))) & 3
    scale = d * ((each_nibble(blk[..., 4:8]).long() | (high << 4)) - 32)
    return nibbles(blk[..., 8:136].reshape(rows, n, 8, 16)).flatten(2), scale


@functools.cache
def _signed_levels(codebook: str, device: torch.device) -> torch.Tensor:
    """Codebook `codebook`'s signed values (int16, ascending, at most 16): IQ4's levels, or a lattice's
    values with both signs."""
    table = _table(_CODEBOOK_SOURCE[codebook], device)
    if codebook == "iq4_nl":
        return table
    magnitudes = table.unique()
    return torch.cat([-magnitudes.flip(0), magnitudes])


def levels(codebook: str = "iq4_nl", device: torch.device | str = "cpu") -> torch.Tensor:
    """Codebook `codebook`'s 16 levels (a spec's `codebook` name, `CODEBOOKS`), float32; entries past its
    values (IQ2's 6) are 0 and never indexed. "mxfp4": e2m1's, as a checkpoint's MXFP4 (`FP4_E2M1`)."""
    if codebook == "mxfp4":
        return torch.tensor(FP4_E2M1, device=device)
    values = _signed_levels(codebook, torch.device(device)).float()
    return torch.nn.functional.pad(values, (0, 16 - values.numel()))


def codes(qtype: str, blk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index uint8 [rows, cols], scale float32 [rows, groups]) of a matrix of a `CODEBOOKS` type from its
    blocks: `w = levels(CODEBOOKS[qtype])[index] * scale`, exactly the file's weights, in the type's groups
    (`FORMS`)."""
    rows = blk.shape[0]
    if qtype in _LEVELS:  # (MXFP4's: e2m1's values, half the file's, with twice its scale)
        index, scale = _leveled(qtype, blk)
        scale = scale * 2 if qtype == "MXFP4" else scale
    else:  # each signed value's place among the codebook's (ascending: its rank)
        v, scale = _signed(qtype, blk)
        table = _signed_levels(CODEBOOKS[qtype], blk.device).int()  # (int32: searchsorted's on any device)
        index = torch.searchsorted(table, v.int().contiguous()).to(torch.uint8)
    return index.reshape(rows, -1), scale.reshape(rows, -1)


def _signed(qtype: str, blk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(v int16 [rows, blocks, weights a block], scale float32 [rows, blocks, groups a block]): the blocks'
    signed values and group scales, `w = v * scale`."""
    if qtype in _LEVELS:
        index, scale = _leveled(qtype, blk)
        return _lookup(qtype, index), scale
    rows, n = blk.shape[:2]
    at = functools.partial(torch.arange, device=blk.device)
    if qtype == "IQ1_M":  # qs 32, qh 16 (a row's index high bits, bit 3 its delta's sign), 4 words of
        # scales: 3 bits each per 16 weights, d's 16 bits in their top nibbles
        packed = words(blk[..., 48:56].reshape(rows, n, 4, 2))
        d_bits = ((packed >> 12) << at(0, 16, 4)).sum(-1)
        d = f16(torch.stack([d_bits & 255, d_bits >> 8], -1).to(torch.uint8))
        sub = (packed[..., None] >> at(0, 12, 3)) & 7
        nib = each_nibble(blk[..., 32:48]).to(torch.int32)
        grid = _lookup(qtype, blk[..., 0:32].to(torch.int32) | ((nib & 7) << 8))
        v = 8 * grid + torch.where(nib & 8 > 0, -1, 1).to(torch.int16)[..., None]
        return v.flatten(2), d[..., None] * (2 * sub.flatten(2) + 1) / 8
    d = f16(blk[..., 0:2])[..., None]
    if qtype in ("IQ2_XXS", "IQ3_XXS"):  # 8 groups of 32: 8 bytes of lattice indices each (IQ2: 4 of them, a
        # word apart; IQ3: 8, the words after all of them); a word a group of four 7-bit sign indices, the
        # group's 4-bit scale on top
        if qtype == "IQ2_XXS":
            group = blk[..., 2:66].reshape(rows, n, 8, 8)
            index, aux = group[..., 0:4], words(group[..., 4:8])
        else:
            index, aux = blk[..., 2:66].reshape(rows, n, 8, 8), words(blk[..., 66:98].reshape(rows, n, 8, 4))
        grid = _lookup(qtype, index).reshape(rows, n, 8, 4, 8)
        v = signed(grid, _even_signs((aux[..., None] >> (7 * at(4))) & 127))
        return v.flatten(2), d * (2 * (aux >> 28) + 1) / (8 if qtype == "IQ2_XXS" else 4)
    if qtype == "IQ2_XS":  # 32 words (9 bits a lattice index, 7 a sign index), 8 bytes of 4-bit scales
        packed = words(blk[..., 2:66].reshape(rows, n, 32, 2))
        v = signed(_lookup(qtype, packed & 511), _even_signs(packed >> 9))
        return v.flatten(2), d * (2 * each_nibble(blk[..., 66:74]) + 1) / 8
    if qtype == "IQ2_S":  # 32 index bytes, 32 sign bytes, 8 bytes of the indices' top 2 bits, 8 of scales
        high = ((blk[..., 66:74, None].to(torch.int32) >> at(0, 8, 2)) & 3).flatten(2)
        v = signed(_lookup(qtype, blk[..., 2:34].to(torch.int32) | (high << 8)), blk[..., 34:66])
        return v.flatten(2), d * (2 * each_nibble(blk[..., 74:82]) + 1) / 8
    if qtype == "IQ3_S":  # 64 index bytes, 8 of their ninth bits, 32 sign bytes, 4 bytes of 4-bit scales
        high = ((blk[..., 66:74, None].to(torch.int32) >> at(8)) & 1).flatten(2)
        grid = _lookup(qtype, blk[..., 2:66].to(torch.int32) | (high << 8)).reshape(rows, n, 32, 8)
        return signed(grid, blk[..., 74:106]).flatten(2), d * (2 * each_nibble(blk[..., 106:110]) + 1)
    if qtype == "IQ1_S":  # 32 index bytes, 8 words: 4 x 3 index bits, 3 bits of scale, the delta's sign
        packed = words(blk[..., 34:50].reshape(rows, n, 8, 2))
        high = (packed[..., None] >> (3 * at(4))) & 7
        grid = _lookup(qtype, blk[..., 2:34].reshape(rows, n, 8, 4).to(torch.int32) | (high << 8))
        v = 8 * grid + torch.where(packed >> 15 > 0, -1, 1).to(torch.int16)[..., None, None]
        return v.flatten(2), d * (2 * ((packed >> 12) & 7) + 1) / 8
    raise ValueError(f"{qtype} is not an i-quant; they are {', '.join(FORMS)}")


def parts(qtype: str, blk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(u uint8 [rows, cols] in 0 .. 2^bits - 1, scale and offset float32 [rows, groups]) of a matrix of
    i-quant `qtype` from its blocks (uint8 [rows, blocks, bytes a block]): `w = u * scale + offset`."""
    rows = blk.shape[0]
    v, scale = _signed(qtype, blk)
    shift, step = _UNSIGNED.get(qtype, (128, 1))
    u = (v + shift) >> (step - 1)  # (step 1 or 2)
    scale = (scale * step).reshape(rows, -1)
    return u.to(torch.uint8).reshape(rows, -1), scale, -scale * (shift / step)
