"""Device timing the benchmarks share: the median of a call, a device copy's bandwidth (the yardstick a
memory-bound kernel or a decode step is held against, measured in the same run), and a decode step's
cost kernel by kernel (`decode_profile`)."""

from __future__ import annotations

import argparse
import re
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from gapless.bench.cli import markdown_table

REPLAYS = 5  # timed replays of the captured calls on CUDA; the median counts
PROFILE_TOP = 12  # kernels a profile lists by name (the rest summed)
SHORT_RUNS = 3  # `decode_profile`'s runs of the one-token requests, the least of each kernel's taken
# what a profile sums each kernel (each op on the CPU) under, by its name, the first that matches: the
# linear layers (cuBLAS's, gapless's FP8 and int4 GEMMs and FP8's rounding of x, tinygemm, gemlite; on the
# CPU torch's matmuls), the attention, everything else
KINDS = {
    "GEMMs": re.compile(
        r"gemm|gemv|nvjet|xmma|cutlass|cublas|w4a16|tinygemm|int4pack|_fp8_quant|splitk"
        r"|aten::mm|addmm|linear|matmul",
        re.I,
    ),
    "attention": re.compile(r"decode|extend|attention|attn|flash|scaled_dot_product", re.I),
}


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


def decode_profile(timed: Callable[[int], object], steps: int, device: str) -> dict[str, Any]:
    """What a decode step (a token of each request) costs kernel by kernel: `timed(1 + steps)` and
    `timed(1)` (requests of that many output tokens, their prompts computed in both) under torch.profiler,
    each kernel's time and calls in the second taken from the first's, over `steps`; the second's the
    least of `SHORT_RUNS` runs of it, so that one run slowed by another process (a loaded CPU's) does not
    take a kernel's steps from it. `us_per_step`: the sum; `kinds`: its share under each of `KINDS` and
    "other"; `ops`: the `PROFILE_TOP` costliest [name, us, calls] a step; `other_us`: the rest's sum."""
    long = op_times(lambda: timed(1 + steps), device)
    runs = [op_times(lambda: timed(1), device) for _ in range(SHORT_RUNS)]
    short = {
        name: min((run[name] for run in runs if name in run), key=lambda t: t[0], default=(0.0, 0))
        for name in long
    }
    per_step: dict[str, tuple[float, float]] = {}
    for name, (us, calls) in long.items():
        us0, calls0 = short.get(name, (0.0, 0))
        if us > us0:
            per_step[name] = ((us - us0) / steps, (calls - calls0) / steps)
    ranked = sorted(per_step.items(), key=lambda kv: kv[1][0], reverse=True)
    top = [(name[:90], us, calls) for name, (us, calls) in ranked[:PROFILE_TOP]]
    total = sum(us for us, _ in per_step.values())
    kinds = dict.fromkeys([*KINDS, "other"], 0.0)
    for name, (us, _) in per_step.items():
        kinds[next((kind for kind, pattern in KINDS.items() if pattern.search(name)), "other")] += us
    return dict(us_per_step=total, kinds=kinds, ops=top, other_us=total - sum(us for _, us, _ in top))


def profile_table(prof: dict[str, Any], unit: str) -> list[str]:
    """`decode_profile`'s costliest kernels and the rest as a markdown table, each's us and calls a
    `unit` ("token", "step")."""
    rows = [(name, f"{us:.1f}", f"{calls:g}") for name, us, calls in prof["ops"]]
    rows.append(("(the rest)", f"{prof['other_us']:.1f}", ""))
    return markdown_table(("kernel", f"us a {unit}", f"calls a {unit}"), rows, "lrr")
