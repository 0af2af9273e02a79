"""Programmatic dependent launch (PDL, sm_90+) for gapless's Triton kernels: each may be launched while the
kernel before it in the stream still runs, and waits inside for that kernel's end before touching what it
wrote (`GAPLESS_PDL`, off by default).

A decode step at batch 1 is a few hundred short kernels (Qwen3-0.6B FP8: ~8 a layer, 1-8 us each on an
H200), and between two of them the GPU idles while the next one launches: 35-132 us of idle a token in
`bench/results/h200-2026-11-27-default`, besides each kernel's own ramp. Launched with PDL, the next
kernel's programs are placed on the SMs while this one finishes and wait there (`griddepcontrol.wait`),
so it starts as soon as this one's writes are visible; inside a CUDA graph the same holds between graph
nodes (CUDA 12.3+).

The contract every kernel launched so keeps (`wait_for_previous`): nothing that an earlier kernel may
write, or read, is loaded or stored before its wait; only the model's own weights, which no kernel writes,
may be loaded before it. The FP8 GEMM and GEMV fetch the first `PREFETCH_BYTES` of each of their weight
rows into L2 then (`prefetch_weights`), so a layer's weights start streaming while the kernel before it
runs. Each kernel lets the next one launch right after its wait (`griddepcontrol.launch_dependents`), so
at most one kernel runs ahead, and no program of a kernel holds an SM before every program of the one
before it has been placed. A kernel after one that never lets go (torch's, cuBLAS's) launches when that
one ends, as without PDL.

`launch_args(device)` is what a launcher adds to its launch: the kernel's `PDL` constexpr and, where PDL
runs, Triton's `launch_pdl` option. Under the interpreter, on the CPU, before sm_90 or with the variable
off: `PDL=False`, the kernel as it was.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
import triton
import triton.language as tl

from gapless import env


@cache
def _hopper_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def active(device: torch.device) -> bool:
    """Whether kernels launched on `device` use PDL: `GAPLESS_PDL` on, a CUDA device of sm_90 or later,
    Triton compiling (not interpreting)."""
    if device.type != "cuda" or not env.PDL.get() or env.TRITON_INTERPRET.get():
        return False
    return _hopper_or_later(device.index if device.index is not None else torch.cuda.current_device())


def launch_args(device: torch.device) -> dict[str, Any]:
    """The arguments a launcher adds for PDL on `device`: `PDL` (the kernel's constexpr) and Triton's
    `launch_pdl` where it is active."""
    return {"PDL": True, "launch_pdl": True} if active(device) else {"PDL": False}


# bytes of each weight row a GEMM's program fetches into L2 before its wait: two 128-byte lines, 8 MB of
# Qwen3-8B's qkv (512 programs of 64 rows), all of Qwen3-0.6B's layers at one row
PREFETCH_BYTES = tl.constexpr(256)
_PREFETCH = tl.constexpr("prefetch.global.L2 [$1];\nmov.u32 $0, 0;")


@triton.jit
def prefetch_weights(rows, start, stop, PDL: tl.constexpr):
    """With PDL, before the wait: bytes [start, min(stop, start + PREFETCH_BYTES)) of each weight row
    (`rows`, a vector of pointers to the rows' byte 0) fetched into L2, a 128-byte line at a time, by
    PTX's `prefetch` (no register written, nothing waited for). Without: nothing."""
    if PDL:
        for k in range(start, tl.minimum(stop, start + PREFETCH_BYTES), 128):
            tl.inline_asm_elementwise(_PREFETCH, "=r,l", [rows + k], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """With PDL: wait for the kernel before this one to end and its writes to be visible, then let the
    kernel after this one launch. Without: nothing."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
