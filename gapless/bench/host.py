"""The host's share of a step, at 256 running decode requests: `python -m gapless.bench.host`.

The engine promises that the device never waits for the host; that holds only while the host's work per
step (schedule + build + launch + process, waits excluded: `get_stats()["mean_host_ms_per_step"]`) is
shorter than the device's. On a GPU a decode step of a small model takes a few milliseconds, so the host
must stay near 1 ms. This benchmark measures that host time on any machine: a 1-layer random-weight
Qwen3 (tiny shape) keeps the device side cheap, 256 requests with short prompts are admitted at once and
then decode together to the same length, so nearly every step is a decode of 256 rows.

Both loops run, alternating for `--rounds` rounds (machine noise hits both alike; the table shows
each figure's median): plain (inline device side) and overlap (on the CPU the device process, whose
launch span includes shipping the batch through the pipe, as a GPU's includes the host-to-device
copies). Each prints host ms per step, per prefill step and per decode step next to the device's ms
per job, and how many cores other processes kept busy meanwhile (the host figures are wall time: on a
shared machine they grow with its load). `--profile DIR` writes a cProfile of each mode's last run.

The same meter shows the host's time per prefill step against the device's per job (issue 10; whether
the launches or the GPU set a launch-bound job's pace is `gapless.bench.prefill_launch`'s to say): a
model of Qwen3-0.6B's shape (`--size qwen3-0.6b`), prompts of 1,024 tokens and one output token each, so
nearly every step is a prefill, e.g. `--size qwen3-0.6b --num-seqs 64 --input-len 1024 --output-len 1
--modes overlap --engine-option device=cuda --engine-option dtype=bfloat16 --engine-option
chunked_prefill_size=16384`: host ms per prefill step beside device ms per job (and 2048 for the small
chunks' case).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from gapless.bench import cli
from gapless.bench.runs import run_gapless
from gapless.bench.workload import random_workload
from gapless.testing.checkpoints import SIZES

MODES: dict[str, dict[str, Any]] = {
    "plain": {"overlap": False, "cpu_worker": "inline"},
    "overlap": {"overlap": True, "cpu_worker": "process"},
}
HEADER = (
    "mode",
    "output tok/s",
    "prefill/decode steps",
    "host ms/step",
    "host ms/prefill step",
    "host ms/decode step",
    "device ms/job",
    "other cores busy",
)
METER = (  # the engine's meter figures each run reports
    "prefill_steps",
    "decode_steps",
    "host_ms_per_step",
    "host_ms_per_prefill_step",
    "host_ms_per_decode_step",
    "device_ms_per_job",
    "device_idle_fraction",
)
FIGURES = (
    "tok_s",
    "host_ms_per_step",
    "host_ms_per_prefill_step",
    "host_ms_per_decode_step",
    "device_ms_per_job",
    "other_cores",
)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF checkpoint dir (default: a random-weight qwen3 of --size, built)")
    ap.add_argument(
        "--size",
        choices=SIZES,
        default="tiny",
        help="shape of the built model (default tiny; qwen3-0.6b: the real one's, for prefill launches)",
    )
    ap.add_argument(
        "--layers",
        type=cli.positive_int,
        default=None,
        help="layers of the built model (default: 1 at size tiny, else the shape's)",
    )
    ap.add_argument("--num-seqs", type=cli.positive_int, default=256, help="requests, all running at once")
    ap.add_argument("--input-len", type=cli.positive_int, default=16, help="prompt tokens per request")
    ap.add_argument("--output-len", type=cli.positive_int, default=128, help="output tokens per request")
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    ap.add_argument("--threads", type=cli.positive_int, default=1, help="torch threads (default 1)")
    ap.add_argument("--rounds", type=cli.positive_int, default=3, help="alternating rounds (default 3)")
    ap.add_argument("--profile", help="directory for a cProfile of each mode's timed run")
    ap.add_argument("--json", help="write the results here")
    cli.add_engine_option_arg(ap.add_argument_group("engine"), "e.g. --engine-option page_size=16")
    return cli.take_engine_options(ap, ap.parse_args(argv))


def _model(args: argparse.Namespace) -> Path:
    if args.model:
        return Path(args.model)
    from gapless.testing import cached_checkpoint

    layers = args.layers or (1 if args.size == "tiny" else None)
    return cached_checkpoint("qwen3", size=args.size, **({"num_hidden_layers": layers} if layers else {}))


def run_mode(path: Path, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """One timed run of the workload in `mode`; the meter's figures in the result."""
    torch.set_num_threads(args.threads)
    vocab = cli.model_info(path)["vocab_size"]
    n, lin, lout = args.num_seqs, args.input_len, args.output_len
    work = random_workload(n, lin, lin, lout, lout, vocab_size=vocab, seed=0)
    # every request admitted in one prefill step, all of them running
    options = dict(MODES[mode], max_running_requests=n, chunked_prefill_size=max(2048, n * lin))
    options.update(args.engine_options)
    profile = str(Path(args.profile) / f"host_{mode}.prof") if args.profile else None
    g = run_gapless(path, work, args.threads, options=options, profile=profile)
    if g["wrong_length_requests"]:
        raise RuntimeError(f"{g['wrong_length_requests']} requests did not run to their length")
    meter = {k: g["meter"][k] for k in METER}
    return dict(mode=mode, tok_s=g["output_tokens_per_s"], other_cores=g["other_cores"], **meter)


def _row(r: dict[str, Any]) -> tuple[object, ...]:
    return (
        r["mode"],
        f"{r['tok_s']:.0f}",
        f"{r['prefill_steps']}/{r['decode_steps']}",
        f"{r['host_ms_per_step']:.3f}",
        f"{r['host_ms_per_prefill_step']:.3f}",
        f"{r['host_ms_per_decode_step']:.3f}",
        f"{r['device_ms_per_job']:.3f}",
        "?" if r["other_cores"] is None else f"{r['other_cores']:.2f}",
    )


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each figure over `runs` of one mode."""
    out = dict(runs[-1])
    for k in FIGURES:
        values = [r[k] for r in runs if r[k] is not None]
        out[k] = statistics.median(values) if values else None
    return out


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run each mode, print the table, return the rows (with `--json`, also written there)."""
    args = _parse_args(argv)
    path = _model(args)
    machine = cli.machine(threads=args.threads)
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    for i in range(args.rounds):
        for mode in args.modes:
            cli.progress(f"round {i + 1}, {mode}: {args.num_seqs} requests x {args.output_len} tokens")
            runs.append(run_mode(path, mode, args))
    rows = [_median([r for r in runs if r["mode"] == mode]) for mode in args.modes]
    print(cli.command_line("gapless.bench.host", argv if argv is not None else sys.argv[1:]))
    print(cli.machine_line(machine))
    print(
        f"{args.num_seqs} requests running at once, prompts {args.input_len}, outputs {args.output_len} "
        f"tokens; model {path.name}; median of {args.rounds} alternating rounds\n"
    )
    print("\n".join(cli.markdown_table(HEADER, [_row(r) for r in rows], "lrrrrrrr")))
    if args.json:
        result = {"args": vars(args), "model": str(path), "machine": machine, "summary": rows, "runs": runs}
        cli.write_json(args.json, result)
    return rows


if __name__ == "__main__":
    main()
