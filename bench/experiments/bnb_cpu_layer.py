"""bitsandbytes' 4-bit CPU kernel against torch.mm in bfloat16 on Llama-3-8B's layers (one thread).

    OMP_NUM_THREADS=1 python bench/experiments/bnb_cpu_layer.py

Each layer's NF4 `Linear4bit` (its fused kernel where the CPU has AVX512-BF16) against `x @ W^T` on the
same weights dequantized, at 1 and 8 rows; the relative error is against float32 on those weights."""

from __future__ import annotations

import time

import bitsandbytes
import torch

LAYERS = ((4096 + 2 * 1024, 4096), (2 * 14336, 4096), (4096, 14336))  # qkv, gate/up, down: [N, K]


def _ms(fn, *args, n: int = 30) -> float:
    fn(*args)
    fn(*args)
    t = time.perf_counter()
    for _ in range(n):
        fn(*args)
    return (time.perf_counter() - t) / n * 1e3


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    for n, k in LAYERS:
        w = torch.randn(n, k, dtype=torch.bfloat16) * 0.02
        lin = bitsandbytes.nn.Linear4bit(k, n, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
        lin.weight = bitsandbytes.nn.Params4bit(w, requires_grad=False, quant_type="nf4")._quantize("cpu")
        lin.eval()
        with torch.inference_mode():
            wd = bitsandbytes.functional.dequantize_4bit(lin.weight.data, lin.weight.quant_state).to(w.dtype)
            for m in (1, 8):
                x = torch.randn(m, k, dtype=torch.bfloat16)
                ref = x.float() @ wd.float().t()
                err = float((lin(x).float() - ref).abs().max() / ref.abs().max())
                ours, dense = _ms(lin, x), _ms(torch.mm, x, wd.t())
                print(
                    f"[{n},{k}] rows {m}: bnb nf4 {ours:.3f} ms, bf16 torch {dense:.3f} ms, "
                    f"ratio {ours / dense:.2f}, rel err {err:.1e}"
                )


if __name__ == "__main__":
    main()
