"""Offline throughput on a GPU: nano-vllm's workload on Qwen3-0.6B's shape, overlap on vs off vs transformers.

    python -m gapless.bench.gpu --json out.json      # the full run (bench/gpu_bench.sh runs this)
    python -m gapless.bench.gpu --quick              # a small workload, to check that it runs
    python -m gapless.bench.gpu --quick --size tiny --device cpu --dtype float32    # the same on a CPU

The workload is nano-vllm's offline benchmark as it is: 256 requests, random prompt token ids, prompt
and output lengths uniform in [100, 1024], `ignore_eos`, seed 0 (`gapless.bench.workload`). The model
has Qwen3-0.6B's config (`gapless.testing.checkpoints`, size "qwen3-0.6b") and random weights in bf16,
built here (no hub download), so only the shape matters: decode then reads ~14 TB of KV cache (112 KiB a
token; 14.0 TB for seed 0) and ~1.2 TB of weights (1.19 GB a decode step).

One process runs, each after an untimed warm-up in its own engine: gapless with overlap scheduling,
gapless without it, and transformers batched `generate` on the first `--hf-num-seqs` requests (a slice:
it computes every batch to its longest output). For gapless it reports output tokens/s, wall time, the
GPU's idle fraction (the engine's bubble meter: `device_idle_s / (device_busy_s + device_idle_s)`, gaps
between forward jobs while requests were pending), host and device ms per step, the KV pool and any
retraction; then overlap/no-overlap and gapless/transformers ratios, and the machine. It prints a markdown
table for the README and rewrites `--json` after every run, so a run cut short keeps what finished.
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
from gapless.bench.runs import run_gapless, run_transformers
from gapless.bench.workload import Workload, random_workload

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
# Published anchors the issue compares with (nano-vllm's README, A800): and the target on an H100.
ANCHORS = "vLLM 0.10.2 8,588 tok/s and nano-vllm's Triton variant 10,009 tok/s on an A800"
TARGET_TOK_S = 20_000
TARGET_IDLE = 0.02

RUNS = {"overlap": True, "plain": False}  # result key -> the engine's `overlap` option
LABELS = {
    "overlap": "gapless, overlap",
    "plain": "gapless, no overlap",
    "transformers": "transformers generate",
}


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
    cli.add_engine_option_arg(
        g,
        "extra LLM option for both gapless runs, repeatable (e.g. cuda_graph_max_bs=0, "
        "attention_backend=torch, page_size=16); not overlap, which the runs set",
    )
    g.add_argument("--skip-plain", action="store_true", help="run gapless with overlap only")
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
        return "--engine-option overlap=... : the benchmark runs both modes (use --skip-plain for one)"
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


def _gapless_derived(g: dict[str, Any], info: dict[str, Any], kv_read_tokens: int) -> None:
    """Idle fraction, per-step times and the bytes decode read, added to a `run_gapless` result."""
    busy, idle, host = g.get("device_busy_s"), g.get("device_idle_s"), g.get("host_s")
    steps = g.get("steps") or 0
    # The meter's idle: gaps between consecutive jobs while requests were pending. On CUDA each job's
    # duration comes from its events (exact), placed on the host clock where the host's wait returned, so
    # the gaps lean on when the host looked; busy / wall needs no placement (jobs run one at a time on the
    # forward stream) and bounds the idle share from above (it also counts the first launch and last wait).
    g["busy_fraction_of_wall"] = busy / g["wall_s"] if busy is not None and g["wall_s"] else None
    g["device_idle_fraction"] = (
        idle / (busy + idle) if busy is not None and idle is not None and busy + idle else None
    )
    g["host_ms_per_step"] = 1e3 * host / steps if host is not None and steps else None
    g["device_ms_per_step"] = 1e3 * busy / steps if busy is not None and steps else None
    g["kv_pool_gib"] = round(g["kv_pool_tokens"] * info["kv_bytes_per_token"] / 2**30, 2)
    read = kv_read_tokens * info["kv_bytes_per_token"] + g["decode_batches"] * info["weight_bytes"]
    g["decode_bytes_read"] = read
    g["decode_read_tb_per_s"] = read / 1e12 / g["wall_s"]  # a lower bound: the wall time includes prefill


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.2f}%"


def _sub1(x: float | None) -> float | None:
    return None if x is None else 1 - x


def _num(x: float | None, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def _failed_row(key: str, r: dict[str, Any]) -> list[str]:
    return [LABELS[key], *[""] * 8, f"FAILED: {r['error_line']}"]


def _gapless_row(key: str, g: dict[str, Any]) -> list[str]:
    notes = (
        f"attention {g['attention_backend'] or '?'}; KV pool {g['kv_pool_tokens']:,} tokens "
        f"({g['kv_pool_gib']} GiB); {g['retractions']} retractions; decode read "
        f"{g['decode_bytes_read'] / 1e12:.1f} TB, {g['decode_read_tb_per_s']:.2f} TB/s"
    )
    if g.get("peak_gib") is not None:
        notes += f"; peak {g['peak_gib']} GiB"
    return [
        LABELS[key],
        str(g["requests"]),
        f"{g['output_tokens']:,}",
        f"{g['wall_s']:.2f}",
        f"{g['output_tokens_per_s']:,.0f}",
        f"{_pct(g['device_idle_fraction'])} ({_pct(_sub1(g['busy_fraction_of_wall']))})",
        _num(g["host_ms_per_step"], ".2f"),
        _num(g["device_ms_per_step"], ".2f"),
        f"{g['steps']} ({g['prefill_batches']} + {g['decode_batches']})",
        notes,
    ]


def _transformers_row(h: dict[str, Any]) -> list[str]:
    return [
        LABELS["transformers"],
        f"{h['requests']} (the first {h['requests']})",
        f"{h['output_tokens']:,}",
        f"{h['wall_s']:.2f}",
        f"{h['output_tokens_per_s']:,.0f}",
        *["n/a"] * 4,
        f"sdpa, {h['dtype']}; {h['batches']} left-padded static batch(es) of {h['batch_size']}; "
        f"{h['wasted_output_fraction']:.0%} of decoded tokens past their request's length",
    ]


def _rows(res: dict[str, Any]) -> list[list[str]]:
    """The table's rows: each gapless run and transformers, or the error that stopped one."""
    rows = []
    for key in (*RUNS, "transformers"):
        r = res.get(key)
        if r is None:
            continue
        if "error" in r:
            rows.append(_failed_row(key, r))
        else:
            rows.append(_transformers_row(r) if key == "transformers" else _gapless_row(key, r))
    return rows


def _verdict(res: dict[str, Any]) -> list[str]:
    """The ratios, the target check and any wrong-length warning, under the table."""
    lines = []
    r = res["ratios"]
    if r.get("overlap_vs_plain") is not None:
        lines.append(f"**overlap / no overlap: {r['overlap_vs_plain']:.2f}x** output tokens/s")
    if r.get("gapless_vs_transformers") is not None:
        lines.append(
            f"**gapless (overlap) / transformers: {r['gapless_vs_transformers']:.1f}x** output tokens/s "
            "(transformers on its slice)"
        )
    g = res.get("overlap")
    if g is not None and "error" not in g:
        idle = g["device_idle_fraction"]
        met = g["output_tokens_per_s"] >= TARGET_TOK_S and idle is not None and idle < TARGET_IDLE
        lines.append(
            f"\nanchors: {ANCHORS}; target on an H100: >= {TARGET_TOK_S:,} tok/s with GPU idle < "
            f"{TARGET_IDLE:.0%} in overlap mode: {'met' if met else 'NOT met'} here "
            f"({g['output_tokens_per_s']:,.0f} tok/s, {_pct(idle)} idle)"
        )
    for key in RUNS:
        g = res.get(key)
        if g is not None and "error" not in g and g["wrong_length_requests"]:
            lines.append(
                f"\nWARNING ({key}): {g['wrong_length_requests']} requests did not get their length "
                f"({g['output_tokens']} tokens generated, {g['requested_output_tokens']} requested)"
            )
    return lines


def format_report(res: dict[str, Any]) -> str:
    """The markdown the command prints, ready for the README."""
    w, mi = res["workload"], res["model_info"]
    on_gpu = "gpu" in res["machine"]
    idle_name = "GPU idle" if on_gpu else "device idle"
    header = (
        "engine",
        "requests",
        "output tokens",
        "wall s",
        "output tok/s",
        f"{idle_name} (1 - busy/wall)",
        "host ms/step",
        "device ms/step",
        "steps (prefill + decode)",
        "notes",
    )
    lines = [
        f"## Offline throughput{' on the GPU' if on_gpu else ''}: nano-vllm's workload (greedy, ignore_eos)",
        "",
        f"command: `{res['command']}`",
        cli.machine_line(res["machine"]),
        f"model: {res['model_name']}: {mi['num_hidden_layers']} layers, hidden {mi['hidden_size']}, "
        f"{mi['num_attention_heads']} q / {mi['num_key_value_heads']} kv heads x {mi['head_dim']}, vocab "
        f"{mi['vocab_size']}; {mi['params'] / 1e6:.0f}M parameters, random weights, {mi['dtype']} "
        f"({mi['weight_bytes'] / 1e9:.2f} GB, {mi['kv_bytes_per_token'] / 1024:.0f} KiB of KV per token)",
        f"{cli.workload_line(w)}; decode reads "
        f"{w['decode_kv_tokens_read'] * mi['kv_bytes_per_token'] / 1e12:.2f} TB of KV",
        "",
        *cli.markdown_table(header, _rows(res), "lrrrrrrrll"),
        "",
        f"{idle_name}: the engine's bubble meter, gaps between forward jobs while requests were pending over "
        "busy + gaps; in brackets 1 - (summed job time / wall), which also counts the first launch and the "
        "last wait. host ms/step: scheduling, batch building and result processing, waits excluded.",
        "",
        *_verdict(res),
    ]
    return "\n".join(lines)


def _ratios(res: dict[str, Any]) -> dict[str, float | None]:
    def tok_s(key: str) -> float | None:
        r = res.get(key)
        return None if r is None or "error" in r else r["output_tokens_per_s"]

    o, p, h = tok_s("overlap"), tok_s("plain"), tok_s("transformers")
    return dict(
        overlap_vs_plain=o / p if o and p else None,
        gapless_vs_transformers=o / h if o and h else None,
        plain_vs_transformers=p / h if p and h else None,
    )


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
            sampling="greedy (temperature 0), ignore_eos",
            kv_cache_tokens=kv,
            engine_options=args.engine_options,
            errors=[],
        )

    def save(self) -> None:
        """Rewrite the JSON with what has finished (so a run cut short keeps it)."""
        self.res["ratios"] = _ratios(self.res)
        if self.args.json:
            cli.write_json(self.args.json, self.res)

    def run(self) -> dict[str, Any]:
        """Each gapless mode, then transformers. A run that fails is recorded and the next one goes on; an
        interrupt (SIGINT, e.g. the time limit of bench/gpu_bench.sh) stops the runs, and what finished is
        still reported and saved."""
        args, res = self.args, self.res
        stop = False
        for key, overlap in RUNS.items():
            if stop or (key == "plain" and args.skip_plain):
                continue
            stop = self._record(key, functools.partial(self._gapless, overlap))
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

    def _gapless(self, overlap: bool) -> dict[str, Any]:
        args, work = self.args, self.work
        cli.progress(
            f"gapless, overlap={overlap}: {len(work)} requests, {work.output_tokens} output tokens ..."
        )
        g = run_gapless(
            self.path,
            work,
            kv_cache_tokens=self.res["kv_cache_tokens"],
            options={**args.engine_options, "overlap": overlap},
            device=args.device,
            dtype=args.dtype,
            warmup=self.warm,
        )
        _gapless_derived(g, self.info, self.kv_read)
        cli.progress(
            f"gapless, overlap={overlap}: {g['output_tokens_per_s']:.0f} tok/s in {g['wall_s']:.2f} s "
            f"(load {g['load_s']:.1f} s, warm-up {g['warmup_s']:.1f} s), "
            f"idle {_pct(g['device_idle_fraction'])}, {g['retractions']} retractions"
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
