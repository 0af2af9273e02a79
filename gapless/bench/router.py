"""The data-parallel router's benchmark: one shared-prefix workload served by `--dp` replicas under each
`--load-balance-method`, and per method the prefix-cache hit rate the replicas themselves counted and
the throughput.

    python -m gapless.bench.router                      # DP=2 on the CPU, every method, the tiny model
    python -m gapless.bench.router --model PATH --device cuda --dp 2 --json /tmp/router.json

The workload (`shared_prefix_workload`, regenerated exactly from `--seed`): `--prefixes` long "system
prompts" of `--prefix-len` random token ids, each followed by `--requests-per-prefix` distinct questions
of `--question-len` tokens, shuffled, each generating `--output-len` tokens (ignore_eos, greedy). Each
replica's KV cache holds `--kv-cache-tokens`: by default about half of the prefixes, so that a router
sending every prefix to every replica (round robin) makes them evict each other, as a real deployment
with more prefixes than one replica's cache would. A server per method runs the same workload from a
cold start; the hit rate is the replicas' cached prompt tokens over their looked-up prompt tokens
(`/debug/state`'s per-replica `cached_prompt_tokens` and `prompt_tokens`), and the share each replica
took is its looked-up prompt tokens over all.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from typing import Any

import httpx

from gapless.bench import cli, serving
from gapless.bench.workload import Workload
from gapless.server.router import LOAD_BALANCE_METHODS


def shared_prefix_workload(
    prefixes: int,
    prefix_len: int,
    requests_per_prefix: int,
    question_len: int,
    output_len: int,
    seed: int = 0,
    vocab_size: int = 1000,
) -> Workload:
    """Every prefix's questions, shuffled; each question starts with a token no other question of its
    prefix starts with, so the only prefix two requests share is their system prompt."""
    rng = random.Random(seed)
    heads = [[rng.randrange(10, vocab_size) for _ in range(prefix_len)] for _ in range(prefixes)]
    prompts = []
    for head in heads:
        firsts = rng.sample(range(10, vocab_size), requests_per_prefix)
        for first in firsts:
            prompts.append(head + [first] + [rng.randrange(10, vocab_size) for _ in range(question_len - 1)])
    rng.shuffle(prompts)
    return Workload(prompts, [output_len] * len(prompts))


def replica_counts(url: str, headers: dict[str, str] | None = None) -> list[dict[str, int]]:
    """Each replica's prompt tokens computed and served from its prefix cache, as `/debug/state` shows."""
    state = httpx.get(f"{url}/debug/state", headers=headers, timeout=30, trust_env=False).json()
    replicas = state.get("replicas", [state])
    return [{k: int(r[k]) for k in ("prompt_tokens", "cached_prompt_tokens")} for r in replicas]


def hit_rate(before: list[dict[str, int]], after: list[dict[str, int]]) -> tuple[float, list[float]]:
    """The prefix-cache hit rate over all replicas between two `replica_counts`, and each replica's share
    of the looked-up prompt tokens."""
    cached = [a["cached_prompt_tokens"] - b["cached_prompt_tokens"] for a, b in zip(after, before)]
    computed = [a["prompt_tokens"] - b["prompt_tokens"] for a, b in zip(after, before)]
    looked_up = [c + p for c, p in zip(cached, computed)]
    total = sum(looked_up)
    return (sum(cached) / total if total else 0.0), [n / total if total else 0.0 for n in looked_up]


async def _send(url: str, work: Workload, concurrency: int) -> dict[str, Any]:
    flags = ["--base-url", url, "--disable-tqdm", "--max-concurrency", str(concurrency)]
    args = serving.parse_args(flags)
    async with serving.make_client(args, len(work)) as client:
        records, wall = await serving.run_benchmark(
            args, client, await serving.first_model(client), work, [0.0] * len(work)
        )
    return serving.summarize(records, wall)


def run_method(args: argparse.Namespace, method: str, work: Workload) -> dict[str, Any]:
    """Serve with `method` from a cold start, run the workload; the method's figures."""
    from gapless.testing.server import ServerProcess

    flags = ["--device", args.device, "--kv-cache-tokens", str(args.kv_cache_tokens), "--dp", str(args.dp)]
    flags += ["--load-balance-method", method, "--log-stats-interval", "0"]
    cli.progress(f"{method}: starting {args.dp} replicas")
    srv = ServerProcess(args.model, *flags, startup_timeout=600)
    try:
        url = srv.url
        assert url is not None, "a ServerProcess that started has its URL"
        before = replica_counts(url)
        summary = asyncio.run(_send(url, work, args.max_concurrency))
        if summary["failed"] or summary["wrong_length_requests"]:
            raise RuntimeError(f"{method}: requests failed: {json.dumps(summary['errors'])}\n{srv.output}")
        rate, shares = hit_rate(before, replica_counts(url))
    finally:
        srv.stop()
    return dict(
        method=method,
        prefix_hit_rate=round(rate, 4),
        replica_shares=[round(s, 3) for s in shares],
        requests_per_s=summary["request_throughput"],
        output_tokens_per_s=summary["output_throughput"],
        wall_s=summary["duration_s"],
    )


def format_report(rows: list[dict[str, Any]], dp: int) -> str:
    header = ("method", "prefix hit rate", "replica shares", "req/s", "out tok/s", f"vs {rows[0]['method']}")
    base = rows[0]["output_tokens_per_s"] or 1.0
    table = [
        (
            r["method"],
            f"{r['prefix_hit_rate']:.3f}",
            " / ".join(f"{s:.2f}" for s in r["replica_shares"]),
            f"{r['requests_per_s']:.2f}",
            f"{r['output_tokens_per_s']:.1f}",
            f"{r['output_tokens_per_s'] / base:.2f}x",
        )
        for r in rows
    ]
    return "\n".join([f"DP={dp}", *cli.markdown_table(header, table, "lrrrrr")])


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    what = "Prefix-cache hit rate and throughput of DP replicas under each load-balance method."
    p = argparse.ArgumentParser(prog="python -m gapless.bench.router", description=what)
    p.add_argument("--model", default="tiny-random", help="what `gapless serve` runs (default tiny-random)")
    p.add_argument("--device", default="cpu", help="(default cpu)")
    p.add_argument("--dp", type=cli.positive_int, default=2, help="replicas (default 2)")
    p.add_argument(
        "--methods",
        default=",".join(LOAD_BALANCE_METHODS),
        help="load-balance methods, comma-separated; the first is the throughput baseline "
        f"(default {','.join(LOAD_BALANCE_METHODS)})",
    )
    p.add_argument(
        "--kv-cache-tokens", type=cli.positive_int, default=1536, help="per replica (default 1536)"
    )
    w = p.add_argument_group("workload")
    w.add_argument("--prefixes", type=cli.positive_int, default=8, help="system prompts (default 8)")
    w.add_argument("--prefix-len", type=cli.positive_int, default=256, help="their tokens (default 256)")
    w.add_argument("--requests-per-prefix", type=cli.positive_int, default=8, help="(default 8)")
    w.add_argument("--question-len", type=cli.positive_int, default=16, help="tokens (default 16)")
    w.add_argument("--output-len", type=cli.positive_int, default=16, help="tokens (default 16)")
    w.add_argument("--max-concurrency", type=cli.positive_int, default=8, help="in flight (default 8)")
    w.add_argument("--seed", type=int, default=0, help="(default 0)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = p.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not args.methods or not set(args.methods) <= set(LOAD_BALANCE_METHODS):
        p.error(f"--methods takes {', '.join(LOAD_BALANCE_METHODS)}; got {args.methods}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse_args(argv)
    command = cli.command_line("gapless.bench.router", sys.argv[1:] if argv is None else argv)
    work = shared_prefix_workload(
        args.prefixes,
        args.prefix_len,
        args.requests_per_prefix,
        args.question_len,
        args.output_len,
        args.seed,
    )
    rows = [run_method(args, method, work) for method in args.methods]
    res: dict[str, Any] = {
        "command": command,
        "machine": cli.machine(args.device),
        "config": vars(args),
        "results": rows,
    }
    print(f"$ {command}\n{cli.machine_line(res['machine'])}")
    print(
        f"{len(work)} requests: {args.prefixes} prefixes x {args.requests_per_prefix}, {args.prefix_len} + "
        f"{args.question_len} prompt tokens, {args.output_len} output, {args.max_concurrency} in flight"
    )
    print(format_report(rows, args.dp), flush=True)
    if args.json:
        cli.write_json(args.json, res)
    return res


if __name__ == "__main__":
    main()
