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
import gc
import os
import pstats
import sys
from typing import Any

import torch

from gapless.bench import cli
from gapless.bench.runs import run_gapless, run_transformers

# Default CPU workload: nano-vllm's shape (prompt and output lengths spread about 1:10, so requests finish
# at very different times) scaled to a quarter of its requests and a fifth of its lengths. With the
# `bench` checkpoint (8 layers, hidden 512) on the idle 2-core dev machine a run takes ~50 s in all
# (gapless ~19 s, transformers ~23 s, plus loading), ~75 s with --threads 1, and up to ~2.5 min on 2
# threads while another process keeps a core busy (see `gapless.bench.runs.OtherLoad`). nano-vllm's own
# sizes (256 seqs, lengths in [100, 1024], 144k output tokens) would take tens of minutes here.
DEFAULTS: dict[str, int] = dict(num_seqs=64, min_input=16, max_input=192, min_output=16, max_output=192)
# `--quick`: a smoke run of a few seconds.
QUICK: dict[str, int] = dict(num_seqs=8, min_input=8, max_input=32, min_output=8, max_output=32)
# Static batch size for transformers: the fastest one for it on the default workload (1 thread: batches of
# 8, 16, 32 and 64 gave 92, 89, 100 and 134 tok/s; 2 threads: 16 gave 145, 64 gave 271). On a CPU its
# per-step cost is mostly fixed (Python, weight reads), so one batch of all 64 wins despite decoding ~half
# its tokens past their request's length. The baseline should be the best a user gets from `generate`.
HF_BATCH_SIZE = 64


def _parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m gapless.bench.offline",
        description="Offline throughput of gapless vs transformers batched generate (nano-vllm workload).",
    )
    cli.add_workload_args(p, "the CPU workload", DEFAULTS, "a few-second smoke run (tiny workload)")
    m = cli.add_model_args(p, "bench", ("tiny", "overlap", "bench"), "model and machine")
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
    cli.add_engine_option_arg(
        g, "extra LLM option, repeatable (e.g. overlap=False, page_size=16, trace_path=/tmp/t.json)"
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
    cli.finish_args(p, args, DEFAULTS, QUICK)
    if args.threads < 1:
        p.error("--threads must be >= 1")
    if args.hf_batch_size < 1:
        p.error("--hf-batch-size must be >= 1")
    if args.hf_num_seqs is not None and not 1 <= args.hf_num_seqs <= args.num_seqs:
        p.error(f"--hf-num-seqs must be in [1, {args.num_seqs}]")
    return args


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
    g, h = res["gapless"], res.get("transformers")
    rows = [
        (
            "gapless",
            g["requests"],
            g["output_tokens"],
            f"{g['wall_s']:.2f}",
            f"{g['output_tokens_per_s']:.1f}",
            f"one generate call; {g['steps']} steps: {g['prefill_batches']} prefill + {g['decode_batches']} "
            f"decode batches, {g['retractions']} retractions{_meter_note(g)}",
        )
    ]
    if h is not None:
        rows.append(
            (
                "transformers",
                h["requests"],
                h["output_tokens"],
                f"{h['wall_s']:.2f}",
                f"{h['output_tokens_per_s']:.1f}",
                f"sdpa; {h['batches']} generate call(s), left-padded static batches of {h['batch_size']}; "
                f"{h['wasted_output_fraction']:.0%} of decoded tokens past their request's length",
            )
        )
    header = ("engine", "requests", "output tokens", "wall s", "output tok/s", "notes")
    lines = [
        "## Offline throughput (greedy, ignore_eos)",
        "",
        f"command: `{res['command']}`",
        cli.machine_line(res["machine"]),
        f"model: {res['model']}",
        cli.workload_line(res["workload"]),
        *([f"WARNING: {res['shared']}"] if res.get("shared") else []),
        "",
        *cli.markdown_table(header, rows, "lrrrrl"),
    ]
    if h is not None:
        lines += ["", f"**gapless / transformers: {res['ratio']:.2f}x** output tokens/s"]
    if g["output_tokens"] != g["requested_output_tokens"]:
        lines.append(
            f"\nWARNING: gapless generated {g['output_tokens']} tokens, "
            f"{g['requested_output_tokens']} requested ({g['wrong_length_requests']} requests off)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the report, return the results (the JSON's content)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parse_args(argv)
    torch.set_num_threads(args.threads)
    path, _ = cli.model_path(args)
    work = cli.workload_from_args(args, cli.model_info(path)["vocab_size"])
    res: dict[str, Any] = dict(
        command=cli.command_line("gapless.bench.offline", argv),
        machine=cli.machine(threads=args.threads),
        model=str(path),
        workload=cli.workload_summary(args, work),
        sampling="greedy (temperature 0), ignore_eos",
    )
    cli.progress(f"gapless: {len(work)} requests, {work.output_tokens} output tokens ...")
    res["gapless"] = run_gapless(
        path, work, args.threads, args.kv_cache_tokens, args.profile, args.engine_options
    )
    res["transformers"] = None
    res["ratio"] = None
    if not args.skip_hf:
        hf_work = work if args.hf_num_seqs is None else work.head(args.hf_num_seqs)
        cli.progress(f"transformers: {len(hf_work)} requests, batches of {args.hf_batch_size} ...")
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
        cli.write_json(args.json, res)
    return res


if __name__ == "__main__":
    main()
