"""torch's weight-only CPU kernels against the float32 prepacked GEMM gapless runs today, on the default
model's shapes (SmolLM2-135M: fused q/k/v 960x576, o 576x576, fused gate/up 3072x576, down 576x1536, LM
head 49152x576), at 1 and 8 rows, one thread, microseconds per call (median of 5 rounds of 20 calls).
`_dyn_quant_matmul_4bit` is not timed: on x86 its packing stores the weight dequantized to float32 (it is
KleidiAI's on Arm), and it refused a bias-less call. Run as

    PYTHONPATH=. .venv/bin/python bench/experiments/gguf_kernels.py
"""

from __future__ import annotations

import statistics
import time
from functools import partial

import torch

from gapless.model.cpu_gemm import PackedLinear

SHAPES = {
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "head": (49152, 576),
}


def per_call_us(f, calls: int = 20) -> float:
    f()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(calls):
            f()
        times.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}")
    for name, (n, k) in SHAPES.items():
        packed = PackedLinear(torch.randn(n, k), None)
        q8, s8 = torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n)
        p4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            torch.randint(0, 16, (n, k), dtype=torch.int32), 1
        )
        sz = torch.rand(k // 32, n, 2)
        for rows in (1, 8):
            x = torch.randn(rows, k)
            xb = x.bfloat16()
            i8, i4 = torch.ops.aten._weight_int8pack_mm, torch.ops.aten._weight_int4pack_mm_for_cpu
            r = {
                "f32 oneDNN packed": per_call_us(partial(packed, x)),
                "int8 f32-act": per_call_us(partial(i8, x, q8, s8), 3),
                "int4 f32-act": per_call_us(partial(i4, x, p4, 32, sz), 3),
                "int8 bf16-act": per_call_us(partial(i8, xb, q8, s8.bfloat16())),
                "int4 bf16-act": per_call_us(partial(i4, xb, p4, 32, sz.bfloat16())),
            }
            print(
                f"{name:8} {n}x{k} rows {rows}: " + ", ".join(f"{key} {v:.0f}" for key, v in r.items()),
                flush=True,
            )


if __name__ == "__main__":
    main()
