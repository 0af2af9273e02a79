"""A GGUF file's quantized matrices as the file stores them (`GGUFBlocks`), and their values in the forms
gapless runs them in: int4 in groups of 32 (`int4_parts`: Q4_0, Q4_1 and Q4_K, exact), every type's own
values and scales (`affine_parts`, exact; the i-quants' from their tables, `gguf_iq`) and int8 rows
(`int8_rows`: every type, requantized with one scale a row). `gguf_cpu` runs the first and the last
through torch's CPU kernels; `gguf_int4` hands them to the int4/int8 weight-only path (a GPU's kernels,
tensor parallelism).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gapless.model.quant import gguf_iq
from gapless.model.quant.gguf_bits import bits, f16, nibbles

GROUP = 32  # an int4 form's group: a Q4_0/Q4_1 block, a Q4_K sub-block
# the ternary types (TriLM's, BitNet's): a trit a weight, `w = (q - 1) * d` with one f16 d a block of 256,
# at its end (TQ1_0: 5 trits a byte in base 3, scaled by 256/243; TQ2_0: 2 bits a trit)
TERNARY = {"TQ1_0": 52, "TQ2_0": 64}  # (where each block's d sits)
_CHUNK_ROWS = 1024  # rows dequantized at a time on the way to int8

# types the int4 layout holds exactly, and those the CPU requantizes to int8 rows (`gguf_cpu`)
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
INT8_TYPES = ("Q8_0", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q5_K", "Q6_K", *gguf_iq.FORMS, *TERNARY)
QUANTIZED_TYPES = INT4_TYPES + INT8_TYPES
FLOAT_TYPES = ("F32", "F16", "BF16")


@dataclass(frozen=True)
class GGUFBlocks:
    """One quantized matrix as the file stores it: `data[r]` is row r's blocks (`qtype` names the type)."""

    qtype: str
    cols: int
    data: np.ndarray  # uint8 [rows, bytes per row]

    @property
    def rows(self) -> int:
        return int(self.data.shape[0])


def block_bytes(qtype: str) -> int:
    """The bytes of one block of `qtype` (gguf's own table)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return int(GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][1])


def _blocks(b: GGUFBlocks, device: torch.device | str) -> torch.Tensor:
    """The blocks as uint8 [rows, blocks, bytes a block] on `device`, where every form below is read from
    them with torch's integer ops (a GPU decodes an 8B model's in a fraction of the host's time)."""
    data = torch.from_numpy(np.require(b.data, requirements=["C", "W"])).to(device)  # (a map's: copied)
    return data.view(b.rows, -1, block_bytes(b.qtype))


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 8 six-bit (scale, min) pairs per super-block, packed in 12 bytes (llama.cpp's
    `get_scale_min_k4`)."""
    s = scales.to(torch.int32)
    lo, hi = s[..., 0:4], s[..., 4:8]
    sc = torch.cat([lo & 63, (s[..., 8:12] & 15) | ((lo >> 6) << 4)], dim=-1)
    mn = torch.cat([hi & 63, (s[..., 8:12] >> 4) | ((hi >> 6) << 4)], dim=-1)
    return sc.float(), mn.float()


def int4_parts(
    b: GGUFBlocks, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 [rows, cols] in 0..15, scale and zero float32 [rows, cols / 32]) with
    `w = (q - 8) * scale + zero` exactly the file's weights (Q4_0, Q4_1, Q4_K), read on `device`."""
    if b.qtype not in INT4_TYPES:
        raise ValueError(f"{b.qtype} has no int4 layout; the int4 types are {', '.join(INT4_TYPES)}")
    q, scale, offset = _affine(b.qtype, _blocks(b, device))
    return q, scale, offset + 8 * scale


# the other types an affine form `w = (q - zero) * scale` holds exactly: (bits its values take, the weights
# one scale and zero cover)
AFFINE = {
    "Q8_0": (8, 32),
    "Q5_0": (8, 32),
    "Q5_1": (8, 32),
    "Q5_K": (8, 32),
    "Q6_K": (8, 16),
    "Q3_K": (4, 16),
    "Q2_K": (4, 16),
    **gguf_iq.FORMS,
    **{t: (4, 256) for t in TERNARY},
}
FORMS = {t: (4, GROUP) for t in INT4_TYPES} | AFFINE  # every quantized type's (bits, group)


def _group_scales(qtype: str, blk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, offset) float32 [rows, groups] of a legacy, K-quant or ternary type's blocks (`_blocks`; the
    i-quants': `gguf_iq`): `w = q * scale + offset` over each group of the type's, q its unsigned values
    (`_values`), read from the blocks' headers as llama.cpp's dequantization takes them (ggml-quants.c)."""
    rows = blk.shape[0]
    if qtype in TERNARY:  # (q - 1) * d, one group a block
        d = f16(blk[..., TERNARY[qtype] : TERNARY[qtype] + 2])
        return d, -d
    if qtype in ("Q8_0", "Q5_0", "Q4_0"):  # (q - 128) * d, (q - 16) * d, (q - 8) * d
        d = f16(blk[..., 0:2])
        return d, -d * {"Q8_0": 128, "Q5_0": 16, "Q4_0": 8}[qtype]
    if qtype in ("Q5_1", "Q4_1"):  # q * d + m
        return f16(blk[..., 0:2]), f16(blk[..., 2:4])
    if qtype in ("Q5_K", "Q4_K"):  # d * sc * q - dmin * m, 8 groups of 32 a super-block
        d, dmin = f16(blk[..., 0:2])[..., None], f16(blk[..., 2:4])[..., None]
        sc, mn = _k_scales(blk[..., 4:16])
        return (d * sc).reshape(rows, -1), (-dmin * mn).reshape(rows, -1)
    if qtype == "Q6_K":  # d * sc * (q - 32), 16 groups of 16, sc int8
        d = f16(blk[..., 208:210])[..., None]
        scale = (d * blk[..., 192:208].contiguous().view(torch.int8).float()).reshape(rows, -1)
        return scale, -32 * scale
    if qtype == "Q3_K":  # d * (sc - 32) * (q - 4), 16 groups of 16, sc 6 bits: its low 4 in bytes
        # 96-103 (groups 0-7 the low nibbles, 8-15 the high), its top 2 in bytes 104-107 (group j: byte
        # j % 4, bits 2 * (j // 4))
        raw = blk[..., 96:108].to(torch.int32)
        low = torch.cat([raw[..., 0:8] & 15, raw[..., 0:8] >> 4], dim=-1)
        top = torch.stack([(raw[..., 8:12] >> (2 * k)) & 3 for k in range(4)], dim=-2).flatten(-2)
        scale = (f16(blk[..., 108:110])[..., None] * ((low | (top << 4)) - 32)).reshape(rows, -1)
        return scale, -4 * scale
    # Q2_K: d * (s & 15) * q - dmin * (s >> 4), 16 groups of 16
    s = blk[..., 0:16].to(torch.int32)
    d, dmin = f16(blk[..., 80:82])[..., None], f16(blk[..., 82:84])[..., None]
    return (d * (s & 15)).reshape(rows, -1), (-dmin * (s >> 4)).reshape(rows, -1)


def _values(qtype: str, blk: torch.Tensor) -> torch.Tensor:
    """A legacy, K-quant or ternary type's unsigned values (the i-quants': `gguf_iq`), uint8 [rows, cols] in
    weight order, read from its blocks (`_blocks`) as llama.cpp's `dequantize_row_*` reads them."""
    rows = blk.shape[0]
    if qtype == "TQ2_0":  # two halves of 128: 32 bytes each, run j at bits 2j
        shifts = torch.arange(0, 8, 2, device=blk.device, dtype=torch.uint8)[:, None]
        q = (blk[..., 0:64].reshape(rows, -1, 2, 1, 32) >> shifts) & 3
    elif qtype == "TQ1_0":
        q = _trits(blk)
    elif qtype == "Q8_0":  # 32 int8 values after d: + 128, the sign bit flipped
        q = blk[..., 2:34] ^ 128
    elif qtype in ("Q4_0", "Q4_1"):  # 16 bytes of nibbles after d (and m)
        q = nibbles(blk[..., 2 if qtype == "Q4_0" else 4 :])
    elif qtype == "Q4_K":  # 4 runs of 64 weights: 32 bytes, low nibbles the first 32, high ones the next
        qs = blk[..., 16:].reshape(rows, -1, 4, 32)
        q = torch.stack([qs & 15, qs >> 4], dim=3)
    elif qtype in ("Q5_0", "Q5_1"):  # qh (4 bytes: bit j value j's fifth), then 16 bytes of nibbles
        at = 2 if qtype == "Q5_0" else 4
        high = bits(blk[..., at : at + 4], 8).transpose(-1, -2).flatten(-2)  # bit j of the 32-bit word
        q = nibbles(blk[..., at + 4 : at + 20]) | (high << 4)
    elif qtype == "Q5_K":  # 8 sub-blocks of 32: qs's nibbles (low: even ones), qh's bit k for sub-block k
        ql = blk[..., 48:176].reshape(rows, -1, 4, 1, 32)
        low = torch.cat([ql & 15, ql >> 4], dim=3).flatten(2, 3)  # [rows, super-blocks, 8, 32]
        q = low | (bits(blk[..., 16:48], 8) << 4)
    elif qtype == "Q6_K":  # two halves of 128: ql's nibbles (4 bits) and qh's pairs (2 bits), in 4 runs of 32
        ql, qh = blk[..., 0:128].reshape(rows, -1, 2, 64), blk[..., 128:192].reshape(rows, -1, 2, 32)
        runs = [ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4]
        q = torch.stack([r | (((qh >> (2 * k)) & 3) << 4) for k, r in enumerate(runs)], dim=3)
    else:  # Q3_K, Q2_K: two halves of 128, each 32 bytes of 2-bit values (run j at bits 2j), Q3_K's third
        # bit from hmask (bit 4 * half + j)
        at = 32 if qtype == "Q3_K" else 16
        qs = blk[..., at : at + 64].reshape(rows, -1, 2, 1, 32)
        shifts = torch.arange(0, 8, 2, device=blk.device, dtype=torch.uint8)[:, None]
        q = (qs >> shifts) & 3  # [rows, super-blocks, 2, 4, 32]
        if qtype == "Q3_K":
            q = q | (bits(blk[..., 0:32], 8).view(q.shape) << 2)
    return q.reshape(rows, -1)


def _trits(blk: torch.Tensor) -> torch.Tensor:
    """TQ1_0's 256 trits a block (uint8 [rows, blocks, 256]): 32 bytes of 5 (trit k of byte j is weight
    32k + j), 16 bytes of 5 (160 + 16k + j), then 4 of 4 (240 + 4k + j), each byte a base-3 fraction of
    256: trit k is `(byte * 3^k mod 256) * 3 >> 8`, as llama.cpp's `dequantize_row_tq1_0` reads it."""
    rows, n = blk.shape[:2]
    runs = []
    for at, count, width in ((0, 5, 32), (32, 5, 16), (48, 4, 4)):
        powers = 3 ** torch.arange(count, device=blk.device, dtype=torch.int32)[:, None]
        shifted = (blk[..., at : at + width, None].transpose(-1, -2).to(torch.int32) * powers) & 255
        runs.append((shifted * 3 >> 8).reshape(rows, n, count * width))
    return torch.cat(runs, dim=-1).to(torch.uint8)


def zero_form(scale: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Groups `w = q * scale + offset` as `w = (q - zero) * scale`: (scale, zero, flat), the zero
    `-offset / scale` (a float); a group whose scale is 0 (`flat`: every weight its offset) takes scale
    `offset` and zero 0, for q = 1 (the caller's to set): exact too."""
    flat = scale == 0
    zero = torch.where(flat, 0.0, (-offset.double() / torch.where(flat, 1.0, scale).double()).float())
    return torch.where(flat, offset, scale), zero, flat


def _affine(qtype: str, blk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 [rows, cols], scale and offset float32 [rows, groups]) of any quantized type's blocks
    (`_blocks`): `w = q * scale + offset`, over each of the type's groups (`FORMS`)."""
    if qtype in gguf_iq.FORMS:
        return gguf_iq.parts(qtype, blk)
    return (_values(qtype, blk), *_group_scales(qtype, blk))


def affine_parts(
    b: GGUFBlocks, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q int16 [rows, cols], scale and zero float32 [rows, groups]) of any quantized type, `w = (q - zero)
    * scale` its weights (`zero_form`): values and scales read from the blocks (`_affine`) on `device`."""
    q, scale, offset = _affine(b.qtype, _blocks(b, device))
    scale, zero, flat = zero_form(scale, offset)
    q = q.to(torch.int16)
    q.view(b.rows, -1, FORMS[b.qtype][1])[flat] = 1
    return q, scale, zero


def codebook_parts(b: GGUFBlocks, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(q int16 [rows, cols], scale float32 [rows, groups]) of an i-quant with a codebook
    (`gguf_iq.CODEBOOKS`): `w = gguf_iq.levels(its codebook)[q] * scale`, read from the blocks on `device`."""
    q, scale = gguf_iq.codes(b.qtype, _blocks(b, device))
    return q.to(torch.int16), scale


def decoded_rows(qtype: str, data: torch.Tensor) -> torch.Tensor:
    """Rows of blocks (uint8 [rows, bytes a row], on any device) as float32 [rows, cols]: `q * scale +
    offset` (`_affine`) in float64, rounded once, the `gguf` package's dequantization bit for bit (its
    products of an f16 scale and small integers are exact but the last). Torch ops alone, no host sync:
    a lookup in a captured graph."""
    blk = data.view(data.shape[0], -1, block_bytes(qtype))
    q, scale, offset = _affine(qtype, blk)
    group = FORMS[qtype][1]
    w = q.double().view(*scale.shape, group) * scale.double()[..., None] + offset.double()[..., None]
    return w.float().view(data.shape[0], -1)


def dequantize_rows(b: GGUFBlocks, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) as float32 (the `gguf` package's dequantization; Q8_0's `q * d` in torch, the
    same products, several times faster)."""
    from gguf import GGMLQuantizationType, quants

    if b.qtype == "Q8_0":
        blk = torch.from_numpy(np.require(b.data[start:stop], requirements=["C", "W"])).view(
            stop - start, -1, 34
        )
        q = blk[..., 2:].contiguous().view(torch.int8)
        return (q.float() * f16(blk[..., 0:2])[..., None]).reshape(stop - start, b.cols)

    w = quants.dequantize(b.data[start:stop], GGMLQuantizationType[b.qtype])
    return torch.from_numpy(np.asarray(w, dtype=np.float32).reshape(stop - start, b.cols))


def int8_rows(b: GGUFBlocks) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [rows, cols], scale bfloat16 [rows]): each row requantized as `q * scale`, with
    `scale >= max|w| / 127` the nearest bfloat16 at or above it, so |q| <= 127."""
    q = torch.empty(b.rows, b.cols, dtype=torch.int8)
    scale = torch.empty(b.rows, dtype=torch.bfloat16)
    for start in range(0, b.rows, _CHUNK_ROWS):
        stop = min(start + _CHUNK_ROWS, b.rows)
        w = dequantize_rows(b, start, stop)
        s = (w.abs().amax(dim=1) / 127).clamp_min(1e-30)
        s16 = s.bfloat16()
        s16 = torch.where(
            s16.float() < s, torch.nextafter(s16, torch.tensor(float("inf"), dtype=s16.dtype)), s16
        )
        q[start:stop] = torch.round(w / s16.float()[:, None]).clamp_(-127, 127).to(torch.int8)
        scale[start:stop] = s16
    return q, scale


def label(parts: list[GGUFBlocks]) -> str:
    return "+".join(sorted({p.qtype for p in parts}))


def is_int4(parts: list[GGUFBlocks]) -> bool:
    """Every part is of a type the int4 layout holds exactly."""
    return all(p.qtype in INT4_TYPES for p in parts)
