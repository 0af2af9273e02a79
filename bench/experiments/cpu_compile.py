"""Does torch.compile (inductor's CPU code) pay for a one-row decode step's non-GEMM work? Times, at one
row and one thread, eager torch against the same function compiled (`fullgraph=True`, static shapes), on
the default model's shapes (SmolLM2-135M: hidden 576, MLP 1536) with its quantized GGUF layout's kernels
(`gapless.model.quant.gguf_cpu`: int8 rows for o_proj/down_proj, int4 g32 for gate/up):

- the residual add + RMSNorm, and the gated activation (SiLU(gate) * up), alone: what a fused-kernel
  module (`gapless.model.fused`'s `rms_norm`, `act_and_mul`) would compile;
- a layer's whole second half (`DecoderLayer.after_attention`: o_proj, add + norm, gate/up, activation,
  down_proj), the largest piece that runs without the attention backend in between.

    PYTHONPATH=. python bench/experiments/cpu_compile.py [--calls 300]

Outputs are checked equal (max |difference| printed), then each variant's best-of-5 mean time per call.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

H, INTER, GROUP = 576, 1536, 32
I8 = torch.ops.aten._weight_int8pack_mm.default
I4 = torch.ops.aten._weight_int4pack_mm_for_cpu.default


def add_rms_norm(x: torch.Tensor, res: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + res
    return w * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5)), s


def act_and_mul(h: torch.Tensor) -> torch.Tensor:
    g, u = h.chunk(2, dim=-1)
    return F.silu(g) * u


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return dict(
        qo=torch.randint(-127, 128, (H, H), dtype=torch.int8, generator=g),
        so=torch.rand(H, generator=g).bfloat16(),
        qd=torch.randint(-127, 128, (H, INTER), dtype=torch.int8, generator=g),
        sd=torch.rand(H, generator=g).bfloat16(),
        q4=torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            torch.randint(0, 16, (2 * INTER, H), dtype=torch.int32, generator=g), 1
        ),
        sz=torch.rand(H // GROUP, 2 * INTER, 2, generator=g).bfloat16(),
        w=torch.randn(H, generator=g),
    )


W = _weights()


def after_attention(attn: torch.Tensor, res: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = I8(attn.to(torch.bfloat16), W["qo"], W["so"]).float()
    h, s = add_rms_norm(x, res, W["w"])
    a = act_and_mul(I4(h.to(torch.bfloat16), W["q4"], GROUP, W["sz"]).float())
    return I8(a.to(torch.bfloat16), W["qd"], W["sd"]).float(), s


def _time(f: Callable[..., Any], args: tuple, calls: int) -> float:
    for _ in range(30):
        f(*args)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(calls):
            f(*args)
        best = min(best, (time.perf_counter() - t) / calls)
    return best * 1e6


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python bench/experiments/cpu_compile.py")
    p.add_argument("--calls", type=int, default=300)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    x, res, gu = torch.randn(1, H), torch.randn(1, H), torch.randn(1, 2 * INTER)
    cases = [
        ("add + RMSNorm", add_rms_norm, (x, res, W["w"])),
        ("SiLU(gate) * up", act_and_mul, (gu,)),
        ("after_attention (3 GEMMs)", after_attention, (x, res)),
    ]
    print(f"torch {torch.__version__}, 1 thread, 1 row, {args.calls} calls, best of 5")
    for name, f, a in cases:
        compiled = torch.compile(f, dynamic=False, fullgraph=True)
        t = time.perf_counter()
        out = compiled(*a)
        took = time.perf_counter() - t
        ref = f(*a)
        outs, refs = (out, ref) if isinstance(out, tuple) else ((out,), (ref,))
        diff = max(float((o - r).abs().max()) for o, r in zip(outs, refs))
        eager, comp = _time(f, a, args.calls), _time(compiled, a, args.calls)
        print(
            f"{name}: eager {eager:.1f} us, compiled {comp:.1f} us ({comp / eager:.2f}x), "
            f"compile {took:.1f} s, max |diff| {diff:.2e}",
            flush=True,
        )


if __name__ == "__main__":
    main()
