"""Where one-request decode time goes on the CPU: torch.profiler over the decode steps of one greedy
request (the default model, its GGUF kept quantized unless GAPLESS_GGUF_WEIGHTS says otherwise), in the
engine's process (`cpu_worker="inline"`), the ops' self CPU time summed over `--steps` steps, the prefill
and first steps excluded (the difference of two profiles, `--steps` + 2 and 2 new tokens).

    PYTHONPATH=. python bench/experiments/cpu_profile.py [--model M] [--steps 32] [--threads N] [--top 25]
        [--cpu-compile]

`--cpu-compile`: the engine's decode layers compiled (`gapless.engine.cpu_compile`); the load's seconds,
the compile's included, are printed.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from gapless import LLM, SamplingParams
from gapless.bench import cli


def _profile(llm: LLM, prompt: list[int], n: int) -> tuple[float, dict[str, list[float]]]:
    """Wall seconds of one greedy request of `n` new tokens, and per op: [self CPU us, calls]."""
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        wall = time.perf_counter() - t
    ops: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for e in prof.key_averages():
        ops[e.key][0] += e.self_cpu_time_total
        ops[e.key][1] += e.count
    return wall, ops


def main(argv: list[str] | None = None) -> dict[str, tuple[float, float]]:
    """Prints the table; returns op -> (self CPU us, calls) per decode step."""
    p = argparse.ArgumentParser(prog="python bench/experiments/cpu_profile.py")
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--steps", type=cli.positive_int, default=32)
    p.add_argument("--threads", type=cli.positive_int)
    p.add_argument("--top", type=cli.positive_int, default=25)
    p.add_argument("--kv-cache-tokens", type=cli.positive_int, default=4096)
    p.add_argument("--cpu-compile", action="store_true", help="the decode layers compiled")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    prompt = np.random.default_rng(0).integers(100, 1000, 34).tolist()
    start = time.perf_counter()
    with LLM(
        args.model,
        device="cpu",
        dtype=args.dtype,
        kv_cache_tokens=args.kv_cache_tokens,
        cpu_worker="inline",
        cpu_compile=args.cpu_compile,
    ) as llm:
        if args.cpu_compile:
            print(f"loaded and compiled in {time.perf_counter() - start:.1f} s", flush=True)
        llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)  # warm-up
        w0, base = _profile(llm, prompt, 2)
        w1, full = _profile(llm, prompt, args.steps + 2)
    steps = args.steps
    per = {
        k: ((v[0] - base.get(k, [0.0, 0.0])[0]) / steps, (v[1] - base.get(k, [0.0, 0.0])[1]) / steps)
        for k, v in full.items()
    }
    total = sum(us for us, _ in per.values() if us > 0)
    ms = (w1 - w0) / steps * 1e3
    print(
        f"{steps} decode steps, {torch.get_num_threads()} threads: {ms:.2f} ms per step "
        f"under the profiler; ops' self CPU time {total / 1e3:.2f} ms per step, "
        f"{sum(c for _, c in per.values()):.0f} op calls per step"
    )
    print(f"{'op':<48} {'us/step':>9} {'share':>6} {'calls/step':>10}")
    for k, (us, calls) in sorted(per.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"{k[:48]:<48} {us:9.1f} {us / total:6.1%} {calls:10.1f}")
    return per


if __name__ == "__main__":
    main()
