"""Latency of one request at a time and of a few: TTFT and TPOT at each concurrency, offline and served.

    python -m gapless.bench.latency                       # Qwen3-0.6B's shape, bf16, on the GPU
    python -m gapless.bench.latency --concurrency 1 4 16 --prompt-len 512 --output-len 128 --json out.json
    python -m gapless.bench.latency --size tiny --device cpu --dtype float32 --prompt-len 16 --output-len 8

A chat user sends one request and waits for it: what they feel is the time to the first token (TTFT, a
`--prompt-len`-token prompt, default 512) and the time per output token after it (TPOT). At each
`--concurrency` c (default 1, 4 and 16) a closed loop keeps c requests in flight (a finished one is
replaced at once) until `--requests` times c of them finished (at least `--min-requests`), each a
distinct prompt of random token ids (the prefix cache gives none of them anything) generating exactly
`--output-len` tokens (`ignore_eos`), greedy unless `--temperature` says otherwise.

Offline, one `LLM` engine steps the loop itself (`Engine.add_request` / `step`): a request's first token
counts when the step that made it returns to the host, its last when the step that finished it does.
Served, `python -m gapless serve` with the same options is driven by the serving benchmark's streaming
client (`gapless.bench.serving`) at `--max-concurrency` c: the times a client sees. TTFT counts from the
request's arrival (its `add_request`, or its HTTP send) and TPOT is (last - first) / (tokens - 1). Both
engines get an untimed warm-up of the same shape first. The report gives p50 and p90 of each, and the
output tokens/s of the whole run.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from pathlib import Path
from typing import Any

from gapless.bench import cli
from gapless.bench.workload import Workload, random_workload

CONCURRENCY = (1, 4, 16)
PROMPT_LEN = 512
OUTPUT_LEN = 128
# the TPOT targets at concurrency 1 (Qwen3-0.6B's shape, bf16, an H100/H200)
TARGET_TPOT_MS = {"offline": 1.2, "served": 1.5}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    import torch

    p = argparse.ArgumentParser(prog="python -m gapless.bench.latency", description=__doc__.split("\n")[0])
    m = cli.add_model_args(p, "qwen3-0.6b", ("tiny", "overlap", "bench", "qwen3-0.6b"))
    m.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    m.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    w = p.add_argument_group("workload")
    w.add_argument("--concurrency", type=cli.positive_int, nargs="+", default=list(CONCURRENCY))
    w.add_argument("--prompt-len", type=cli.positive_int, default=PROMPT_LEN)
    w.add_argument("--output-len", type=cli.positive_int, default=OUTPUT_LEN, help="at least 2 (for TPOT)")
    w.add_argument(
        "--requests", type=cli.positive_int, default=2, help="requests a level runs, per request in flight"
    )
    w.add_argument("--min-requests", type=cli.positive_int, default=8, help="requests a level runs at least")
    w.add_argument("--temperature", type=float, default=0.0)
    w.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("engines")
    cli.add_engine_option_arg(g, "extra LLM option, repeatable; the server gets it as --KEY=VALUE")
    g.add_argument("--skip-offline", action="store_true")
    g.add_argument("--skip-served", action="store_true")
    g.add_argument(
        "--startup-timeout", type=float, default=600.0, help="seconds the server may take to start"
    )
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    args = p.parse_args(argv)
    cli.take_engine_options(p, args)
    if args.output_len < 2:
        p.error("--output-len must be >= 2: TPOT needs a token after the first")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device} but CUDA is not available")
    return args


def level_workload(args: argparse.Namespace, concurrency: int, vocab: int, seed: int) -> Workload:
    """The requests one concurrency level runs: distinct random prompts of `--prompt-len` tokens."""
    n = max(args.requests * concurrency, args.min_requests)
    lens = (args.prompt_len, args.prompt_len, args.output_len, args.output_len)
    return random_workload(n, *lens, vocab_size=vocab, seed=seed)


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50 and p90 (nearest rank) of `values`, and their mean; None when there are none."""
    if not values:
        return dict(mean=None, p50=None, p90=None)
    s = sorted(values)

    def rank(q: float) -> float:
        return s[min(len(s) - 1, max(0, round(q * len(s) + 0.5) - 1))]

    return dict(mean=sum(s) / len(s), p50=rank(0.5), p90=rank(0.9))


def level_result(
    mode: str, concurrency: int, ttft_s: list[float], tpot_s: list[float], tokens: int, wall_s: float
) -> dict[str, Any]:
    """One row: a mode at a concurrency, its TTFT and TPOT in ms, output tokens/s over the level."""
    ms = lambda xs: [1e3 * x for x in xs]  # noqa: E731
    return dict(
        mode=mode,
        concurrency=concurrency,
        requests=len(ttft_s),
        output_tokens=tokens,
        wall_s=wall_s,
        output_tokens_per_s=tokens / wall_s if wall_s > 0 else None,
        ttft_ms=percentiles(ms(ttft_s)),
        tpot_ms=percentiles(ms(tpot_s)),
    )


def closed_loop(engine: Any, work: Workload, concurrency: int, params: Any) -> dict[str, Any]:
    """Run `work` (every request `params`' length) on `engine`, keeping `concurrency` requests in flight:
    each request's TTFT and TPOT (host clock, when the step that made the token returned), the tokens and
    the wall time."""
    pending = list(range(len(work)))
    live: dict[int, tuple[Any, float]] = {}  # request index -> (Req, arrival)
    first: dict[int, float] = {}
    ttft, tpot, tokens = [], [], 0
    t0 = time.perf_counter()
    while pending or live:
        while pending and len(live) < concurrency:
            i = pending.pop(0)
            live[i] = (engine.add_request(work.prompts[i], params), time.perf_counter())
        engine.step()
        now = time.perf_counter()
        for i, (req, arrival) in list(live.items()):
            if i not in first and req.output_ids:
                first[i] = now
                ttft.append(now - arrival)
            if req.finished:
                n = len(req.output_ids)
                tokens += n
                if n > 1:
                    tpot.append((now - first[i]) / (n - 1))
                del live[i]
    return dict(ttft_s=ttft, tpot_s=tpot, tokens=tokens, wall_s=time.perf_counter() - t0)


def run_offline(args: argparse.Namespace, path: Path, vocab: int) -> list[dict[str, Any]]:
    """Each concurrency level on one `LLM` engine, after a warm-up at the largest one."""
    from gapless import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.output_len, temperature=args.temperature, ignore_eos=True)
    opts = dict(device=args.device, dtype=args.dtype, **args.engine_options)
    rows = []
    with LLM(str(path), **opts) as llm:
        top = max(args.concurrency)
        closed_loop(llm.engine, level_workload(args, top, vocab, args.seed + 1000), top, params)  # warm-up
        for k, c in enumerate(args.concurrency):
            work = level_workload(args, c, vocab, args.seed + k)
            r = closed_loop(llm.engine, work, c, params)
            rows.append(level_result("offline", c, r["ttft_s"], r["tpot_s"], r["tokens"], r["wall_s"]))
            cli.progress(_progress_line(rows[-1]))
    return rows


async def _drive(url: str, work: Workload, concurrency: int, temperature: float) -> dict[str, Any]:
    """The serving benchmark's client: `work` at most `concurrency` in flight; its summary."""
    from gapless.bench import serving

    argv = ["--base-url", url, "--disable-tqdm", "--max-concurrency", str(concurrency)]
    sargs = serving.parse_args([*argv, "--temperature", str(temperature)])
    async with serving.make_client(sargs, len(work)) as client:
        model = await serving.first_model(client)
        records, duration = await serving.run_benchmark(sargs, client, model, work, [0.0] * len(work))
    ok = [r for r in records if r.success]
    if len(ok) < len(records) or any(r.output_tokens != r.max_tokens for r in ok):
        errors = sorted({r.error or "wrong length" for r in records if not r.success or r in ok})
        raise RuntimeError(f"served level c={concurrency} failed: {errors[:3]}")
    ttft = [r.ttft_s for r in ok]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    return dict(ttft_s=ttft, tpot_s=tpot, tokens=sum(r.output_tokens for r in ok), wall_s=duration)


def run_served(args: argparse.Namespace, path: Path, vocab: int) -> list[dict[str, Any]]:
    """Each concurrency level through `python -m gapless serve` with the same options."""
    from gapless.testing.server import ServerProcess

    options = dict(device=args.device, dtype=args.dtype, **args.engine_options)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in options.items()]
    srv = ServerProcess(str(path), *flags, "--log-stats-interval", "0", startup_timeout=args.startup_timeout)
    rows = []
    try:
        top = max(args.concurrency)
        warm = level_workload(args, top, vocab, args.seed + 1000)
        asyncio.run(_drive(srv.url or "", warm, top, args.temperature))
        for k, c in enumerate(args.concurrency):
            work = level_workload(args, c, vocab, args.seed + k)
            r = asyncio.run(_drive(srv.url or "", work, c, args.temperature))
            rows.append(level_result("served", c, r["ttft_s"], r["tpot_s"], r["tokens"], r["wall_s"]))
            cli.progress(_progress_line(rows[-1]))
    finally:
        srv.stop()
    return rows


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x:,.2f}"


def _progress_line(r: dict[str, Any]) -> str:
    return (
        f"{r['mode']} c={r['concurrency']}: TTFT p50 {_ms(r['ttft_ms']['p50'])} ms, "
        f"TPOT p50 {_ms(r['tpot_ms']['p50'])} ms, {r['output_tokens_per_s']:,.0f} tok/s"
    )


def format_report(res: dict[str, Any]) -> str:
    header = ("mode", "concurrency", "requests", "TTFT p50 ms", "TTFT p90 ms", "TPOT p50 ms", "TPOT p90 ms")
    rows = [
        (
            r["mode"],
            r["concurrency"],
            r["requests"],
            _ms(r["ttft_ms"]["p50"]),
            _ms(r["ttft_ms"]["p90"]),
            _ms(r["tpot_ms"]["p50"]),
            _ms(r["tpot_ms"]["p90"]),
        )
        for r in res["rows"]
    ]
    w = res["workload"]
    lines = [
        f"## Latency: {w['prompt_len']}-token prompts, {w['output_len']} output tokens, "
        f"temperature {w['temperature']}",
        "",
        f"command: `{res['command']}`",
        cli.machine_line(res["machine"]),
        "",
        *cli.markdown_table(header, rows, "lrrrrrr"),
    ]
    for r in res["rows"]:
        target = TARGET_TPOT_MS.get(r["mode"])
        if r["concurrency"] == 1 and target is not None and r["tpot_ms"]["p50"] is not None:
            met = "met" if r["tpot_ms"]["p50"] <= target else "NOT met"
            lines.append(
                f"\nTPOT at concurrency 1, {r['mode']}: target <= {target} ms (H100/H200), {met} here"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    path, _ = cli.model_path(args, args.dtype)
    vocab = cli.model_info(path, args.dtype)["vocab_size"]
    res: dict[str, Any] = dict(
        command=cli.command_line("gapless.bench.latency", argv),
        machine=cli.machine(args.device),
        model=str(path),
        workload=dict(
            prompt_len=args.prompt_len,
            output_len=args.output_len,
            temperature=args.temperature,
            concurrency=args.concurrency,
        ),
        engine_options=args.engine_options,
        rows=[],
        errors=[],
    )
    for mode, run, skip in (
        ("offline", run_offline, args.skip_offline),
        ("served", run_served, args.skip_served),
    ):
        if skip:
            continue
        try:
            res["rows"] += run(args, path, vocab)
        except Exception as e:  # noqa: BLE001 - recorded; the other mode still runs
            logging.getLogger("gapless").exception("latency: %s failed", mode)
            res["errors"].append(f"{mode}: {type(e).__name__}: {e}"[:500])
        if args.json:
            cli.write_json(args.json, res)
    res["report"] = format_report(res)
    print(res["report"], flush=True)
    if args.json:
        cli.write_json(args.json, res)
    return res


if __name__ == "__main__":
    sys.exit(1 if main()["errors"] else 0)
