"""Offline throughput: gapless vs `transformers` batched `generate`, same workload, same process.

    python -m gapless.bench.offline            # default CPU workload, a minute or two on 2 cores
    python -m gapless.bench.offline --quick    # a few seconds, to check that it runs

The workload is nano-vllm's offline benchmark scaled down for a CPU (see `gapless.bench.workload`):
random prompts, uniform prompt and output lengths, `ignore_eos`, fixed seed. Both sides decode
greedily, so neither pays for sampling the other skips.

gapless gets every request in one `LLM.generate` call, as vLLM-style engines are meant to be used.
transformers gets what a user would write: left-padded static batches of `--hf-batch-size` requests
in workload order, each generating to the longest output in its batch. Only each request's own
output length counts as useful output on both sides; the tokens a static batch computes past a
request's length are reported as waste, which is exactly what continuous batching saves.
"""

from __future__ import annotations

import argparse
import ast
import cProfile
import dataclasses
import gc
import json
import os
import platform
import pstats
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

from gapless.bench.workload import Workload, random_workload

# Default CPU workload: nano-vllm's shape (prompt and output lengths spread about 1:10, so requests finish
# at very different times) scaled to a quarter of its requests and a fifth of its lengths. With the
# `bench` checkpoint (8 layers, hidden 512) on the idle 2-core dev machine a run takes ~50 s in all
# (gapless ~19 s, transformers ~23 s, plus loading), ~75 s with --threads 1, and up to ~2.5 min on 2
# threads while another process keeps a core busy (see `OtherLoad`). nano-vllm's own sizes (256 seqs,
# lengths in [100, 1024], 144k output tokens) would take tens of minutes here.
DEFAULTS: dict[str, int] = dict(num_seqs=64, min_input=16, max_input=192, min_output=16, max_output=192)
# `--quick`: a smoke run of a few seconds.
QUICK: dict[str, int] = dict(num_seqs=8, min_input=8, max_input=32, min_output=8, max_output=32)
# Static batch size for transformers: the fastest one for it on the default workload (1 thread: batches of
# 8, 16, 32 and 64 gave 92, 89, 100 and 134 tok/s; 2 threads: 16 gave 145, 64 gave 271). On a CPU its
# per-step cost is mostly fixed (Python, weight reads), so one batch of all 64 wins despite decoding ~half
# its tokens past their request's length. The baseline should be the best a user gets from `generate`.
HF_BATCH_SIZE = 64


def add_workload_args(
    p: argparse.ArgumentParser, name: str, defaults: dict[str, int], quick_help: str
) -> argparse._ArgumentGroup:
    """The workload flags of the offline benchmarks (left None: `fill_workload_args` fills them in)."""
    w = p.add_argument_group(f"workload (defaults: {name}, or --quick's)")
    w.add_argument("--num-seqs", type=int, help=f"requests (default {defaults['num_seqs']})")
    w.add_argument("--min-input", type=int, help=f"shortest prompt (default {defaults['min_input']})")
    w.add_argument("--max-input", type=int, help=f"longest prompt (default {defaults['max_input']})")
    w.add_argument("--min-output", type=int, help=f"shortest output (default {defaults['min_output']})")
    w.add_argument("--max-output", type=int, help=f"longest output (default {defaults['max_output']})")
    w.add_argument("--seed", type=int, default=0, help="workload seed (default 0, as nano-vllm)")
    w.add_argument("--quick", action="store_true", help=quick_help)
    return w


def fill_workload_args(args: argparse.Namespace, sizes: dict[str, int]) -> None:
    for name, value in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def _parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m gapless.bench.offline",
        description="Offline throughput of gapless vs transformers batched generate (nano-vllm workload).",
    )
    add_workload_args(p, "the CPU workload", DEFAULTS, "a few-second smoke run (tiny workload)")
    m = p.add_argument_group("model and machine")
    m.add_argument("--model", help="HF checkpoint dir (default: the random-weight qwen3 of --size)")
    m.add_argument(
        "--size",
        default="bench",
        choices=("tiny", "overlap", "bench"),
        help="size of the built-in random qwen3 when --model is not given (default bench)",
    )
    m.add_argument(
        "--threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="torch intra-op threads, of gapless's device side and of transformers "
        "(default: all cores this process may use)",
    )
    g = p.add_argument_group("gapless")
    g.add_argument(
        "--kv-cache-tokens",
        type=int,
        help="KV pool size (default: the whole workload's prompt+output tokens, so nothing is "
        "retracted and no memory is zeroed for nothing)",
    )
    g.add_argument(
        "--profile",
        metavar="PATH",
        help="cProfile the timed gapless run into PATH (its tokens/s then pays the profiler); on a CPU "
        "this is the host side only unless --engine-option cpu_worker=inline",
    )
    g.add_argument(
        "--engine-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra LLM option, repeatable (e.g. overlap=False, page_size=16, trace_path=/tmp/t.json)",
    )
    h = p.add_argument_group("transformers")
    h.add_argument("--skip-hf", action="store_true", help="run gapless only")
    h.add_argument(
        "--hf-batch-size",
        type=int,
        default=HF_BATCH_SIZE,
        help=f"static batch size of transformers generate (default {HF_BATCH_SIZE})",
    )
    h.add_argument(
        "--hf-num-seqs",
        type=int,
        help="run transformers on the first N requests only (default all); tokens/s still compare",
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = p.parse_args(argv)
    fill_workload_args(args, QUICK if args.quick else DEFAULTS)
    try:
        args.engine_options = parse_engine_options(args.engine_option)
    except ValueError as e:
        p.error(str(e))
    if args.threads < 1:
        p.error("--threads must be >= 1")
    if args.hf_batch_size < 1:
        p.error("--hf-batch-size must be >= 1")
    if args.hf_num_seqs is not None and not 1 <= args.hf_num_seqs <= args.num_seqs:
        p.error(f"--hf-num-seqs must be in [1, {args.num_seqs}]")
    return args


def parse_engine_options(items: list[str]) -> dict[str, Any]:
    """`--engine-option KEY=VALUE` items as LLM options: VALUE as a Python literal (False, 16, 0.5, None),
    else as a bare string."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--engine-option wants KEY=VALUE, got {item!r}")
        try:
            options[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            options[key] = value  # a bare string
    return options


def _model_path(args: argparse.Namespace) -> Path:
    if args.model:
        return Path(args.model)
    from gapless.testing import cached_checkpoint

    return cached_checkpoint("qwen3", size=args.size)


def _vocab_size(path: Path) -> int:
    return int(json.loads((path / "config.json").read_text())["vocab_size"])


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return cpu


def _machine(threads: int) -> dict[str, Any]:
    """What the numbers were measured on (whether it was shared is measured per run, see `OtherLoad`)."""
    import transformers

    return dict(
        cpu=cpu_name(),
        cores=os.cpu_count(),
        usable_cores=len(os.sched_getaffinity(0)),
        threads=threads,
        torch=torch.__version__,
        transformers=transformers.__version__,
        python=platform.python_version(),
    )


def _busy_cpu_s() -> float | None:
    """CPU-seconds all processes have spent busy since boot (from /proc/stat), or None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    guest = sum(fields[8:10])  # already counted in user/nice
    return (sum(fields) - idle - guest) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    """CPU-seconds of this process and its descendants so far (the engine's device process is ours)."""
    own = time.process_time()
    try:
        tick = os.sysconf("SC_CLK_TCK")
        parents: dict[int, int] = {}
        times: dict[int, float] = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    rest = f.read().rsplit(")", 1)[1].split()  # fields after the command name
            except OSError:
                continue
            pid = int(entry.name)
            parents[pid] = int(rest[1])
            times[pid] = (int(rest[11]) + int(rest[12])) / tick  # utime + stime
    except OSError:
        return own
    mine, frontier = set(), [os.getpid()]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in mine]
        mine.update(children)
        frontier += children
    return own + sum(times[pid] for pid in mine)


class OtherLoad:
    """How many cores other processes kept busy, on average, while a timed section ran.

    The dev machine is shared, and a neighbour's work does more than steal cycles: torch's OpenMP
    threads wait at every barrier for a descheduled sibling (with one of 2 cores busy, a 16-row linear ran
    6x slower on 2 threads than on 1). Measured per side, so a ratio skewed by a neighbour shows up.
    """

    def __enter__(self) -> OtherLoad:
        self.cores: float | None = None
        self._busy, self._own, self._t = _busy_cpu_s(), _own_cpu_s(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        busy, wall = _busy_cpu_s(), time.perf_counter() - self._t
        if busy is not None and self._busy is not None and wall > 0:
            others = busy - self._busy - (_own_cpu_s() - self._own)
            self.cores = round(max(0.0, others) / wall, 2)


def _stats_delta(after: Any, before: Any) -> dict[str, Any]:
    """Numeric fields of a stats dataclass for the timed run only (the warm-up's share subtracted)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(after):
        a, b = getattr(after, f.name), getattr(before, f.name)
        if isinstance(a, (int, float)) and not isinstance(a, bool):
            out[f.name] = a - b
    return out


def _sync(device: str | torch.device) -> None:
    """Wait for the GPU's queued work (so a timer brackets it); nothing to wait for on the CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# The warm-up both engines get by default: two short prompts, four tokens each.
WARMUP = Workload([[1, 2, 3], [4, 5, 6, 7, 8]], [4, 4])


def run_gapless(
    path: Path,
    work: Workload,
    threads: int | None = None,
    kv_cache_tokens: int | None = None,
    profile: str | None = None,
    options: dict[str, Any] | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    warmup: Workload = WARMUP,
) -> dict[str, Any]:
    """One `LLM.generate` over the whole workload, greedy, each request to exactly its output length.

    `threads` goes to the engine's device side (on a CPU it runs in its own process, which does not
    inherit this process's `torch.set_num_threads`); `options` are further `LLM` options (they win over
    `device` and `dtype`). `warmup` runs first, untimed, in the same engine: on a GPU give it prompts
    as long as the workload's, so kernels are compiled and picked before the clock starts (and different
    tokens from the workload's, so the prefix cache has nothing the timed run can reuse).
    """
    from gapless import LLM, SamplingParams

    if kv_cache_tokens is None:
        kv_cache_tokens = work.input_tokens + work.output_tokens + 1024  # + warm-up and slack
    opts: dict[str, Any] = dict(
        device=device, dtype=dtype, kv_cache_tokens=kv_cache_tokens, device_threads=threads
    )
    opts.update(options or {})
    t0 = time.perf_counter()
    llm = LLM(str(path), **opts)
    load_s = time.perf_counter() - t0
    try:
        # Warm-up (not timed): first calls allocate, pick kernels and fault in the weights.
        warm = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in warmup.output_lens]
        t0 = time.perf_counter()
        llm.generate(warmup.prompts, warm, use_tqdm=False)
        warmup_s = time.perf_counter() - t0
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in work.output_lens]
        before = dataclasses.replace(llm.engine.stats)
        prof = cProfile.Profile() if profile else None
        gc.collect()
        _sync(llm.engine.info.device)
        with OtherLoad() as others:
            t0 = time.perf_counter()
            if prof is not None:
                prof.enable()
            outputs = llm.generate(work.prompts, params, use_tqdm=False)
            if prof is not None:
                prof.disable()
            _sync(llm.engine.info.device)
            wall = time.perf_counter() - t0
        stats = _stats_delta(llm.engine.stats, before)
        info = dataclasses.asdict(llm.engine.info)
        runner = llm.engine.runner  # None when the device side runs in its own process
        backend = type(getattr(runner, "backend", None)).__name__ if runner is not None else None
    finally:
        llm.shutdown()
    if prof is not None:
        prof.dump_stats(profile)
    generated = sum(len(o.token_ids) for o in outputs)
    wrong = sum(len(o.token_ids) != n for o, n in zip(outputs, work.output_lens, strict=True))
    return dict(
        engine="gapless",
        requests=len(work),
        input_tokens=work.input_tokens,
        requested_output_tokens=work.output_tokens,
        output_tokens=generated,
        wall_s=wall,
        output_tokens_per_s=generated / wall,
        load_s=load_s,
        other_cores=others.cores,
        kv_cache_tokens=kv_cache_tokens,
        kv_pool_tokens=info["kv_tokens"],
        device=info["device"],
        attention_backend=backend,
        warmup_requests=len(warmup),
        warmup_s=warmup_s,
        wrong_length_requests=wrong,
        steps=stats.get("device_jobs", 0),
        prefill_batches=stats.get("prefill_batches", 0),
        decode_batches=stats.get("decode_batches", 0),
        retractions=stats.get("retractions", 0),
        device_busy_s=stats.get("device_busy_s"),
        device_idle_s=stats.get("device_idle_s"),
        device_jobs=stats.get("device_jobs"),
        host_s=stats.get("host_s"),
        engine_options={k: v for k, v in opts.items() if k != "kv_cache_tokens"},
        stats=stats,
    )


def hf_generate(model: Any, prompts: list[list[int]], max_new: int, pad: int) -> torch.Tensor:
    """One left-padded greedy `generate` that runs every row to `max_new` tokens; returns them, [B, max_new]
    (on the model's device).

    `eos_token_id=None` overrides the checkpoint's EOS so no row stops early (`ignore_eos`, as gapless
    runs); the length check makes sure transformers really did, or the tokens/s would be a lie.
    """
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p) :] = torch.tensor(p)
        mask[i, longest - len(p) :] = 1
    out = model.generate(
        input_ids=ids.to(model.device),
        attention_mask=mask.to(model.device),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=pad,
        temperature=None,
        top_p=None,
        top_k=None,
    )
    if out.shape[1] != longest + max_new:
        raise RuntimeError(f"transformers generated {out.shape[1] - longest} tokens, asked for {max_new}")
    return out[:, longest:]


def run_transformers(
    path: Path,
    work: Workload,
    batch_size: int,
    device: str = "cpu",
    dtype: str | torch.dtype = torch.float32,
    warmup: Workload = WARMUP,
) -> dict[str, Any]:
    """transformers `generate` as a user batches it: left-padded static batches in workload order, greedy,
    EOS disabled so every batch runs to its longest requested output. sdpa attention, the model in `dtype`
    on `device` (on CUDA the timer brackets a `synchronize`). `warmup`'s prompts run first, untimed, as
    one batch to its longest output."""
    from transformers import AutoModelForCausalLM

    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa")
    model.to(device).eval()
    load_s = time.perf_counter() - t0
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    with torch.inference_mode():
        hf_generate(model, warmup.prompts, max(warmup.output_lens), pad)  # warm-up, not timed
        computed = 0
        gc.collect()
        _sync(device)
        with OtherLoad() as others:
            t0 = time.perf_counter()
            for start in range(0, len(work), batch_size):
                lens = work.output_lens[start : start + batch_size]
                hf_generate(model, work.prompts[start : start + batch_size], max(lens), pad)
                computed += len(lens) * max(lens)
            _sync(device)
            wall = time.perf_counter() - t0
    del model
    useful = work.output_tokens
    return dict(
        engine="transformers",
        requests=len(work),
        input_tokens=work.input_tokens,
        requested_output_tokens=useful,
        output_tokens=useful,
        wall_s=wall,
        output_tokens_per_s=useful / wall,
        load_s=load_s,
        other_cores=others.cores,
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        batch_size=min(batch_size, len(work)),
        batches=-(-len(work) // batch_size),
        computed_output_tokens=computed,
        wasted_output_fraction=1 - useful / computed,
    )


def _shared_warning(res: dict[str, Any]) -> str | None:
    """Say so when other processes used a noticeable share of the cores during either timed run."""
    sides = [(name, res[name]["other_cores"]) for name in ("gapless", "transformers") if res.get(name)]
    busy = [(name, c) for name, c in sides if c is not None and c > 0.2]
    if not busy:
        return None
    m = res["machine"]
    hint = " (multi-threaded kernels suffer most; try --threads 1)" if m["threads"] > 1 else ""
    used = ", ".join(f"{c:.1f} during {name}" for name, c in busy)
    return (
        f"other processes kept cores busy (on average {used}, of {m['usable_cores']}): the machine was "
        f"shared, so timings are noisy{hint}"
    )


def _meter_note(g: dict[str, Any]) -> str:
    """Where gapless's wall time went, from the engine's bubble meter."""
    busy, idle, host = g.get("device_busy_s"), g.get("device_idle_s"), g.get("host_s")
    if busy is None or idle is None or host is None or not g["steps"]:
        return ""
    return (
        f"; device busy {busy:.1f} s ({1e3 * busy / g['steps']:.0f} ms/step), idle between jobs "
        f"{idle:.1f} s, host {host:.1f} s ({1e3 * host / g['steps']:.1f} ms/step)"
    )


def format_report(res: dict[str, Any]) -> str:
    """The markdown table the command prints (and what a PR description can paste)."""
    w, m = res["workload"], res["machine"]
    lines = [
        "## Offline throughput (greedy, ignore_eos)",
        "",
        f"command: `{res['command']}`",
        f"machine: {m['cpu']}, {m['usable_cores']} usable cores of {m['cores']}, torch {m['torch']} "
        f"({m['threads']} threads), transformers {m['transformers']}",
        f"model: {res['model']}",
        f"workload: {w['num_seqs']} requests, prompts uniform in [{w['min_input']}, {w['max_input']}] "
        f"({w['input_tokens']} tokens), outputs uniform in [{w['min_output']}, {w['max_output']}] "
        f"({w['output_tokens']} tokens), random token ids, seed {w['seed']}",
        *([f"WARNING: {res['shared']}"] if res.get("shared") else []),
        "",
        "| engine | requests | output tokens | wall s | output tok/s | notes |",
        "|---|---:|---:|---:|---:|---|",
    ]
    g = res["gapless"]
    lines.append(
        f"| gapless | {g['requests']} | {g['output_tokens']} | {g['wall_s']:.2f} "
        f"| {g['output_tokens_per_s']:.1f} | one generate call; {g['steps']} steps: {g['prefill_batches']} "
        f"prefill + {g['decode_batches']} decode batches, {g['retractions']} retractions{_meter_note(g)} |"
    )
    h = res.get("transformers")
    if h is not None:
        lines.append(
            f"| transformers | {h['requests']} | {h['output_tokens']} | {h['wall_s']:.2f} "
            f"| {h['output_tokens_per_s']:.1f} | sdpa; {h['batches']} generate call(s), left-padded static "
            f"batches of {h['batch_size']}; {h['wasted_output_fraction']:.0%} of decoded tokens past their "
            "request's length |"
        )
        lines += ["", f"**gapless / transformers: {res['ratio']:.2f}x** output tokens/s"]
    if g["output_tokens"] != g["requested_output_tokens"]:
        lines.append(
            f"\nWARNING: gapless generated {g['output_tokens']} tokens, "
            f"{g['requested_output_tokens']} requested ({g['wrong_length_requests']} requests off)"
        )
    return "\n".join(lines)


def workload_summary(args: argparse.Namespace, work: Workload) -> dict[str, Any]:
    """The workload's parameters (from `args`) and its token counts, for the JSON."""
    return dict(
        num_seqs=len(work),
        min_input=args.min_input,
        max_input=args.max_input,
        min_output=args.min_output,
        max_output=args.max_output,
        seed=args.seed,
        input_tokens=work.input_tokens,
        output_tokens=work.output_tokens,
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the report, return the results (the JSON's content)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parse_args(argv)
    torch.set_num_threads(args.threads)
    path = _model_path(args)
    work = random_workload(
        args.num_seqs,
        args.min_input,
        args.max_input,
        args.min_output,
        args.max_output,
        vocab_size=_vocab_size(path),
        seed=args.seed,
    )
    res: dict[str, Any] = dict(
        command=shlex.join(["python", "-m", "gapless.bench.offline", *argv]),
        machine=_machine(args.threads),
        model=str(path),
        workload=workload_summary(args, work),
        sampling="greedy (temperature 0), ignore_eos",
    )
    print(
        f"gapless: {len(work)} requests, {work.output_tokens} output tokens ...", file=sys.stderr, flush=True
    )
    res["gapless"] = run_gapless(
        path, work, args.threads, args.kv_cache_tokens, args.profile, args.engine_options
    )
    res["transformers"] = None
    res["ratio"] = None
    if not args.skip_hf:
        hf_work = work if args.hf_num_seqs is None else work.head(args.hf_num_seqs)
        print(
            f"transformers: {len(hf_work)} requests, batches of {args.hf_batch_size} ...",
            file=sys.stderr,
            flush=True,
        )
        gc.collect()
        res["transformers"] = run_transformers(path, hf_work, args.hf_batch_size)
        res["ratio"] = res["gapless"]["output_tokens_per_s"] / res["transformers"]["output_tokens_per_s"]
    res["shared"] = _shared_warning(res)
    report = format_report(res)
    print(report)
    if args.profile:
        print(f"\ngapless profile written to {args.profile} (tokens/s above includes profiler overhead)")
        pstats.Stats(args.profile).sort_stats("cumulative").print_stats(25)
    res["report"] = report
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return res


if __name__ == "__main__":
    main()
