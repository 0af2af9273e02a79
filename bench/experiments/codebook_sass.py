"""The int4 GEMV's sm_90 binary with a codebook's values (NF4, IQ4, NVFP4: each a gather load from the
16 levels) against AWQ's evenly spaced ones (by their bits, and by PTX), compiled on a machine without a
GPU by the harness's stand-in driver (run it without TRITON_INTERPRET):

    python bench/experiments/codebook_sass.py

One row of bfloat16 x on Llama-3-8B's down shape (K 14336, N 4096), 4 bits, the GEMV's tiles (64 columns,
128 inputs a step) as `choose_config` gives them, groups of 64 (NF4's) and 16 (NVFP4's). Each line: the
whole kernel's instructions, and its loads (LDG), address arithmetic (LEA, IMAD), LOP3s and float ops
(FADD, FMUL, FFMA): which instructions a lookup adds, for a GPU run to time."""

from __future__ import annotations

import re
from collections import Counter

import torch

from gapless.model.quant.int4_triton import choose_config, w4a16_matmul
from gapless.testing.sass import cuobjdump
from gapless.testing.triton_compile import Compiler

K, N = 14336, 4096
OPS = ("LDG", "LEA", "IMAD", "LOP3", "SHF", "FADD", "FMUL", "FFMA")


def main() -> None:
    cases = [("affine, Triton's values", 64, False, False), ("affine, PTX values", 64, False, True)]
    cases += [("codebook g64 (NF4)", 64, True, False), ("codebook g16 (NVFP4)", 16, True, False)]
    with Compiler(90) as compiler, torch.inference_mode():
        for _, group, codebook, ptx in cases:
            x = torch.zeros(1, K, dtype=torch.bfloat16)
            qweight = torch.zeros(K // 8, N, dtype=torch.int32)
            scales = torch.zeros(K // group, N, dtype=torch.bfloat16)
            config = choose_config(1, N, K, group)._replace(ptx_values=ptx)
            levels = torch.zeros(16) if codebook else None
            w4a16_matmul(x, qweight, scales, scales, group, 4, config, levels=levels)
    print(f"sm_90, one row, [{N}, {K}], 4 bits, bf16 x")
    print("| values | instructions | " + " | ".join(OPS) + " |")
    print("|---|---:|" + "---:|" * len(OPS))
    for (name, *_), (_, kernel) in zip(cases, compiler.compiled):
        sass = cuobjdump(kernel, "-sass") or ""
        ops = re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)", sass, flags=re.M)
        count = Counter(op.split(".")[0] for op in ops)
        print(f"| {name} | {len(ops)} | " + " | ".join(str(count[o]) for o in OPS) + " |")


if __name__ == "__main__":
    main()
