"""Whether a prefill forward's launches cost less than the GPU work they launch:
`python -m gapless.bench.prefill_launch`.

    python -m gapless.bench.prefill_launch --size qwen3-0.6b --dtype bfloat16   # a GPU: the figures
    python -m gapless.bench.prefill_launch                                     # CPU: does it run

An eager prefill forward launches a few kernels per layer: projections, norms, RoPE and the KV store,
attention, the MLP. If launching them takes the host longer than the GPU takes to run them, the GPU waits
between kernels for the next launch, and capturing the forward (CUDA graphs for bucketed token counts,
piecewise graphs around attention, `torch.compile`) pays; if not, capture buys nothing. The engine's own
meter cannot tell the two apart: when launches set the pace, the device's time per job grows to the launch
time. This benchmark measures them apart, on one extend batch of `--requests` prompts of `--prompt-len`
tokens per token count in `--tokens`, run through the engine's own `ModelRunner.forward_hidden` (table
writes and decoder; no LM head or sampling, which run once per request whatever the prompt length):

- launch: the host's wall time to launch one forward, with the device idle before it, so that no launch
  waits for a full launch queue;
- GPU work: the same forward's device time with its launches queued behind a device-side sleep
  (`torch.cuda._sleep`): the kernels start once every one of them is queued, so the time between the
  events around them is the kernels' own, with no gap left for the host. A run where the sleep ended
  before the last launch is repeated with a longer sleep;
- graph: the same batch captured as one CUDA graph, its replay's launch and GPU work the same two ways:
  what any capture could reach at best.

With `--engine-option piecewise_cuda_graph_max_tokens=N` the forwards of up to N tokens take the
piecewise prefill graphs (`gapless.engine.piecewise_graph`; "pieces" in the path column), so the two runs,
with and without, give what the pieces save against the eager forward and the whole-forward graph.

A forward whose launches fill the device's launch queue (about a thousand kernels) makes the host wait
on the device before its last launch whatever the sleep: its GPU work shows as "-", and its launch time
then includes device time.

launch/work above 1 means the GPU idles on prefill launches. Each figure is the median of `--iters` runs.
On the CPU host and device are one: "launch" is the whole forward, and the GPU columns stay empty.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gapless.bench import cli
from gapless.config import EngineConfig
from gapless.engine.batch import ForwardBatch
from gapless.engine.runner import ModelRunner
from gapless.tensors import dataclass_to_device
from gapless.testing.checkpoints import SIZES, cached_checkpoint

HEADER = (
    "tokens",
    "requests x len",
    "path",
    "launch ms",
    "GPU work ms",
    "launch/work",
    "graph launch ms",
    "graph GPU ms",
)
_SLEEP_CALIBRATION_CYCLES = 10_000_000


def extend_batch(requests: int, prompt_len: int, page_size: int) -> ForwardBatch:
    """`requests` fresh prompts of `prompt_len` tokens each in request-table rows 0.., their tokens in KV
    slots of their own from the first page past the padding page on, sampling nothing."""
    n, tokens = requests, requests * prompt_len
    extend_lens = torch.full((n,), prompt_len, dtype=torch.int64)
    q_start = torch.arange(n, dtype=torch.int64) * prompt_len
    rows = torch.arange(n, dtype=torch.int64)
    return ForwardBatch(
        input_ids=torch.randint(0, 1000, (tokens,), generator=torch.Generator().manual_seed(0)),
        positions=torch.arange(prompt_len, dtype=torch.int64).repeat(n),
        out_slots=torch.arange(page_size, page_size + tokens, dtype=torch.int64),
        token_rows=rows.repeat_interleave(prompt_len),
        rows=rows,
        prefix_lens=torch.zeros(n, dtype=torch.int64),
        extend_lens=extend_lens,
        q_start=q_start,
        max_extend_len=prompt_len,
        max_seq_len=prompt_len,
        is_decode=False,
        sample_index=torch.zeros(0, dtype=torch.int64),
        sample_rows=torch.zeros(0, dtype=torch.int64),
        sample_steps=torch.zeros(0, dtype=torch.int64),
        sampling=None,
    )


def launch_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Host wall time of `fn` (its launches), the device idle before it; waits for the device after."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    ms = (time.perf_counter() - t0) * 1e3
    _sync(device)
    return ms


def gpu_work_ms(
    fn: Callable[[], object], device: torch.device, cycles_per_ms: float, launch: float
) -> float | None:
    """Device time of `fn`'s kernels queued behind a sleep that outlasts their launch (CUDA only). None
    when even a sleep of 8 launch times ends first: the launches filled the device's launch queue, and
    the host waited on the device to launch the rest."""
    for factor in (2, 4, 8):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        _sync(device)
        torch.cuda._sleep(int(max(1.0, factor * launch) * cycles_per_ms))
        start.record()
        fn()
        end.record()
        queued_in_time = not start.query()  # the sleep still runs: nothing of `fn` has started yet
        end.synchronize()
        if queued_in_time:
            return start.elapsed_time(end)
    return None


def sleep_cycles_per_ms(device: torch.device) -> float:
    """How many `torch.cuda._sleep` cycles make a millisecond on `device`."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    _sync(device)
    start.record()
    torch.cuda._sleep(_SLEEP_CALIBRATION_CYCLES)
    end.record()
    end.synchronize()
    return _SLEEP_CALIBRATION_CYCLES / start.elapsed_time(end)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median(fn: Callable[[], float | None], iters: int) -> float | None:
    """The median of `iters` runs of `fn`; None if any run measured nothing."""
    runs = [fn() for _ in range(iters)]
    measured = [r for r in runs if r is not None]
    return statistics.median(measured) if len(measured) == len(runs) else None


def _capture(fn: Callable[[], object], device: torch.device) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    _sync(device)
    return graph


def measure(runner: ModelRunner, tokens: int, prompt_len: int, iters: int, warmup: int) -> dict[str, Any]:
    """One token count's row: its batch's launch, GPU work and graph figures (GPU ones None off CUDA)."""
    requests = max(1, tokens // prompt_len)
    plen = min(prompt_len, tokens)
    device = runner.device
    batch = dataclass_to_device(extend_batch(requests, plen, runner.page_size), device)

    def forward() -> object:
        return runner.forward_hidden(batch)

    for _ in range(warmup):
        forward()
    row: dict[str, Any] = dict(tokens=requests * plen, requests=requests, prompt_len=plen)
    row["launch_ms"] = _median(lambda: launch_ms(forward, device), iters)
    row.update(gpu_work_ms=None, graph_launch_ms=None, graph_gpu_ms=None)
    row["piecewise"] = runner.piecewise is not None and runner.piecewise.can_run(batch)
    if device.type == "cuda":
        cycles = sleep_cycles_per_ms(device)
        row["gpu_work_ms"] = _median(lambda: gpu_work_ms(forward, device, cycles, row["launch_ms"]), iters)
        if row["piecewise"]:  # the forward replays graphs of its own: not captured again
            return row
        with torch.inference_mode():
            graph = _capture(forward, device)
        row["graph_launch_ms"] = _median(lambda: launch_ms(graph.replay, device), iters)
        row["graph_gpu_ms"] = _median(
            lambda: gpu_work_ms(graph.replay, device, cycles, row["graph_launch_ms"]), iters
        )
        del graph
    return row


def report(rows: list[dict[str, Any]]) -> str:
    def num(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    table = [
        (
            f"{r['tokens']:,}",
            f"{r['requests']} x {r['prompt_len']}",
            "pieces" if r["piecewise"] else "eager",
            num(r["launch_ms"]),
            num(r["gpu_work_ms"]),
            "-" if r["gpu_work_ms"] is None else f"{r['launch_ms'] / r['gpu_work_ms']:.2f}",
            num(r["graph_launch_ms"]),
            num(r["graph_gpu_ms"]),
        )
        for r in rows
    ]
    return "\n".join(cli.markdown_table(HEADER, table, "rllrrrrr"))


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF checkpoint dir (default: a random-weight qwen3 of --size, built)")
    ap.add_argument("--size", choices=SIZES, default="tiny", help="shape of the built model (default tiny)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto", help="the engine's dtype (default: auto)")
    ap.add_argument(
        "--tokens", type=cli.positive_int, nargs="+", default=[512, 2048, 16384], help="tokens per forward"
    )
    ap.add_argument("--prompt-len", type=cli.positive_int, default=1024, help="tokens per prompt")
    ap.add_argument("--iters", type=cli.positive_int, default=10, help="timed runs (the median is kept)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed runs first")
    ap.add_argument("--json", help="write the results here")
    cli.add_engine_option_arg(ap.add_argument_group("engine"), "e.g. --engine-option fused_kernels=torch")
    return cli.take_engine_options(ap, ap.parse_args(argv))


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = _parse_args(argv)
    path = Path(args.model) if args.model else cached_checkpoint("qwen3", size=args.size)
    most = max(args.tokens)
    options: dict[str, Any] = dict(
        device=args.device,
        dtype=args.dtype,
        cuda_graph_max_bs=0,  # the decode graphs are not measured here
        kv_cache_tokens=most,
        max_running_requests=max(1, most // min(args.prompt_len, most)),
        chunked_prefill_size=most,
        max_model_len=min(args.prompt_len, most),
    )
    options.update(args.engine_options)
    runner = ModelRunner(EngineConfig(model=str(path), **options))
    rows = [measure(runner, t, args.prompt_len, args.iters, args.warmup) for t in args.tokens]
    print(cli.machine_line(cli.machine(args.device, torch.get_num_threads())))
    print(f"model: {path.name}, {runner.dtype}, fused kernels {runner.fused_kernels}")
    print(report(rows))
    if args.json:
        cli.write_json(
            args.json,
            dict(
                command=cli.command_line(
                    "gapless.bench.prefill_launch", sys.argv[1:] if argv is None else argv
                ),
                machine=cli.machine(args.device, torch.get_num_threads()),
                model=str(path),
                rows=rows,
            ),
        )
    return rows


if __name__ == "__main__":
    main()
