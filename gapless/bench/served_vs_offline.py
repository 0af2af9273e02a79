"""Served vs offline throughput of the same model and workload on one machine, and the ratio:
`python -m gapless.bench.served_vs_offline`.

    python -m gapless.bench.served_vs_offline --quick                     # seconds: does it run
    python -m gapless.bench.served_vs_offline --rounds 2 --json out.json  # the CPU log's command
    python -m gapless.bench.served_vs_offline --model PATH --device cuda --dtype bfloat16 \\
        --num-seqs 512 --min-input 100 --max-input 1024 --min-output 100 --max-output 1024

Offline is one `LLM.generate` over the workload (`gapless.bench.runs.run_gapless`: greedy, every request
to exactly its length, a warm-up first). Served is `gapless serve` started on the same checkpoint with the
same engine settings (device, dtype, KV pool size), warmed up with the same warm-up requests, then sent
the whole workload at once by the serving benchmark's client (`gapless.bench.serving`: streamed
/v1/completions with token-id prompts, `ignore_eos`, temperature 0, tokens counted from `usage`). Both
throughputs are output tokens over the wall time of the run, so the ratio is what serving costs.

Each process layout in `--layouts` (`gapless.server.layout`) is served in turn, with each count of API
server processes in `--api-server-counts` (the server's `--api-server-count`; a mode `split x2 API` when
more than one), and with several
`--max-concurrency` values each is run at each (`0` = everything at once, the only one the ratio to
offline is taken at); `--rounds` repeats the lot, alternating, so the machine's drift hits every mode
alike. Besides tokens/s each served run reports what its hops sent (`/debug/state`'s `hop_*` counters):
messages per hop and request updates per message; and every run, offline too, the scheduler's host ms per
decode step, the device's idle share and the cycle collector's pauses, from the counters around the run
(`meter_figures`), and each server process's CPU per output token and share of a core over the run
(`process_cpu_s`): a process near a whole core is what the others wait on. With several API servers,
the API's collector pauses are those of the one that answered `/debug/state`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import httpx
import torch

from gapless.bench import cli, serving
from gapless.bench.runs import WARMUP, run_gapless
from gapless.bench.workload import Workload

# Default CPU workload: a model small enough that the host's share (the server's included) is visible
# (random-weight Qwen3 of size `overlap`: hidden 128, 2 layers), 64 requests all at once.
DEFAULTS: dict[str, int] = dict(num_seqs=64, min_input=16, max_input=128, min_output=16, max_output=128)
QUICK: dict[str, int] = dict(num_seqs=8, min_input=8, max_input=16, min_output=8, max_output=16)


def _parse_args(argv: list[str]) -> argparse.Namespace:
    what = "Served vs offline output tokens/s of one workload on one machine, and their ratio."
    p = argparse.ArgumentParser(prog="python -m gapless.bench.served_vs_offline", description=what)
    m = cli.add_model_args(p, "overlap", ("tiny", "overlap", "bench"), "model and machine")
    cli.add_workload_args(p, "the CPU workload", DEFAULTS, "a few-second smoke run (tiny workload)")
    m.add_argument("--device", default="cpu", help="for both (default cpu)")
    m.add_argument("--dtype", default="float32", help="for both (default float32)")
    m.add_argument(
        "--threads",
        type=cli.positive_int,
        default=1,
        help="the engine's torch threads, offline and in the server's scheduler (default 1: a shared "
        "CPU's other processes stall OpenMP's spinning threads)",
    )
    s = p.add_argument_group("serving")
    s.add_argument(
        "--layouts",
        default="split,merged",
        help="process layouts to serve with, in turn (default split,merged)",
    )
    s.add_argument(
        "--api-server-counts",
        default="1",
        help="the server's --api-server-count, comma-separated: each is served with each layout (default 1)",
    )
    s.add_argument(
        "--stream-interval",
        type=cli.positive_int,
        default=1,
        help="the server's --stream-interval: a request's tokens go out N at a time (default 1)",
    )
    s.add_argument(
        "--max-concurrency",
        default="0",
        help="requests in flight, comma-separated; 0: all at once (default 0)",
    )
    s.add_argument("--skip-offline", action="store_true", help="serve only (no ratio to offline)")
    p.add_argument("--rounds", type=cli.positive_int, default=1, help="repeat every mode (default 1)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = p.parse_args(argv)
    args.engine_option = []
    cli.finish_args(p, args, DEFAULTS, QUICK)
    args.layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    if not set(args.layouts) <= {"split", "merged", "auto"} or not args.layouts:
        p.error(f"--layouts takes split, merged, auto; got {args.layouts}")
    for flag, text in (
        ("--max-concurrency", args.max_concurrency),
        ("--api-server-counts", args.api_server_counts),
    ):
        if not all(x.strip().lstrip("-").isdigit() for x in text.split(",")):
            p.error(f"{flag} takes whole numbers, comma-separated; got {text!r}")
    args.concurrency = [int(x) for x in args.max_concurrency.split(",")]
    args.api_servers = [int(x) for x in args.api_server_counts.split(",")]
    if any(c < 0 for c in args.concurrency):
        p.error("--max-concurrency values must be >= 0")
    if any(c < 1 for c in args.api_servers):
        p.error("--api-server-counts values must be >= 1")
    return args


def served_mode(layout: str, api_servers: int) -> str:
    """A served run's mode: its layout, and its count of API server processes when more than one."""
    return layout if api_servers == 1 else f"{layout} x{api_servers} API"


async def _drive(url: str, work: Workload, concurrency: int) -> dict[str, Any]:
    """Send the workload to the server at `url` (all at once, at most `concurrency` in flight if > 0);
    the serving benchmark's summary."""
    argv = ["--base-url", url, "--disable-tqdm"] + (
        ["--max-concurrency", str(concurrency)] * (concurrency > 0)
    )
    args = serving.parse_args(argv)
    async with serving.make_client(args, len(work)) as client:
        model = await serving.first_model(client)
        records, duration = await serving.run_benchmark(args, client, model, work, [0.0] * len(work))
    return serving.summarize(records, duration)


def _state(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/debug/state", timeout=30, trust_env=False).json()


def _hops(state: dict[str, Any]) -> dict[str, int]:
    return {k: v for k, v in state.items() if k.startswith("hop_")}


METER_COUNTERS = (
    "decode_host_s",
    "decode_steps",
    "device_busy_s",
    "device_idle_s",
    "gc_pause_s",
    "api_gc_pause_s",
)


def meter_figures(counters: dict[str, Any]) -> dict[str, float | None]:
    """The scheduler's host ms per decode step, the device's idle share (gaps between jobs while
    requests were pending) and the time the cycle collector stopped the scheduler's process and the API
    server (`gapless.engine.heap`), from the counters over a run (`METER_COUNTERS`; None where the run had
    none: offline has no API server). Served and offline side by side, they say whether serving slows the
    host's step (and so leaves the device waiting) or only the hops after it."""
    steps = counters.get("decode_steps", 0)
    busy, idle = counters.get("device_busy_s", 0.0), counters.get("device_idle_s", 0.0)
    return dict(
        host_ms_per_decode_step=1e3 * counters.get("decode_host_s", 0.0) / steps if steps else None,
        device_idle=idle / (busy + idle) if busy + idle > 0 else None,
        gc_pause_s=counters.get("gc_pause_s"),
        api_gc_pause_s=counters.get("api_gc_pause_s"),
    )


def process_cpu_s(api_pid: int, state: dict[str, Any]) -> dict[str, float]:
    """CPU seconds (user + system) each server process has used: the API server's own, and each worker's
    (`/debug/state`'s `worker_pids`) with its children's (a scheduler's device process or ranks). Linux
    only (`/proc`); empty elsewhere."""
    if not Path("/proc/self/stat").exists():
        return {}
    tick = os.sysconf("SC_CLK_TCK")

    def own(pid: int) -> float:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            return 0.0
        return (int(fields[11]) + int(fields[12])) / tick  # utime, stime: fields 14 and 15 of stat

    def tree(pid: int) -> float:
        children = []
        for task in Path(f"/proc/{pid}/task").glob("*/children"):
            try:
                children += [int(c) for c in task.read_text().split()]
            except OSError:
                pass
        return own(pid) + sum(tree(c) for c in children)

    return {"api": own(api_pid), **{name: tree(pid) for name, pid in state.get("worker_pids", {}).items()}}


def run_served(
    path: Path, work: Workload, layout: str, concurrency: list[int], engine: list[str]
) -> list[dict[str, Any]]:
    """Serve `path` in `layout` with the `engine` flags, warm it up, run `work` at each concurrency; one
    result per run."""
    from gapless.testing.server import ServerProcess

    flags = [*engine, "--log-stats-interval", "0"]
    srv = ServerProcess(str(path), *flags, "--process-layout", layout, startup_timeout=600)
    out = []
    try:
        url = srv.url
        assert url is not None, "a ServerProcess that started has its URL"
        asyncio.run(_drive(url, WARMUP, 0))
        for c in concurrency:
            state = _state(url)
            before, cpu_before = _hops(state), process_cpu_s(srv.proc.pid, state)
            meter_before = {k: state.get(k, 0) for k in METER_COUNTERS}
            summary = asyncio.run(_drive(url, work, c))
            if summary["failed"] or summary["wrong_length_requests"]:
                raise RuntimeError(f"served run failed: {json.dumps(summary['errors'])}\n{srv.output}")
            state = _state(url)
            hops = {k: v - before.get(k, 0) for k, v in _hops(state).items()}
            cpu = {k: v - cpu_before.get(k, 0.0) for k, v in process_cpu_s(srv.proc.pid, state).items()}
            meter = meter_figures({k: state.get(k, 0) - meter_before[k] for k in METER_COUNTERS})
            out.append(
                dict(
                    layout=layout,
                    concurrency=c,
                    output_tokens=summary["output_tokens"],
                    wall_s=summary["duration_s"],
                    output_tokens_per_s=summary["output_throughput"],
                    ttft_p50_ms=summary["ttft_ms"]["p50"],
                    tpot_p50_ms=summary["tpot_ms"]["p50"],
                    hops=hops,
                    **meter,
                    cpu_us_per_token={k: v * 1e6 / summary["output_tokens"] for k, v in cpu.items()},
                    cores_busy={k: v / summary["duration_s"] for k, v in cpu.items()},
                )
            )
    finally:
        srv.stop()
    return out


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per mode (offline; each layout at each concurrency): median tokens/s over the rounds, the ratio to
    offline (at concurrency 0) and to the first layout at the same concurrency, each the median of the
    rounds' ratios (each round's modes ran back to back)."""
    rounds = sorted({r["round"] for r in runs})
    modes = list(dict.fromkeys((r["mode"], r.get("concurrency")) for r in runs))
    first_layout = next((m for m, _ in modes if m != "offline"), None)

    def rate(mode: str, c: int | None, k: int) -> float | None:
        hit = [r for r in runs if r["round"] == k and r["mode"] == mode and r.get("concurrency") == c]
        return hit[0]["output_tokens_per_s"] if hit else None

    rows = []
    for mode, c in modes:
        tok_s = [x for k in rounds if (x := rate(mode, c, k)) is not None]
        row: dict[str, Any] = dict(mode=mode, concurrency=c, output_tokens_per_s=_median(tok_s))
        for figure in ("host_ms_per_decode_step", "device_idle", "gc_pause_s", "api_gc_pause_s"):
            values = [r.get(figure) for r in runs if r["mode"] == mode and r.get("concurrency") == c]
            row[figure] = _median([v for v in values if v is not None])
        if mode != "offline" and first_layout is not None:  # (there is a layout when a mode is not offline)
            off = [x / o for k in rounds if (x := rate(mode, c, k)) and (o := rate("offline", None, k))]
            row["served_over_offline"] = _median(off) if c == 0 else None
            base = [x / b for k in rounds if (x := rate(mode, c, k)) and (b := rate(first_layout, c, k))]
            row[f"over_{first_layout}"] = _median(base)
            hops = [r["hops"] for r in runs if r["mode"] == mode and r.get("concurrency") == c]
            msgs, updates = (
                hops[-1].get("hop_scheduler_updates_out", 0),
                hops[-1].get("hop_scheduler_request_updates", 0),
            )
            row["request_updates_per_message"] = updates / msgs if msgs else None
            for figure in ("cpu_us_per_token", "cores_busy"):  # per process: the median of the rounds
                per_run = [r.get(figure, {}) for r in runs if r["mode"] == mode and r.get("concurrency") == c]
                row[figure] = {
                    name: _median([p[name] for p in per_run if name in p])
                    for name in dict.fromkeys(k for p in per_run for k in p)
                }
        rows.append(row)
    return rows


def format_report(rows: list[dict[str, Any]], first_layout: str) -> str:
    def num(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    header = (
        "mode",
        "max concurrency",
        "output tok/s",
        "served/offline",
        f"/{first_layout}",
        "updates/message",
        "host ms/decode step",
        "device idle",
        "GC pause s: scheduler",
        "API",
    )
    table = [
        (
            r["mode"],
            "-" if r["concurrency"] is None else (r["concurrency"] or "all"),
            num(r["output_tokens_per_s"], ",.1f"),
            num(r.get("served_over_offline"), ".3f"),
            num(r.get(f"over_{first_layout}"), ".3f"),
            num(r.get("request_updates_per_message"), ".1f"),
            num(r.get("host_ms_per_decode_step"), ".3f"),
            num(r.get("device_idle"), ".1%"),
            num(r.get("gc_pause_s"), ".3f"),
            num(r.get("api_gc_pause_s"), ".3f"),
        )
        for r in rows
    ]
    lines = cli.markdown_table(header, table, "llrrrrrrrr")
    titles = {
        "cpu_us_per_token": (
            "CPU µs per output token, by process (the scheduler's includes the model on a CPU):",
            ".1f",
        ),
        # a process near 1.00 kept its core busy all run: what the others wait on, where the machine has
        # a core per process (the GPU machine; on 2 cores they share them)
        "cores_busy": ("Cores kept busy over the run, by process (CPU seconds / wall seconds):", ".2f"),
    }
    for figure, (title, fmt) in titles.items():
        served = [r for r in rows if r.get(figure)]
        names = list(dict.fromkeys(k for r in served for k in r[figure]))
        if names:
            lines += ["", title]
            lines += cli.markdown_table(
                ("mode", "max concurrency", *names),
                [
                    (r["mode"], r["concurrency"] or "all", *(num(r[figure].get(n), fmt) for n in names))
                    for r in served
                ],
                "ll" + "r" * len(names),
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parse_args(argv)
    path, _ = cli.model_path(args, args.dtype)
    vocab = cli.model_info(path, args.dtype)["vocab_size"]
    work = cli.workload_from_args(args, vocab)
    kv = work.input_tokens + work.output_tokens + 1024  # as run_gapless sizes it: nothing is retracted
    cli.progress(cli.workload_line(cli.workload_summary(args, work)))
    runs: list[dict[str, Any]] = []
    options = dict(device=args.device, dtype=args.dtype, kv_cache_tokens=kv)  # the same, as flags:
    engine = [f"--{k.replace('_', '-')}={v}" for k, v in options.items()] + [
        f"--device-threads={args.threads}"
    ]
    torch.set_num_threads(args.threads)
    for k in range(args.rounds):
        if not args.skip_offline:
            cli.progress(f"round {k + 1}: offline")
            g = run_gapless(
                path, work, options=dict(device=args.device, dtype=args.dtype, kv_cache_tokens=kv)
            )
            runs.append(
                dict(
                    round=k,
                    mode="offline",
                    output_tokens_per_s=g["output_tokens_per_s"],
                    wall_s=g["wall_s"],
                    **meter_figures(g["meter"]),
                )
            )
        for layout in args.layouts:
            for apis in args.api_servers:
                mode = served_mode(layout, apis)
                cli.progress(f"round {k + 1}: served, {mode}")
                served = [*engine, f"--stream-interval={args.stream_interval}", f"--api-server-count={apis}"]
                for r in run_served(path, work, layout, args.concurrency, served):
                    runs.append(dict(r, round=k, mode=mode))
    rows = summarize(runs)
    report = format_report(rows, served_mode(args.layouts[0], args.api_servers[0]))
    print(cli.machine_line(cli.machine(args.device, args.threads)))
    print(cli.workload_line(cli.workload_summary(args, work)))
    print(report)
    res = dict(
        command=cli.command_line("gapless.bench.served_vs_offline", argv),
        machine=cli.machine(args.device, args.threads),
        workload=cli.workload_summary(args, work),
        model=str(path),
        runs=runs,
        summary=rows,
        report=report,
    )
    if args.json:
        cli.write_json(args.json, res)
    return res


if __name__ == "__main__":
    main()
