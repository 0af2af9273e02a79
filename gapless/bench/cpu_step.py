"""The offline decode step on the CPU, without the server: ms per step and torch ops per step at a few
batch sizes, to set beside llama.cpp's per-token time (`bench/llamacpp_cpu.sh`) and beside the served
path's profile (`bench/profile_served.sh`).

    python -m gapless.bench.cpu_step [--model SmolLM2-135M-Instruct] [--batch 1 8] [--dtype float32]

Per batch size B: B prompts of `--prompt-len` random token ids, greedy with `ignore_eos`; a step's time is
(time of `--steps` + 2 new tokens - time of 2 new tokens) / `--steps`, so the prefill and the first
decode cancel out, best of `--repeat`. The op count is the number of torch operators (`aten::*`, nested
ones included) that one decode step dispatches, from the torch profiler: on a CPU each costs a few
microseconds of dispatch whatever its size, so it is the part of a small model's step that is overhead.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from gapless.bench import cli


def step_ms(llm, prompts: list[list[int]], steps: int, repeat: int) -> float:  # noqa: ANN001 (LLM)
    """Best-of-`repeat` ms per decode step over `steps` steps."""
    from gapless import SamplingParams

    def run(n: int) -> float:
        t = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t

    run(2)  # warm-up
    return min((run(steps + 2) - run(2)) / steps for _ in range(repeat)) * 1e3


def ops_per_step(llm, prompts: list[list[int]]) -> int:  # noqa: ANN001 (LLM)
    """torch operators one decode step dispatches (the difference between 3 and 2 new tokens)."""
    from torch.profiler import profile

    from gapless import SamplingParams

    def count(n: int) -> int:
        with profile() as prof:
            llm.generate(
                prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False
            )
        return sum(1 for e in prof.events() if e.name.startswith("aten::"))

    return count(3) - count(2)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m gapless.bench.cpu_step", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=cli.positive_int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=cli.positive_int, default=34)
    p.add_argument("--steps", type=cli.positive_int, default=32)
    p.add_argument("--repeat", type=cli.positive_int, default=3)
    p.add_argument(
        "--threads", type=cli.positive_int, help="torch threads (default: torch's, the core count)"
    )
    args = p.parse_args(argv)
    from gapless import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    rows = []
    with LLM(args.model, device="cpu", dtype=args.dtype) as llm:
        for b in args.batch:
            prompts = [rng.integers(100, 1000, args.prompt_len).tolist() for _ in range(b)]
            ms = step_ms(llm, prompts, args.steps, args.repeat)
            rows.append(
                dict(batch=b, ms_per_step=ms, tok_s=b * 1e3 / ms, ops_per_step=ops_per_step(llm, prompts))
            )
            print(
                f"batch {b}: {ms:.1f} ms per decode step ({b * 1e3 / ms:.1f} tok/s), "
                f"{rows[-1]['ops_per_step']} torch ops per step, {torch.get_num_threads()} threads",
                flush=True,
            )
    return rows


if __name__ == "__main__":
    main()
