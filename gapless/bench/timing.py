"""Device timing the microbenchmarks share: the median of a call, and a device copy's bandwidth (the
yardstick a memory-bound kernel or a decode step is held against, measured in the same run)."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial

import torch

REPLAYS = 5  # timed replays of the captured calls on CUDA; the median counts


def median_us(fn: Callable[[], object], device: torch.device, args: argparse.Namespace) -> float:
    """Median microseconds of one call of `fn`, after `args.warmup` untimed calls.

    On CUDA, `args.iters` calls are captured in one CUDA graph and its replays timed between two events
    (`REPLAYS` of them, the median over `args.iters`): the device's time for the work, as a decode step
    replays it from its graph, without the host's launching of it. (Timing one eager call between events
    measures the host's launch cost whenever the kernels are shorter than it: decode attention at batch
    1 read ~90 µs at every context.) A callable that cannot be captured (a host sync) is timed the same
    way eagerly, its `args.iters` calls back to back. On the CPU: the median wall time of single calls."""
    for _ in range(args.warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(args.iters):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e6)
        return statistics.median(times)

    def calls() -> None:
        for _ in range(args.iters):
            fn()

    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    run: Callable[[], object] = graph.replay
    try:
        with torch.cuda.graph(graph):
            calls()
    except RuntimeError:  # not capturable: eagerly, back to back
        run = calls
    run()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / args.iters)
    return statistics.median(times)


def cold_copies(nbytes: int, device: torch.device) -> int:
    """How many copies of a working set of `nbytes` the timed calls cycle through so that each call reads
    memory, not L2: enough to span 4x the L2 cache (1 on the CPU or for sets larger than that)."""
    if device.type != "cuda":
        return 1
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return max(1, -(-4 * l2 // max(nbytes, 1)))


def cycling(fns: Sequence[Callable[[], object]]) -> Callable[[], object]:
    """A callable that runs `fns` in turn, one per call (a captured graph records the sequence)."""
    turn = [0]

    def call() -> object:
        turn[0] = (turn[0] + 1) % len(fns)
        return fns[turn[0]]()

    return call


def copy_tb_s(nbytes: int, device: torch.device, args: argparse.Namespace) -> float:
    """A device-to-device copy's bandwidth over `nbytes` (bytes read and written), its buffers freed after."""
    pairs = [
        (
            torch.empty(nbytes, dtype=torch.uint8, device=device),
            torch.empty(nbytes, dtype=torch.uint8, device=device),
        )
        for _ in range(cold_copies(2 * nbytes, device))
    ]
    copy = cycling([partial(dst.copy_, src) for src, dst in pairs])
    return 2 * nbytes / median_us(copy, device, args) / 1e6


def op_times(fn: Callable[[], object], device: str) -> dict[str, tuple[float, int]]:
    """Each op's (self microseconds, calls) while `fn` runs, under torch.profiler: on CUDA the device
    time of each kernel (those a CUDA graph replays included, by their kernel names), elsewhere the
    self CPU time of each torch op."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        fn()
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    return {e.key: (float(getattr(e, attr)), e.count) for e in prof.key_averages() if getattr(e, attr) > 0}
