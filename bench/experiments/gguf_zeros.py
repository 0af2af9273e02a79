"""How a GGUF file's 4-bit groups lose precision in the int4/int8 path's form
(`gapless.model.quant.gguf_int4`: `W = (q - zero) * scale`, the zero a float), by the dtype its zeros and
scales are held in: the RMS error of every 4-bit projection of the default model (SmolLM2-135M-Instruct)
against the file's float32 weights, relative to their RMS. Beside it, the rounding a bfloat16 model gives
each weight, and tinygemm's form (`(q - 8) * scale + offset`, both bfloat16). Run as

    PYTHONPATH=. .venv/bin/python bench/experiments/gguf_zeros.py [FILE.gguf]
"""

from __future__ import annotations

import sys

import gguf
import numpy as np
import torch

from gapless.default_model.smollm2 import smollm2_path
from gapless.model.quant.gguf_blocks import INT4_TYPES, GGUFBlocks
from gapless.model.quant.gguf_int4 import unpacked


def forms(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each way of holding one matrix's 4-bit groups, as its float64 weights."""
    q = q.double()
    per = lambda t: t.double().repeat_interleave(q.shape[1] // t.shape[1], 1)  # noqa: E731
    s16 = scale.bfloat16()
    offset = per(((8 - zero) * s16.float()).bfloat16())
    return {
        "file, each weight rounded to bfloat16": ((q - per(zero)) * per(scale)).bfloat16(),
        "zero bfloat16, scale bfloat16": (q - per(zero.bfloat16())) * per(s16),
        "zero float16, scale bfloat16": (q - per(zero.half())) * per(s16),
        "zero float32, scale bfloat16": (q - per(zero)) * per(s16),
        "tinygemm's: (q - 8) * scale + offset": (q - 8) * per(s16) + offset,
    }


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else str(smollm2_path())
    errors: dict[str, float] = {}
    total, layers, zeros = 0.0, 0, []
    for t in gguf.GGUFReader(path).tensors:
        if t.tensor_type.name not in INT4_TYPES or len(t.shape) != 2:
            continue
        b = GGUFBlocks(t.tensor_type.name, int(t.shape[0]), np.asarray(t.data).reshape(int(t.shape[1]), -1))
        w = unpacked(b, 4)
        ref = w.dequantize().double()
        total += float((ref**2).sum())
        layers += 1
        zeros.append(w.zero.flatten())
        for name, held in forms(w.q, w.scale, w.zero).items():
            errors[name] = errors.get(name, 0.0) + float(((held.double() - ref) ** 2).sum())
    z = torch.cat(zeros)
    print(f"file {path}: {layers} 4-bit matrices; zeros from {float(z.min()):.2f} to {float(z.max()):.2f}")
    for name, err in errors.items():
        print(f"{name:40s} RMS error {100 * (err / total) ** 0.5:.4f}% of the weights' RMS")


if __name__ == "__main__":
    main()
