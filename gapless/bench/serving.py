"""Online serving benchmark: replay a workload against a running OpenAI-compatible server and measure it.

    python -m gapless serve --model PATH &        # or any OpenAI-compatible server
    python -m gapless.bench.serving --request-rate 4 --num-prompts 200
    python -m gapless.bench.serving --workload sharegpt --request-rate inf --max-concurrency 32 \\
        --output-json /tmp/serving.json

Requests go to `POST /v1/completions` with `stream: true`, `stream_options: {"include_usage": true}`,
`max_tokens` set to the request's output length, `ignore_eos: true` (the vLLM/SGLang extension, so every
request generates exactly its output length whatever the model emits) and `temperature` 0. Prompts are
lists of token ids (OpenAI's completions API accepts `prompt: [ids]`), so input lengths are exact and no
tokenizer is needed on the client. Token ids are uniform below `--vocab-size` (default 1000: the test
tokenizer's size, and below any real model's vocabulary).

Arrivals are a Poisson process of `--request-rate` requests/s (exponential inter-arrival gaps, the first
request at t=0); `inf` sends everything at once. `--max-concurrency` caps the requests in flight: a request
whose arrival time has come waits for a free slot, and its latencies count from when it is actually sent.

Workloads (both regenerated exactly from `--seed`, see `gapless.bench.workload`):

- `random`: nano-vllm-style (`random_workload`). Lengths are uniform in `[L*(1-r), L*(1+r)]` for `L` =
  `--input-len`/`--output-len` and `r` = `--range-ratio`, or in explicit
  `--min-input/--max-input/--min-output/--max-output` bounds.
- `sharegpt`: synthetic lengths shaped like the ShareGPT conversations vLLM benchmarks with, without
  downloading anything (`sharegpt_workload`: lognormal, means 161 prompt and 338 output tokens, clipped to
  `[--min-*, --max-*]`, default [4, 1024]). `--input-len`/`--output-len` change the means and keep the
  shapes.

Per request: TTFT (first content chunk - send), inter-token latencies (gaps between successive content
chunks), e2e latency ([DONE] - send) and TPOT ((e2e - TTFT) / (output tokens - 1)). A content chunk is one
with a non-empty `choices` list, except a trailing chunk with empty text that only carries `finish_reason`
(it holds no token). Tokens are counted by the server, not from the text: the output token count comes
from the final `usage` chunk (asked for with `include_usage`), or from the number of content chunks only
if the server sends no usage. A stream whose tokens decoded to no text at all (a tokenizer that covers
less than the model's vocabulary) still counts its tokens; its first output is then its finish chunk (or
[DONE]), so that is its TTFT. A chunk may hold more than one token when the server batches its stream, so
ITL is really the inter-chunk gap; TPOT is per token either way. A request fails only on an error (HTTP
error, connection drop, an error event in the stream, a stream with no [DONE], or one with neither usage
nor output to count): failures are counted and reported with their error; the run goes on.

The report prints as a table; `--output-json PATH` also writes `{"config", "summary", "requests", "report"}`
with one record per request (times in seconds relative to the benchmark start) for plots, and
`--summary-json PATH` the same without the per-request records (small enough to commit).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import asdict
from typing import Any

import httpx
import numpy as np

from gapless.bench import cli
from gapless.bench.compare import ratio_table
from gapless.bench.stream_client import PERCENTILES, RequestRecord, send_request, summarize
from gapless.bench.workload import (
    SHAREGPT_INPUT_MEAN,
    SHAREGPT_MAX_LEN,
    SHAREGPT_MIN_LEN,
    SHAREGPT_OUTPUT_MEAN,
    Workload,
    random_bounds,
    random_workload,
    sharegpt_workload,
)

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_NUM_PROMPTS = 200
# random: prompt and output lengths 512 and 128 give or take half (uniform in [256, 768] and [64, 192])
RANDOM_INPUT_LEN = 512
RANDOM_OUTPUT_LEN = 128
RANDOM_RANGE_RATIO = 0.5
DEFAULT_VOCAB_SIZE = 1000


# ---------------------------------------------------------------------------------------------- workloads


def build_workload(args: argparse.Namespace) -> Workload:
    """The workload the command line asks for (lengths as the module docstring describes)."""
    if args.workload == "random":
        in_lo, in_hi = random_bounds(args.input_len or RANDOM_INPUT_LEN, args.range_ratio)
        out_lo, out_hi = random_bounds(args.output_len or RANDOM_OUTPUT_LEN, args.range_ratio)
        return random_workload(
            args.num_prompts,
            args.min_input or in_lo,
            args.max_input or in_hi,
            args.min_output or out_lo,
            args.max_output or out_hi,
            vocab_size=args.vocab_size,
            seed=args.seed,
        )
    return sharegpt_workload(
        args.num_prompts,
        input_mean=args.input_len or SHAREGPT_INPUT_MEAN,
        output_mean=args.output_len or SHAREGPT_OUTPUT_MEAN,
        min_input=args.min_input or SHAREGPT_MIN_LEN,
        max_input=args.max_input or SHAREGPT_MAX_LEN,
        min_output=args.min_output or SHAREGPT_MIN_LEN,
        max_output=args.max_output or SHAREGPT_MAX_LEN,
        vocab_size=args.vocab_size,
        seed=args.seed,
    )


def arrival_times(n: int, rate: float, seed: int = 0) -> list[float]:
    """Send times (s from the start) of `n` requests arriving as a Poisson process of `rate` per second.

    Inter-arrival gaps are exponential with mean 1/rate; the first request goes at 0. `rate` = inf sends all
    at 0. The generator is seeded apart from the workload's, so the arrivals do not depend on its lengths.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0 (or inf), got {rate}")
    if n == 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng([seed, 0x5E9D]).exponential(1.0 / rate, size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def format_report(summary: dict[str, Any]) -> str:
    def num(v: float | None, fmt: str = ".2f") -> str:
        return "n/a" if v is None else format(v, fmt)

    width = 52
    lines = ["{:=^{w}}".format(" Serving Benchmark Result ", w=width)]
    row = lambda label, value: lines.append(f"{label:<38}{value:>14}")  # noqa: E731
    row("Successful requests:", str(summary["completed"]))
    row("Failed requests:", str(summary["failed"]))
    row("Benchmark duration (s):", num(summary["duration_s"]))
    row("Total input tokens:", str(summary["input_tokens"]))
    row("Total generated tokens:", str(summary["output_tokens"]))
    row("Request throughput (req/s):", num(summary["request_throughput"]))
    row("Input token throughput (tok/s):", num(summary["input_throughput"]))
    row("Output token throughput (tok/s):", num(summary["output_throughput"]))
    row("Total token throughput (tok/s):", num(summary["total_token_throughput"]))
    titles = dict(
        ttft_ms="Time to First Token",
        tpot_ms="Time per Output Token (excl. 1st token)",
        itl_ms="Inter-token Latency",
        e2e_ms="End-to-end Latency",
    )
    for key, title in titles.items():
        lines.append("{:-^{w}}".format(f" {title} ", w=width))
        s = summary[key]
        name = key.removesuffix("_ms").upper()
        row(f"Mean {name} (ms):", num(s["mean"]))
        for p in PERCENTILES:
            row(f"P{p} {name} (ms):", num(s[f"p{p}"]))
    lines.append("=" * width)
    if summary["wrong_length_requests"]:
        lines.append(
            f"WARNING: {summary['wrong_length_requests']} requests generated other than max_tokens tokens "
            f"({summary['output_tokens']} generated, {summary['requested_output_tokens']} requested): "
            "does the server honour ignore_eos?"
        )
    for error, count in summary["errors"].items():
        lines.append(f"FAILED x{count}: {error}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- client


def _payload(args: argparse.Namespace, model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    payload = dict(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=args.temperature,
        ignore_eos=True,
        stream=True,
        stream_options=dict(include_usage=True),
    )
    payload.update(args.extra_body)
    return payload


async def run_benchmark(
    args: argparse.Namespace, client: httpx.AsyncClient, model: str, work: Workload, arrivals: list[float]
) -> tuple[list[RequestRecord], float]:
    """Send every request at its arrival time (and a free slot); return the records and the duration."""
    slots = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    bar = _progress(len(work), args.disable_tqdm)
    t0 = time.perf_counter()

    async def one(i: int) -> RequestRecord:
        record = RequestRecord(i, len(work.prompts[i]), work.output_lens[i], arrivals[i])
        await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
        payload = _payload(args, model, work.prompts[i], work.output_lens[i])
        try:
            if slots is None:
                return await send_request(client, args.endpoint, payload, record, t0)
            async with slots:
                return await send_request(client, args.endpoint, payload, record, t0)
        finally:
            bar.update(1)

    records = await asyncio.gather(*(one(i) for i in range(len(work))))
    duration = time.perf_counter() - t0
    bar.close()
    return list(records), duration


def _progress(total: int, disable: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req", disable=disable, file=sys.stderr)


async def first_model(client: httpx.AsyncClient) -> str:
    """The id of the first model `GET /v1/models` lists."""
    resp = await client.get("/v1/models")
    resp.raise_for_status()
    models = resp.json().get("data") or []
    if not models:
        raise RuntimeError("GET /v1/models lists no model; pass --model")
    return models[0]["id"]


def make_client(args: argparse.Namespace, n_requests: int) -> httpx.AsyncClient:
    """One client for the run: a connection per request that may be in flight, no pool wait timeout.

    `trust_env=False`: a benchmark of a (usually local) server must not go through an environment proxy.
    """
    conns = min(n_requests, args.max_concurrency) if args.max_concurrency else n_requests
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    return httpx.AsyncClient(
        base_url=args.base_url,
        headers=headers,
        timeout=httpx.Timeout(args.timeout, pool=None),
        limits=httpx.Limits(max_connections=max(1, conns), max_keepalive_connections=max(1, conns)),
        trust_env=False,
    )


# ---------------------------------------------------------------------------------------------- CLI


def _json_object(s: str) -> dict[str, Any]:
    try:
        v = json.loads(s)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from e
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return v


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m gapless.bench.serving",
        description="Online benchmark of an OpenAI-compatible server: Poisson arrivals, streamed "
        "/v1/completions, TTFT/ITL/TPOT/e2e and throughput.",
    )
    s = p.add_argument_group("server")
    s.add_argument(
        "--base-url",
        default=DEFAULT_BASE_URL,
        help=f"server root (default {DEFAULT_BASE_URL}; a trailing /v1 is dropped)",
    )
    s.add_argument(
        "--compare-base-url",
        metavar="URL",
        help="then send the same requests to this server too (e.g. a running llama-server) and print the "
        "ratio of the two servers' figures (gapless.bench.compare)",
    )
    s.add_argument("--compare-model", help="model name at --compare-base-url (default: its first listed)")
    s.add_argument("--endpoint", default="/v1/completions", help="completions path (default /v1/completions)")
    s.add_argument("--model", help="model name to request (default: the first of GET /v1/models)")
    s.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    s.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds to wait for a connection or a chunk (default 600)",
    )
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=("random", "sharegpt"), default="random", help="(default random)")
    w.add_argument(
        "--num-prompts",
        type=cli.positive_int,
        default=DEFAULT_NUM_PROMPTS,
        help=f"(default {DEFAULT_NUM_PROMPTS})",
    )
    centre = "random: centre of the {} lengths (default {}); sharegpt: their mean (default {})"
    bound = "random: overrides that bound of the range; sharegpt: clip bound (default {})"
    lengths = {
        "--input-len": centre.format("prompt", RANDOM_INPUT_LEN, SHAREGPT_INPUT_MEAN),
        "--output-len": centre.format("output", RANDOM_OUTPUT_LEN, SHAREGPT_OUTPUT_MEAN),
        "--min-input": bound.format(SHAREGPT_MIN_LEN),
        "--max-input": bound.format(SHAREGPT_MAX_LEN),
        "--min-output": bound.format(SHAREGPT_MIN_LEN),
        "--max-output": bound.format(SHAREGPT_MAX_LEN),
    }
    for flag, text in lengths.items():
        w.add_argument(flag, type=cli.positive_int, help=text)
    w.add_argument(
        "--range-ratio",
        type=float,
        default=RANDOM_RANGE_RATIO,
        help=f"random: lengths uniform in [L*(1-r), L*(1+r)] (default {RANDOM_RANGE_RATIO}; 0 = fixed)",
    )
    w.add_argument(
        "--vocab-size",
        type=cli.positive_int,
        default=DEFAULT_VOCAB_SIZE,
        help=f"prompt token ids are uniform below this (default {DEFAULT_VOCAB_SIZE})",
    )
    w.add_argument("--seed", type=int, default=0, help="seed of the workload and the arrivals (default 0)")
    t = p.add_argument_group("traffic and sampling")
    t.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrival rate in requests/s; inf sends all at once (default inf)",
    )
    t.add_argument(
        "--max-concurrency", type=cli.positive_int, help="cap on requests in flight (default none)"
    )
    t.add_argument("--temperature", type=float, default=0.0, help="(default 0: greedy)")
    t.add_argument(
        "--extra-body",
        type=_json_object,
        default={},
        metavar="JSON",
        help="merged into every request body, e.g. '{\"top_p\": 0.9}'",
    )
    p.add_argument("--output-json", metavar="PATH", help="write the summary and per-request records here")
    p.add_argument(
        "--summary-json", metavar="PATH", help="write the summary without per-request records here"
    )
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if not args.request_rate > 0:
        p.error(f"--request-rate must be > 0 or inf, got {args.request_rate}")
    if not 0.0 <= args.range_ratio < 1.0:
        p.error(f"--range-ratio must be in [0, 1), got {args.range_ratio}")
    args.base_url = args.base_url.rstrip("/").removesuffix("/v1")
    if args.compare_base_url:
        args.compare_base_url = args.compare_base_url.rstrip("/").removesuffix("/v1")
    return args


async def _main(args: argparse.Namespace, work: Workload, arrivals: list[float]) -> dict[str, Any]:
    async with make_client(args, len(work)) as client:
        try:
            model = args.model or await first_model(client)
        except (httpx.HTTPError, RuntimeError, ValueError, KeyError, TypeError) as e:
            raise SystemExit(
                f"error: cannot list the models at {args.base_url}/v1/models ({e!r}); pass --model"
            ) from e
        records, duration = await run_benchmark(args, client, model, work, arrivals)
    return dict(model=model, records=records, duration=duration)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the report, return `{"config", "summary", "requests", "report"}`."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    try:
        work = build_workload(args)
    except ValueError as e:
        sys.exit(f"error: {e}")
    arrivals = arrival_times(len(work), args.request_rate, args.seed)
    cli.progress(
        f"{len(work)} requests ({args.workload}: {work.input_tokens} prompt, "
        f"{work.output_tokens} output tokens) to {args.base_url}{args.endpoint} at {args.request_rate} req/s"
        + (f", at most {args.max_concurrency} in flight" if args.max_concurrency else "")
    )
    ran = asyncio.run(_main(args, work, arrivals))
    summary = summarize(ran["records"], ran["duration"])
    config = dict(
        command=cli.command_line("gapless.bench.serving", argv),
        base_url=args.base_url,
        endpoint=args.endpoint,
        model=ran["model"],
        workload=args.workload,
        num_prompts=len(work),
        input_tokens=work.input_tokens,
        output_tokens=work.output_tokens,
        seed=args.seed,
        request_rate="inf" if math.isinf(args.request_rate) else args.request_rate,
        max_concurrency=args.max_concurrency,
        temperature=args.temperature,
        extra_body=args.extra_body,
    )
    report = format_report(summary)
    print(report)
    res = dict(config=config, summary=summary, requests=[asdict(r) for r in ran["records"]], report=report)
    if args.compare_base_url:
        res["compare"] = _compare(args, work, arrivals, summary)
    if args.output_json:
        cli.write_json(args.output_json, res)
    if args.summary_json:
        cli.write_json(args.summary_json, dict(config=config, summary=summary, report=report))
    return res


def _compare(
    args: argparse.Namespace, work: Workload, arrivals: list[float], summary: dict[str, Any]
) -> dict[str, Any]:
    """The same workload and arrivals against `--compare-base-url`, after the first server's run; prints
    its report and the ratio table, and returns both with its summary."""
    other_args = argparse.Namespace(
        **{**vars(args), "base_url": args.compare_base_url, "model": args.compare_model}
    )
    cli.progress(f"the same requests to {other_args.base_url}{args.endpoint}")
    ran = asyncio.run(_main(other_args, work, arrivals))
    other = summarize(ran["records"], ran["duration"])
    report = format_report(other)
    table = ratio_table({f"base {args.base_url}": summary, f"compare {other_args.base_url}": other})
    print(report)
    print(table)
    return dict(base_url=other_args.base_url, model=ran["model"], summary=other, report=report, ratio=table)


if __name__ == "__main__":
    main()
