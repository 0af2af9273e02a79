"""K split among programs at decode sizes, finished inside the GEMM that splits it (the FP8 GEMM and GEMV,
`fp8_kernel`; the int4/int8 GEMM, `int4_triton`), with no second launch to add the parts.

At a decode's few rows a weight has fewer output tiles than the GPU has SMs, so each tile's K is cut into
SPLITS shares, one program each. Each program writes its partial tile (float32) to its own slice of a
[SPLITS, M, N] buffer and counts its arrival on the tile's counter; the last to arrive adds the slices up in
split order (the same sum whatever the order they arrived in), writes y and sets the counter back to 0.
A sum and a cast by torch after the kernel instead (the int4 GEMM's way before) is two more kernels a
layer, each a few microseconds at one row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

COUNTERS = 4096  # tiles a split GEMM may have (the counters' buffer: 16 KB a device)
# per device: the counters, all 0 at rest; one buffer for good (a CUDA graph keeps its address)
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def counters(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The arrival counters for a split GEMM of `tiles` output tiles on `device`; None while a CUDA graph
    is being captured before the device has them (the GEMM then runs unsplit: a buffer made during a
    capture would not outlive it). More tiles than `COUNTERS` is refused."""
    if tiles > COUNTERS:
        raise ValueError(f"a GEMM split over K may have at most {COUNTERS} output tiles, got {tiles}")
    if device not in _COUNTERS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        _COUNTERS[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return _COUNTERS[device]


def partial_sums(splits: int, m: int, n: int, device: torch.device) -> torch.Tensor:
    """The [splits, M, N] float32 buffer of the split programs' partial tiles."""
    return torch.empty(splits, m, n, dtype=torch.float32, device=device)


@triton.jit
def finish(
    acc,
    y_ptr,
    p_ptr,
    lock_ptr,
    b_ptr,
    offs_m,
    offs_n,
    M,
    N,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """y's [rows, columns] tile at (offs_m, offs_n) from `acc` (float32), the bias added; with K split
    (SPLIT: the grid is (row tiles, column tiles, splits), more than one split), each split's partial tile
    to its own slice of p, and the tile's last split to arrive adds them up in split order and resets the
    tile's counter (at `lock_ptr`, indexed by program ids 0 and 1). The count of splits is the grid's, not
    a constant: a kernel compiles once for every split count."""
    m_ok = offs_m < M
    n_ok = offs_n < N
    ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT:
        splits = tl.num_programs(2)
        tile = offs_m[:, None] * N + offs_n[None, :]
        tl.store(p_ptr + tl.program_id(2) * M * N + tile, acc, mask=ok)
        lock = lock_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        tl.debug_barrier()  # every thread's stores issued before the (releasing) count
        if tl.atomic_add(lock, 1, sem="acq_rel") == splits - 1:
            acc = tl.zeros_like(acc)
            for sp in range(splits):
                acc += tl.load(p_ptr + sp * M * N + tile, mask=ok, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(lock, 0)
            _store_y(acc, y_ptr, b_ptr, offs_m, offs_n, n_ok, ok, stride_ym, HAS_BIAS)
    else:
        _store_y(acc, y_ptr, b_ptr, offs_m, offs_n, n_ok, ok, stride_ym, HAS_BIAS)


@triton.jit
def _store_y(acc, y_ptr, b_ptr, offs_m, offs_n, n_ok, ok, stride_ym, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=ok)
