"""The offline decode step on the CPU, without the server: ms per step and torch ops per step at a few
batch sizes, to set beside llama.cpp's per-token time (`bench/llamacpp_cpu.sh`) and beside the served
path's profile (`bench/profile_served.sh`).

    python bench/experiments/cpu_step.py [--model SmolLM2-135M-Instruct] [--batch 1 8] [--dtype float32]
        [--threads N] [--compare] [--compare-one-row]

Per batch size B: B prompts of `--prompt-len` random token ids, greedy with `ignore_eos`; a step's time is
(time of `--steps` + 2 new tokens - time of 2 new tokens) / `--steps`, each time the best of `--repeat`, so
the prefill and the first decode cancel out. `--compare` loads the model twice, once with the CPU's GEMMs on
plain weights (`GAPLESS_CPU_GEMM=plain`, see `gapless.model.cpu_gemm`) and once by default (prepacked), and
times them in alternation (plain, default, plain, ...), so that on a shared machine both see the same load: it
prints each one's step time and default/plain, the ratio to trust. `--compare-one-row` times the default
engine also with `gapless.model.cpu_gemm.ONE_ROW_AS = 1` (oneDNN's one-row kernel called on a lone row as it
is, where the default computes it as copies of itself), alternating in the same way, and prints
default/one_row_direct (the same at 2 rows and more). `--compare-compile` loads the engine a second time with
`cpu_compile=True` (its decode layers compiled: `gapless.engine.cpu_compile`) and prints default/compiled, the
compiled step's speed-up. `--compare-without-gemms` times the default engine also with every prepacked GEMM
(the linear layers and the LM head) replaced by a cached zero result of its shape, alternating in the same
way: what a step costs besides its GEMMs (the attention, norms, RoPE, sampling, the host), the floor that no
GEMM kernel lowers; it prints without_gemms/default, the share of the step outside the GEMMs. The op count is
the number of torch operators (`aten::*`, nested ones included) that one decode step dispatches, from the
torch profiler: on a CPU each costs a few microseconds of dispatch whatever its size, so it is the part of a
small model's step that is overhead."""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from gapless.bench import cli
from gapless.model import cpu_gemm

DEFAULT_ONE_ROW_AS = cpu_gemm.ONE_ROW_AS


def generate_s(llm, prompts: list[list[int]], tokens: int) -> float:  # noqa: ANN001 (LLM)
    """Seconds to generate `tokens` new tokens greedily for every prompt."""
    from gapless import SamplingParams

    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return time.perf_counter() - t


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


def _engines(args: argparse.Namespace) -> dict[str, Any]:
    """label -> LLM: the configured one ("default": the default CPU GEMMs), and under `--compare` first
    one with plain weights, made while `GAPLESS_CPU_GEMM=plain` is set."""
    from gapless import LLM

    def make(**options: Any) -> Any:
        # the device side in this process (not the device process a machine of 4 cores or more gets by
        # default): its ops are counted and its GEMMs swapped here, the same on every machine
        kv = args.kv_cache_tokens
        return LLM(
            args.model, device="cpu", dtype=args.dtype, kv_cache_tokens=kv, cpu_worker="inline", **options
        )

    engines = {}
    if args.compare:
        with _env(cpu_gemm.ENV, "plain"):
            engines["plain"] = make()
    for setting in args.compare_env or []:
        name, _, value = setting.partition("=")
        with _env(name, value):
            engines[setting] = make()
    engines["default"] = make()
    if args.compare_compile:
        engines["compiled"] = make(cpu_compile=True)
    # variants of the default engine, told apart by `_variant` while they run
    for label, wanted in (
        ("one_row_direct", args.compare_one_row),
        ("without_gemms", args.compare_without_gemms),
    ):
        if wanted:
            engines[label] = engines["default"]
    return engines


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    """Environment variable `name` set to `value` while an engine is made (it is read at load)."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


_ZEROS: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}  # the stand-in GEMMs' results, by shape


def _zero_gemm(self: cpu_gemm.PackedLinear, x: torch.Tensor) -> torch.Tensor:
    """A prepacked GEMM's stand-in: a cached zero result of its shape (one dict lookup, no arithmetic)."""
    key = (x.shape[0], self.out_features, x.dtype)
    if key not in _ZEROS:
        _ZEROS[key] = torch.zeros(x.shape[0], self.out_features, dtype=x.dtype)
    return _ZEROS[key]


@contextlib.contextmanager
def _variant(label: str) -> Iterator[None]:
    """The GEMMs as the engine labelled `label` runs them: oneDNN's one-row call on a lone row as it is
    (`one_row_direct`), no GEMMs at all (`without_gemms`), or as the engine was made."""
    call = cpu_gemm.PackedLinear.__call__
    cpu_gemm.ONE_ROW_AS = 1 if label == "one_row_direct" else DEFAULT_ONE_ROW_AS
    if label == "without_gemms":
        cpu_gemm.PackedLinear.__call__ = _zero_gemm  # type: ignore[method-assign]
    try:
        yield
    finally:
        cpu_gemm.PackedLinear.__call__ = call  # type: ignore[method-assign]
        cpu_gemm.ONE_ROW_AS = DEFAULT_ONE_ROW_AS


def _measure(engines: dict[str, Any], prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """Each engine's ms per step, the rounds alternating between the engines: its best run of `--steps` + 2
    tokens less its best run of 2 (noise only adds time, so each length's best is its own estimate)."""
    long = {label: float("inf") for label in engines}
    short = dict(long)
    for i in range(args.repeat):
        for label, llm in engines.items():
            with _variant(label):
                if i == 0:
                    generate_s(llm, prompts, 2)  # warm-up
                long[label] = min(long[label], generate_s(llm, prompts, args.steps + 2))
                short[label] = min(short[label], generate_s(llm, prompts, 2))
    best = {label: (long[label] - short[label]) / args.steps * 1e3 for label in engines}
    row: dict[str, Any] = {"batch": len(prompts)}
    for label, ms in best.items():
        row[label] = dict(ms_per_step=ms, tok_s=len(prompts) * 1e3 / ms)
    for label, llm in engines.items():
        with _variant(label):
            row[label]["ops_per_step"] = ops_per_step(llm, prompts)
    if "compiled" in best:
        row["default_over_compiled"] = best["default"] / best["compiled"]
    for other in ("plain", "one_row_direct"):
        if other in best:
            row[f"default_over_{other}"] = best["default"] / best[other]
    if "without_gemms" in best:
        row["without_gemms_over_default"] = best["without_gemms"] / best["default"]
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(
        prog="python bench/experiments/cpu_step.py", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=cli.positive_int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=cli.positive_int, default=34)
    p.add_argument("--steps", type=cli.positive_int, default=32)
    p.add_argument("--repeat", type=cli.positive_int, default=3)
    p.add_argument(
        "--threads", type=cli.positive_int, help="torch threads (default: torch's, the core count)"
    )
    p.add_argument("--kv-cache-tokens", type=cli.positive_int, default=16384, help="each engine's KV pool")
    p.add_argument("--compare", action="store_true", help="also time plain-weight GEMMs, alternating")
    p.add_argument(
        "--compare-one-row", action="store_true", help="also time oneDNN's one-row kernel, alternating"
    )
    p.add_argument(
        "--compare-without-gemms",
        action="store_true",
        help="also time the step with every GEMM replaced by a cached zero result, alternating",
    )
    p.add_argument(
        "--compare-compile",
        action="store_true",
        help="also time the engine with --cpu-compile (its decode layers compiled), alternating",
    )
    p.add_argument(
        "--compare-env",
        nargs="+",
        metavar="NAME=VALUE",
        help="also time the model loaded with each environment setting (read at load), alternating",
    )
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    rows = []
    engines = _engines(args)
    try:
        for b in args.batch:
            prompts = [rng.integers(100, 1000, args.prompt_len).tolist() for _ in range(b)]
            rows.append(_measure(engines, prompts, args))
            for label in engines:
                r = rows[-1][label]
                print(
                    f"batch {b} {label}: {r['ms_per_step']:.1f} ms per decode step ({r['tok_s']:.1f} tok/s), "
                    f"{r['ops_per_step']} torch ops per step, {torch.get_num_threads()} threads",
                    flush=True,
                )
            if "default_over_compiled" in rows[-1]:
                speedup = rows[-1]["default_over_compiled"]
                print(f"batch {b}: compiled speed-up (default / compiled step time) {speedup:.2f}")
            for other in ("plain", "one_row_direct"):
                if f"default_over_{other}" in rows[-1]:
                    ratio = rows[-1][f"default_over_{other}"]
                    print(f"batch {b}: default / {other} step time {ratio:.2f}", flush=True)
            if "without_gemms_over_default" in rows[-1]:
                share = rows[-1]["without_gemms_over_default"]
                print(f"batch {b}: the step besides its GEMMs is {share:.2f} of it", flush=True)
    finally:
        for llm in {id(llm): llm for llm in engines.values()}.values():  # variants share default's
            llm.shutdown()
    return rows


if __name__ == "__main__":
    main()
