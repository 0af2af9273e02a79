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
import gc
import json
import logging
import os
import platform
import shlex
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from gapless.bench.offline import (
    add_workload_args,
    cpu_name,
    fill_workload_args,
    parse_engine_options,
    run_gapless,
    run_transformers,
    workload_summary,
)
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
_T0 = time.perf_counter()


def _log(msg: str) -> None:
    """Progress on stderr, with seconds since start and the wall clock (to line up with nvidia-smi logs)."""
    stamp = time.strftime("%H:%M:%S")
    print(f"[{time.perf_counter() - _T0:7.1f}s {stamp}] {msg}", file=sys.stderr, flush=True)


def _parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m gapless.bench.gpu",
        description="Offline throughput on a GPU (nano-vllm workload, Qwen3-0.6B shape): gapless with and "
        "without overlap, and transformers batched generate on a slice.",
    )
    w = add_workload_args(p, "nano-vllm's", NANO_VLLM, "a small workload, to check that everything runs")
    w.add_argument(
        "--warmup-seqs",
        type=int,
        help=f"requests in gapless's untimed warm-up (default {WARMUP_SEQS}, at most --num-seqs)",
    )
    m = p.add_argument_group("model and device")
    m.add_argument("--model", help="HF checkpoint dir (default: the random-weight qwen3 of --size, built)")
    m.add_argument(
        "--size",
        default="qwen3-0.6b",
        choices=("tiny", "overlap", "bench", "qwen3-0.6b"),
        help="shape of the built-in random qwen3 when --model is not given (default qwen3-0.6b)",
    )
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
        "--engine-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra LLM option for both gapless runs, repeatable (e.g. cuda_graph_max_bs=0, "
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

    fill_workload_args(args, QUICK if args.quick else NANO_VLLM)
    if args.hf_num_seqs is None:
        args.hf_num_seqs = min(QUICK_HF_NUM_SEQS if args.quick else HF_NUM_SEQS, args.num_seqs)
    if args.hf_batch_size is None:
        args.hf_batch_size = args.hf_num_seqs
    if args.warmup_seqs is None:
        args.warmup_seqs = QUICK_WARMUP[0] if args.quick else WARMUP_SEQS
    args.warmup_seqs = min(args.warmup_seqs, args.num_seqs)
    args.warmup_output = QUICK_WARMUP[1] if args.quick else WARMUP_OUTPUT
    try:
        args.engine_options = parse_engine_options(args.engine_option)
    except ValueError as e:
        p.error(str(e))
    if "overlap" in args.engine_options:
        p.error("--engine-option overlap=... : the benchmark runs both modes (use --skip-plain for one)")
    if not 1 <= args.hf_num_seqs <= args.num_seqs:
        p.error(f"--hf-num-seqs must be in [1, {args.num_seqs}]")
    if args.hf_batch_size < 1:
        p.error("--hf-batch-size must be >= 1")
    if args.warmup_seqs < 1:
        p.error("--warmup-seqs must be >= 1")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(
            f"--device {args.device} but CUDA is not available (a CPU smoke run: --quick --size tiny "
            "--device cpu --dtype float32)"
        )
    return args


def _model_path(args: argparse.Namespace) -> tuple[Path, float]:
    """The checkpoint, and the seconds it took to build (0 when given or cached)."""
    if args.model:
        return Path(args.model), 0.0
    from gapless.testing import cached_checkpoint

    dtype = getattr(torch, args.dtype)
    # float32 is the default of `make_checkpoint`: leave it out so the tests' cached checkpoints are shared
    kw = {} if dtype == torch.float32 else {"dtype": dtype}
    t0 = time.perf_counter()
    path = cached_checkpoint("qwen3", size=args.size, **kw)
    return path, time.perf_counter() - t0


def _model_info(path: Path, dtype: str) -> dict[str, Any]:
    """Shape, parameter count (from the safetensors headers) and the bytes decode reads per token/step."""
    from safetensors import safe_open

    cfg = json.loads((path / "config.json").read_text())
    layers, kv_heads = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    elem = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    params = 0
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                n = 1
                for d in st.get_slice(name).get_shape():
                    n *= d
                params += n
    return dict(
        model_type=cfg.get("model_type"),
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg.get("intermediate_size"),
        num_hidden_layers=layers,
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=cfg["vocab_size"],
        tie_word_embeddings=cfg.get("tie_word_embeddings"),
        params=params,
        dtype=dtype,
        weight_bytes=params * elem,
        kv_bytes_per_token=2 * layers * kv_heads * head_dim * elem,
    )


def decode_kv_tokens_read(work: Workload) -> int:
    """Keys (= values) attention reads over all decode steps: a request's first output token comes from its
    prefill, and decode step j (j = 1 .. out-1) attends to prompt + j keys."""
    total = 0
    for prompt, out in zip(work.prompts, work.output_lens):
        steps = out - 1
        total += steps * len(prompt) + steps * (steps + 1) // 2
    return total


def _nvidia_smi() -> dict[str, str] | None:
    fields = "name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,power.limit"
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None
    return dict(zip(fields.split(","), (v.strip() for v in out.split(","))))


def _machine(device: str) -> dict[str, Any]:
    import transformers

    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    m: dict[str, Any] = dict(
        device=device,
        cpu=cpu_name(),
        cores=os.cpu_count(),
        python=platform.python_version(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        triton=triton_version,
        transformers=transformers.__version__,
    )
    if torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(device)
        m.update(
            gpu=props.name,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            sms=props.multi_processor_count,
            compute_capability=f"{props.major}.{props.minor}",
            nvidia_smi=_nvidia_smi(),
        )
    return m


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


def format_report(res: dict[str, Any]) -> str:
    """The markdown the command prints, ready for the README."""
    w, m, mi = res["workload"], res["machine"], res["model_info"]
    on_gpu = "gpu" in m
    if on_gpu:
        smi = m.get("nvidia_smi") or {}
        sm = m["compute_capability"].replace(".", "")
        driver = f", driver {smi['driver_version']}" if smi.get("driver_version") else ""
        where = f"{m['gpu']} ({m['gpu_memory_gib']} GiB, {m['sms']} SMs, sm_{sm}{driver}), CUDA {m['cuda']}"
    else:
        where = f"{m['cpu']} ({m['cores']} cores), no GPU"
    idle_name = "GPU idle" if on_gpu else "device idle"
    lines = [
        f"## Offline throughput{' on the GPU' if on_gpu else ''}: nano-vllm's workload (greedy, ignore_eos)",
        "",
        f"command: `{res['command']}`",
        f"machine: {where}; torch {m['torch']}, triton {m['triton']}, transformers {m['transformers']}, "
        f"python {m['python']}",
        f"model: {res['model_name']}: {mi['num_hidden_layers']} layers, hidden {mi['hidden_size']}, "
        f"{mi['num_attention_heads']} q / {mi['num_key_value_heads']} kv heads x {mi['head_dim']}, vocab "
        f"{mi['vocab_size']}; {mi['params'] / 1e6:.0f}M parameters, random weights, {mi['dtype']} "
        f"({mi['weight_bytes'] / 1e9:.2f} GB, {mi['kv_bytes_per_token'] / 1024:.0f} KiB of KV per token)",
        f"workload: {w['num_seqs']} requests, prompts uniform in [{w['min_input']}, {w['max_input']}] "
        f"({w['input_tokens']:,} tokens), outputs uniform in [{w['min_output']}, {w['max_output']}] "
        f"({w['output_tokens']:,} tokens), random token ids, seed {w['seed']}; decode reads "
        f"{w['decode_kv_tokens_read'] * mi['kv_bytes_per_token'] / 1e12:.2f} TB of KV",
        "",
        f"| engine | requests | output tokens | wall s | output tok/s | {idle_name} (1 - busy/wall) "
        "| host ms/step | device ms/step | steps (prefill + decode) | notes |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for key, label in (("overlap", "gapless, overlap"), ("plain", "gapless, no overlap")):
        g = res.get(key)
        if g is None:
            continue
        if "error" in g:
            lines.append(f"| {label} | | | | | | | | | FAILED: {g['error_line']} |")
            continue
        notes = (
            f"attention {g['attention_backend'] or '?'}; KV pool {g['kv_pool_tokens']:,} tokens "
            f"({g['kv_pool_gib']} GiB); {g['retractions']} retractions; decode read "
            f"{g['decode_bytes_read'] / 1e12:.1f} TB, {g['decode_read_tb_per_s']:.2f} TB/s"
        )
        if g.get("peak_gib") is not None:
            notes += f"; peak {g['peak_gib']} GiB"
        lines.append(
            f"| {label} | {g['requests']} | {g['output_tokens']:,} | {g['wall_s']:.2f} "
            f"| {g['output_tokens_per_s']:,.0f} | {_pct(g['device_idle_fraction'])} "
            f"({_pct(_sub1(g['busy_fraction_of_wall']))}) "
            f"| {_num(g['host_ms_per_step'], '.2f')} | {_num(g['device_ms_per_step'], '.2f')} "
            f"| {g['steps']} ({g['prefill_batches']} + {g['decode_batches']}) | {notes} |"
        )
    h = res.get("transformers")
    if h is not None:
        if "error" in h:
            lines.append(f"| transformers generate | | | | | | | | | FAILED: {h['error_line']} |")
        else:
            lines.append(
                f"| transformers generate | {h['requests']} (the first {h['requests']}) "
                f"| {h['output_tokens']:,} | {h['wall_s']:.2f} | {h['output_tokens_per_s']:,.0f} "
                "| n/a | n/a | n/a | n/a "
                f"| sdpa, {h['dtype']}; {h['batches']} left-padded static batch(es) of {h['batch_size']}; "
                f"{h['wasted_output_fraction']:.0%} of decoded tokens past their request's length |"
            )
    lines += [
        "",
        f"{idle_name}: the engine's bubble meter, gaps between forward jobs while requests were pending over "
        "busy + gaps; in brackets 1 - (summed job time / wall), which also counts the first launch and the "
        "last wait. host ms/step: scheduling, batch building and result processing, waits excluded.",
        "",
    ]
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
        met = (
            g["output_tokens_per_s"] >= TARGET_TOK_S
            and g["device_idle_fraction"] is not None
            and g["device_idle_fraction"] < TARGET_IDLE
        )
        lines.append(
            f"\nanchors: {ANCHORS}; target on an H100: >= {TARGET_TOK_S:,} tok/s with GPU idle < "
            f"{TARGET_IDLE:.0%} in overlap mode: {'met' if met else 'NOT met'} here "
            f"({g['output_tokens_per_s']:,.0f} tok/s, {_pct(g['device_idle_fraction'])} idle)"
        )
    for key in ("overlap", "plain"):
        g = res.get(key)
        if g is not None and "error" not in g and g["wrong_length_requests"]:
            lines.append(
                f"\nWARNING ({key}): {g['wrong_length_requests']} requests did not get their length "
                f"({g['output_tokens']} tokens generated, {g['requested_output_tokens']} requested)"
            )
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
        return _run(args, argv)
    finally:
        log.setLevel(level)


def _run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    res: dict[str, Any] = dict(
        command=shlex.join(["python", "-m", "gapless.bench.gpu", *argv]), machine=_machine(args.device)
    )
    _log(f"machine: {res['machine']}")
    _log(f"model: {args.model or 'building/loading the random ' + args.size + ' qwen3 in ' + args.dtype} ...")
    path, build_s = _model_path(args)
    info = _model_info(path, args.dtype)
    _log(f"model at {path} (built in {build_s:.1f} s): {info['params'] / 1e6:.0f}M params")
    work = random_workload(
        args.num_seqs,
        args.min_input,
        args.max_input,
        args.min_output,
        args.max_output,
        vocab_size=info["vocab_size"],
        seed=args.seed,
    )
    lo, hi = args.warmup_output
    warm = random_workload(
        args.warmup_seqs,
        args.min_input,
        args.max_input,
        lo,
        hi,
        vocab_size=info["vocab_size"],
        seed=args.seed + 1,
    )
    kv = args.kv_cache_tokens
    if kv is None:
        kv = work.input_tokens + work.output_tokens + warm.input_tokens + warm.output_tokens + 4096
    hf_work = work.head(args.hf_num_seqs)
    kv_read = decode_kv_tokens_read(work)
    res.update(
        model=str(path),
        model_name=(
            path.name
            if args.model
            else f"random-weight qwen3, size {args.size!r}"
            + (" (Qwen3-0.6B's config)" if args.size == "qwen3-0.6b" else "")
        ),
        model_info=info,
        build_s=build_s,
        workload=dict(
            **workload_summary(args, work),
            decode_kv_tokens_read=kv_read,
            warmup_requests=len(warm),
            warmup_tokens=warm.input_tokens + warm.output_tokens,
            hf_num_seqs=len(hf_work),
            hf_output_tokens=hf_work.output_tokens,
        ),
        sampling="greedy (temperature 0), ignore_eos",
        kv_cache_tokens=kv,
        engine_options=args.engine_options,
        errors=[],
    )

    def save() -> None:
        res["ratios"] = _ratios(res)
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=2, default=str) + "\n")

    # A run that fails is recorded and the next one goes on; an interrupt (SIGINT, e.g. the time limit of
    # bench/gpu_bench.sh) stops the runs, and what finished is still reported and saved.
    stop = False
    for key, overlap in RUNS.items():
        if stop or (key == "plain" and args.skip_plain):
            continue
        _log(f"gapless, overlap={overlap}: {len(work)} requests, {work.output_tokens} output tokens ...")
        leftover = _free_device(args.device)
        try:
            g = run_gapless(
                path,
                work,
                kv_cache_tokens=kv,
                options={**args.engine_options, "overlap": overlap},
                device=args.device,
                dtype=args.dtype,
                warmup=warm,
            )
            g["leftover_bytes_before"] = leftover
            g["peak_gib"] = _peak_gib(args.device)
            _gapless_derived(g, info, kv_read)
            _log(
                f"gapless, overlap={overlap}: {g['output_tokens_per_s']:.0f} tok/s in {g['wall_s']:.2f} s "
                f"(load {g['load_s']:.1f} s, warm-up {g['warmup_s']:.1f} s), "
                f"idle {_pct(g['device_idle_fraction'])}, {g['retractions']} retractions"
            )
        except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - recorded (see above)
            g = _failed(e)
            res["errors"].append(key)
            stop = g["interrupted"]
        res[key] = g
        save()

    if not args.skip_hf and not stop:
        _log(f"transformers: {len(hf_work)} requests, batches of {args.hf_batch_size} ...")
        leftover = _free_device(args.device)
        hf_warm = Workload(warm.prompts[: min(4, len(warm))], [8] * min(4, len(warm)))
        try:
            h = run_transformers(
                path, hf_work, args.hf_batch_size, device=args.device, dtype=args.dtype, warmup=hf_warm
            )
            h["leftover_bytes_before"] = leftover
            h["peak_gib"] = _peak_gib(args.device)
            _log(
                f"transformers: {h['output_tokens_per_s']:.0f} tok/s in {h['wall_s']:.2f} s "
                f"(load {h['load_s']:.1f} s)"
            )
        except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001
            h = _failed(e)
            res["errors"].append("transformers")
        res["transformers"] = h
        _free_device(args.device)
    save()
    report = format_report(res)
    res["report"] = report
    save()
    print(report, flush=True)
    _log("done" + (f"; FAILED: {', '.join(res['errors'])}" if res["errors"] else ""))
    return res


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    sys.exit(1 if main()["errors"] else 0)
