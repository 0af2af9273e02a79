"""How fast a GGUF file's blocks become the int4/int8 path's form (`gapless.model.quant.gguf_int4.unpacked`:
values, scales and zeros), per type, on a device: the rate a GPU or CPU load decodes a projection at. One
4096 x 4096 matrix of random blocks a type (`gapless.testing.gguf_files.random_blocks`), the best of three
after a warm-up, in millions of weights a second. Run as

    PYTHONPATH=. .venv/bin/python bench/experiments/gguf_decode.py [--device cuda] [--rows 4096 --cols 4096]
"""

from __future__ import annotations

import argparse
import time

import torch

from gapless.model.quant.gguf_blocks import AFFINE, INT4_TYPES
from gapless.model.quant.gguf_int4 import spec_for, unpacked
from gapless.testing.gguf_files import random_blocks


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Each type's rate, M weights/s (printed as it goes)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--cols", type=int, default=4096)
    args = p.parse_args(argv)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    rates = {}
    for qtype in INT4_TYPES + tuple(AFFINE):
        b = random_blocks(qtype, args.rows, args.cols)
        spec = spec_for([b])
        best = float("inf")
        for _ in range(4):  # (the first a warm-up)
            sync()
            start = time.perf_counter()
            unpacked(b, spec, args.device)
            sync()
            best = min(best, time.perf_counter() - start) if _ else best
        rates[qtype] = args.rows * args.cols / best / 1e6
        print(f"{qtype}: {rates[qtype]:.0f} M weights/s ({spec.label}, {args.device})")
    return rates


if __name__ == "__main__":
    main()
