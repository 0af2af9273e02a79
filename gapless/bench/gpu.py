"""Offline throughput on a GPU: nano-vllm's workload on Qwen3-0.6B's shape, sampled as its bench.py samples.

    python -m gapless.bench.gpu --json out.json      # the full run (bench/gpu_bench.sh runs this)
    python -m gapless.bench.gpu --quick              # a small workload, to check that it runs
    python -m gapless.bench.gpu --quick --size tiny --device cpu --dtype float32    # the same on a CPU

The workload is nano-vllm's offline benchmark as it is: 256 requests, random prompt token ids, prompt
and output lengths uniform in [100, 1024], `ignore_eos`, seed 0 (`gapless.bench.workload`). The model
has Qwen3-0.6B's config (`gapless.testing.checkpoints`, size "qwen3-0.6b") and random weights in bf16,
built here (no hub download), so only the shape matters: decode then reads ~14 TB of KV cache (112 KiB a
token; 14.0 TB for seed 0) and ~1.2 TB of weights (1.19 GB a decode step).

One process runs, each after an untimed warm-up in its own engine (`gapless.bench.gpu_report.RUNS`,
`--runs`): gapless at temperature 0.6 (nano-vllm's and Mini-SGLang's bench.py), greedy, with Qwen3's
generation defaults (temperature 0.6, top-k 20, top-p 0.95), greedy without overlap scheduling, then
transformers batched greedy `generate` on the first `--hf-num-seqs` requests (a slice: it computes every
batch to its longest output). For gapless it reports output tokens/s, wall time, the GPU's idle fraction
(the engine's bubble meter: `device_idle_s / (device_busy_s + device_idle_s)`, gaps between forward jobs
while requests were pending), host and device ms per step, the bytes decode read per second against a
device copy measured in the same run, the KV pool and any retraction; then the ratios and the machine.
It prints a markdown table for the README and rewrites `--json` after every run, so a run cut short
keeps what finished. Each gapless run names the Triton kernels compiled in its timed run (seconds of host
time each; the warm-up should have taken them), and with `--profile-steps N` it then runs N decode steps
of every request at once under torch.profiler (`gapless.bench.timing.decode_profile`): each kernel's
device time a step, tabled after the report.
"""

from __future__ import annotations

import argparse
import functools
import gc
import logging
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch

from gapless.bench import cli
from gapless.bench.gpu_report import RUNS, derive, format_report, pct, ratios
from gapless.bench.runs import run_gapless, run_transformers
from gapless.bench.timing import copy_tb_s
from gapless.bench.workload import Workload, random_workload
from gapless.config import FP8_KV_CACHE_DTYPES
from gapless.memory.kv_pool import FP8_NAMES, kv_cache_dtype

# nano-vllm's bench.py: 256 seqs, input and output lengths uniform in [100, 1024].
NANO_VLLM: dict[str, int] = dict(num_seqs=256, min_input=100, max_input=1024, min_output=100, max_output=1024)
# `--quick`: seconds on a GPU; with `--size tiny --device cpu` the CPU smoke test.
QUICK: dict[str, int] = dict(num_seqs=16, min_input=16, max_input=64, min_output=8, max_output=32)
# transformers runs a slice: its static batch decodes to the batch's longest output (~1,000 steps here
# whatever the batch size), so a slice costs about as much wall time as the whole workload would per batch.
# 64 requests in one batch: ~1,000 steps, well under a minute on an H100, and a batch big enough to be the
# fair baseline (bigger batches help generate too) while its KV cache (~14 GiB) fits beside nothing else.
HF_NUM_SEQS = 64
QUICK_HF_NUM_SEQS = 4
# gapless's warm-up: this many requests (another seed, so the prefix cache gives the timed run nothing)
# with the workload's prompt lengths and a few output tokens. Over 33 requests so decode batches reach the
# one-split attention configuration a full batch uses (see `decode_num_splits`), and long prompts so the
# prefill kernels see long chunks: Triton compiles what it needs before the clock starts.
WARMUP_SEQS = 64
WARMUP_OUTPUT = (4, 48)
QUICK_WARMUP = (4, (2, 8))


def _parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m gapless.bench.gpu",
        description="Offline throughput on a GPU (nano-vllm workload, Qwen3-0.6B shape): gapless with and "
        "without overlap, and transformers batched generate on a slice.",
    )
    w = cli.add_workload_args(p, "nano-vllm's", NANO_VLLM, "a small workload, to check that everything runs")
    w.add_argument(
        "--warmup-seqs",
        type=int,
        help=f"requests in gapless's untimed warm-up (default {WARMUP_SEQS}, at most --num-seqs)",
    )
    m = cli.add_model_args(p, "qwen3-0.6b", ("tiny", "overlap", "bench", "qwen3-0.6b"), "model and device")
    m.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    m.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float16", "float32"),
        help="weights and KV dtype of both engines, and of the built checkpoint (default bfloat16)",
    )
    g = p.add_argument_group("gapless")
    g.add_argument(
        "--kv-cache-tokens",
        type=int,
        help="KV pool size (default: every token of the workload and the warm-up, plus slack, so nothing "
        "is retracted; ~31 GiB for the default workload)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=("auto", *FP8_KV_CACHE_DTYPES),
        help="the KV cache's dtype in both gapless runs (the engine's option): auto, the model's; fp8, e4m3; "
        "fp8_e5m2, e5m2",
    )
    cli.add_engine_option_arg(
        g,
        "extra LLM option for both gapless runs, repeatable (e.g. cuda_graph_max_bs=0, "
        "attention_backend=torch, page_size=16); not overlap, which the runs set",
    )
    g.add_argument(
        "--runs",
        nargs="+",
        choices=tuple(RUNS),
        default=list(RUNS),
        help=f"the gapless runs, in this order (default all: {' '.join(RUNS)})",
    )
    g.add_argument("--skip-plain", action="store_true", help="leave out the run without overlap (plain)")
    g.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        metavar="N",
        help="after each gapless run, N decode steps over every request at once under torch.profiler: "
        "each kernel's device time a step (default 0: none)",
    )
    h = p.add_argument_group("transformers")
    h.add_argument("--skip-hf", action="store_true", help="run gapless only")
    h.add_argument(
        "--hf-num-seqs",
        type=int,
        help=f"run transformers on the first N requests (default {HF_NUM_SEQS}, --quick {QUICK_HF_NUM_SEQS})",
    )
    h.add_argument("--hf-batch-size", type=int, help="static batch size of generate (default: the slice)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH (after every run)")
    args = p.parse_args(argv)
    cli.finish_args(p, args, NANO_VLLM, QUICK)
    _fill_defaults(args)
    error = _check(args)
    if error:
        p.error(error)
    return args


def _fill_defaults(args: argparse.Namespace) -> None:
    """The defaults that depend on --quick or on other flags."""
    if args.hf_num_seqs is None:
        args.hf_num_seqs = min(QUICK_HF_NUM_SEQS if args.quick else HF_NUM_SEQS, args.num_seqs)
    if args.hf_batch_size is None:
        args.hf_batch_size = args.hf_num_seqs
    if args.warmup_seqs is None:
        args.warmup_seqs = QUICK_WARMUP[0] if args.quick else WARMUP_SEQS
    args.warmup_seqs = min(args.warmup_seqs, args.num_seqs)
    args.warmup_output = QUICK_WARMUP[1] if args.quick else WARMUP_OUTPUT


def _check(args: argparse.Namespace) -> str | None:
    """What is wrong with the flags, if anything."""
    if "overlap" in args.engine_options:
        return "--engine-option overlap=... : the runs set it (--runs picks them)"
    if "kv_cache_dtype" in args.engine_options:
        return "--engine-option kv_cache_dtype=... : use --kv-cache-dtype (the report counts its bytes)"
    if not 1 <= args.hf_num_seqs <= args.num_seqs:
        return f"--hf-num-seqs must be in [1, {args.num_seqs}]"
    if args.hf_batch_size < 1:
        return "--hf-batch-size must be >= 1"
    if args.warmup_seqs < 1:
        return "--warmup-seqs must be >= 1"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        return (
            f"--device {args.device} but CUDA is not available (a CPU smoke run: --quick --size tiny "
            "--device cpu --dtype float32)"
        )
    return None


def decode_kv_tokens_read(work: Workload) -> int:
    """Keys (= values) attention reads over all decode steps: a request's first output token comes from its
    prefill, and decode step j (j = 1 .. out-1) attends to prompt + j keys."""
    total = 0
    for prompt, out in zip(work.prompts, work.output_lens):
        steps = out - 1
        total += steps * len(prompt) + steps * (steps + 1) // 2
    return total


def _free_device(device: str) -> int | None:
    """Drop what the last run left (its engine, transformers' model) and return the bytes still allocated:
    non-zero means something kept a reference, and the next run has less memory."""
    gc.collect()
    if torch.device(device).type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _peak_gib(device: str) -> float | None:
    if torch.device(device).type != "cuda":
        return None
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2)


def _copy_tb_s(device: str) -> float | None:
    """A device copy's bandwidth (bytes read and written) over 1 GiB, on CUDA; None elsewhere."""
    if torch.device(device).type != "cuda":
        return None
    return copy_tb_s(2**30, torch.device(device), argparse.Namespace(iters=20, warmup=3))


def _compiled(names: list[str]) -> str:
    """`triton_compiles`' names as a phrase: "nothing", or each kernel with its count."""
    counts = {n: names.count(n) for n in dict.fromkeys(names)}
    return ", ".join(f"{n} x{c}" for n, c in counts.items()) or "nothing"


def _interrupted(e: BaseException | None) -> bool:
    """Whether `e` is, or was raised while handling, a KeyboardInterrupt (an error raised by some cleanup
    after an interrupt would otherwise hide it)."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def _failed(e: BaseException) -> dict[str, Any]:
    tb = traceback.format_exc()
    print(tb, file=sys.stderr, flush=True)
    line = (
        "interrupted (SIGINT: bench/gpu_bench.sh's time limit?)"
        if _interrupted(e)
        else f"{type(e).__name__}: {e}"
    )
    return dict(error=tb, error_line=line.splitlines()[0][:200], interrupted=_interrupted(e))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the report, return the results (the JSON's content). A run that raises is
    recorded (`error`) and the next one still runs; `res["errors"]` names them."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parse_args(argv)
    log = logging.getLogger("gapless")
    level = log.level
    log.setLevel(logging.INFO)  # the engine's KV sizing, attention backend and CUDA graph lines
    try:
        return _Bench(args, argv).run()
    finally:
        log.setLevel(level)


class _Bench:
    """One benchmark run: the model and workloads it sets up, then each engine's timed run into `res`."""

    def __init__(self, args: argparse.Namespace, argv: list[str]) -> None:
        self.args = args
        self.res: dict[str, Any] = dict(
            command=cli.command_line("gapless.bench.gpu", argv), machine=cli.machine(args.device)
        )
        cli.progress(f"machine: {self.res['machine']}")
        what = args.model or f"building/loading the random {args.size} qwen3 in {args.dtype}"
        cli.progress(f"model: {what} ...")
        self.path, build_s = cli.model_path(args, args.dtype)
        self.info = cli.model_info(self.path, args.dtype)
        if args.kv_cache_dtype != "auto":  # fp8: one byte an element, in the reads the report counts
            args.engine_options["kv_cache_dtype"] = args.kv_cache_dtype
            self.info["kv_bytes_per_token"] //= torch.empty(
                0, dtype=getattr(torch, args.dtype)
            ).element_size()
        kv_dtype = kv_cache_dtype(args.kv_cache_dtype, getattr(torch, args.dtype))
        self.info["kv_cache_dtype"] = FP8_NAMES.get(kv_dtype, args.dtype)
        cli.progress(
            f"model at {self.path} (built in {build_s:.1f} s): {self.info['params'] / 1e6:.0f}M params"
        )
        vocab = self.info["vocab_size"]
        self.work = cli.workload_from_args(args, vocab)
        lo, hi = args.warmup_output
        self.warm = random_workload(
            args.warmup_seqs, args.min_input, args.max_input, lo, hi, vocab_size=vocab, seed=args.seed + 1
        )
        kv = args.kv_cache_tokens
        if kv is None:
            kv = self.work.input_tokens + self.work.output_tokens + self.warm.input_tokens
            kv += self.warm.output_tokens + 4096
        self.hf_work = self.work.head(args.hf_num_seqs)
        self.kv_read = decode_kv_tokens_read(self.work)
        name = self.path.name if args.model else f"random-weight qwen3, size {args.size!r}"
        if not args.model and args.size == "qwen3-0.6b":
            name += " (Qwen3-0.6B's config)"
        self.res.update(
            model=str(self.path),
            model_name=name,
            model_info=self.info,
            build_s=build_s,
            workload=dict(
                **cli.workload_summary(args, self.work),
                decode_kv_tokens_read=self.kv_read,
                warmup_requests=len(self.warm),
                warmup_tokens=self.warm.input_tokens + self.warm.output_tokens,
                hf_num_seqs=len(self.hf_work),
                hf_output_tokens=self.hf_work.output_tokens,
            ),
            sampling={k: RUNS[k].sampling for k in args.runs},
            copy_tb_s=_copy_tb_s(args.device),
            kv_cache_tokens=kv,
            engine_options=args.engine_options,
            errors=[],
        )

    def save(self) -> None:
        """Rewrite the JSON with what has finished (so a run cut short keeps it)."""
        self.res["ratios"] = ratios(self.res)
        if self.args.json:
            cli.write_json(self.args.json, self.res)

    def run(self) -> dict[str, Any]:
        """Each gapless mode, then transformers. A run that fails is recorded and the next one goes on; an
        interrupt (SIGINT, e.g. the time limit of bench/gpu_bench.sh) stops the runs, and what finished is
        still reported and saved."""
        args, res = self.args, self.res
        stop = False
        for key in args.runs:
            if stop or (key == "plain" and args.skip_plain):
                continue
            stop = self._record(key, functools.partial(self._gapless, key))
        if not args.skip_hf and not stop:
            self._record("transformers", self._transformers)
            _free_device(args.device)
        self.save()
        report = format_report(res)
        res["report"] = report
        self.save()
        print(report, flush=True)
        cli.progress("done" + (f"; FAILED: {', '.join(res['errors'])}" if res["errors"] else ""))
        return res

    def _record(self, key: str, run: Callable[[], dict[str, Any]]) -> bool:
        """`run()`'s result, or its failure, as `res[key]`, saved; True if it was interrupted."""
        leftover = _free_device(self.args.device)
        try:
            r = run()
            r["leftover_bytes_before"] = leftover
            r["peak_gib"] = _peak_gib(self.args.device)
        except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - recorded (see `run`)
            r = _failed(e)
            self.res["errors"].append(key)
        self.res[key] = r
        self.save()
        return bool(r.get("interrupted"))

    def _gapless(self, key: str) -> dict[str, Any]:
        args, work, run = self.args, self.work, RUNS[key]
        cli.progress(f"{run.label}: {len(work)} requests, {work.output_tokens} output tokens ...")
        g = run_gapless(
            self.path,
            work,
            kv_cache_tokens=self.res["kv_cache_tokens"],
            options={**args.engine_options, "overlap": run.overlap},
            device=args.device,
            dtype=args.dtype,
            warmup=self.warm,
            sampling=run.sampling,
            profile_steps=args.profile_steps,
        )
        derive(g, self.info, self.kv_read, self.res["copy_tb_s"])
        cli.progress(
            f"{run.label}: {g['output_tokens_per_s']:.0f} tok/s in {g['wall_s']:.2f} s "
            f"(load {g['load_s']:.1f} s, warm-up {g['warmup_s']:.1f} s), "
            f"idle {pct(g['device_idle_fraction'])}, {g['retractions']} retractions, "
            f"Triton compiled {_compiled(g['triton_compiles'])} in the timed run"
        )
        return g

    def _transformers(self) -> dict[str, Any]:
        args, warm = self.args, self.warm
        cli.progress(f"transformers: {len(self.hf_work)} requests, batches of {args.hf_batch_size} ...")
        hf_warm = Workload(warm.prompts[: min(4, len(warm))], [8] * min(4, len(warm)))
        h = run_transformers(
            self.path, self.hf_work, args.hf_batch_size, device=args.device, dtype=args.dtype, warmup=hf_warm
        )
        cli.progress(
            f"transformers: {h['output_tokens_per_s']:.0f} tok/s in {h['wall_s']:.2f} s "
            f"(load {h['load_s']:.1f} s)"
        )
        return h


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    sys.exit(1 if main()["errors"] else 0)
