"""Device timing the microbenchmarks share: the median of a call, and a device copy's bandwidth (the
yardstick a memory-bound kernel or a decode step is held against, measured in the same run)."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch


def median_us(fn: Callable[[], object], device: torch.device, args: argparse.Namespace) -> float:
    """Median microseconds of `fn` over `args.iters` calls after `args.warmup` more (CUDA events on CUDA,
    the host clock elsewhere)."""
    for _ in range(args.warmup):
        fn()
    times = []
    for _ in range(args.iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def copy_tb_s(nbytes: int, device: torch.device, args: argparse.Namespace) -> float:
    """A device-to-device copy's bandwidth over `nbytes` (bytes read and written), its buffers freed after."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / median_us(lambda: dst.copy_(src), device, args) / 1e6
