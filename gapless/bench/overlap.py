"""Overlap vs no overlap, in one run, alternating: `python -m gapless.bench.overlap`.

The workload is the offline one on a model small enough that host time is a visible share of a step
(random-weight Qwen3 of size `overlap`: hidden 128, 2 layers) with 128 requests running at once. Each
mode runs at its best thread setting (tried in a first pass), then the modes alternate for `--rounds`
rounds, so machine noise hits both alike. Reports output tokens/s, device idle fraction, host ms per
step and device ms per job of each, the ratio, and the ideal ratio (host + device) / max(host, device).
With `--out DIR` it also writes `overlap.json`, one trace per mode (from the last round; large, so
`bench/.gitignore` keeps them out of the repository) and `timeline.png` drawing them one above the other.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import torch

from gapless.bench import cli
from gapless.bench.runs import run_gapless
from gapless.bench.workload import Workload, random_workload

MODES = {
    "plain": {"overlap": False, "cpu_worker": "inline"},
    "overlap": {"overlap": True, "cpu_worker": "process"},  # the CPU default: a device process
    "overlap-thread": {"overlap": True, "cpu_worker": "thread"},  # shown for the choice in the README
}
FIGURES = ("tok_s", "device_idle_fraction", "host_ms_per_step", "device_ms_per_job")


def run_once(
    path: Path, mode: str, threads: int, work: Workload, max_running: int, trace: str | None = None
) -> dict[str, Any]:
    """One timed run of `mode` at `threads` (the host's and the device's intra-op threads)."""
    torch.set_num_threads(threads)  # the host's threads (and the device's, when in this process)
    options = dict(MODES[mode], max_running_requests=max_running, trace_path=trace)
    g = run_gapless(path, work, threads, options=options)
    if g["wrong_length_requests"]:
        raise RuntimeError(f"{g['wrong_length_requests']} requests did not run to their length")
    m = g["meter"]
    return dict(
        mode=mode,
        threads=threads,
        tok_s=g["output_tokens_per_s"],
        wall_s=g["wall_s"],
        steps=m["steps"],
        device_idle_fraction=m["device_idle_fraction"],
        host_ms_per_step=m["host_ms_per_step"],
        device_ms_per_job=m["device_ms_per_job"],
    )


def workload_parser(doc: str | None) -> argparse.ArgumentParser:
    """The model and workload options of this benchmark (the grammar benchmark shares them)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_model_args(ap, "overlap", ("tiny", "overlap", "bench"))
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--max-running", type=int, default=128)
    # short contexts keep the device step small, so host time is a visible share of it
    ap.add_argument("--input", type=int, nargs=2, default=(8, 32), metavar=("MIN", "MAX"))
    ap.add_argument("--output", type=int, nargs=2, default=(32, 96), metavar=("MIN", "MAX"))
    return ap


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = workload_parser(__doc__)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread settings to try per mode")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", help="directory for JSON results, traces and timeline.png")
    return ap.parse_args(argv)


def _table(title: str, rows: list[dict[str, Any]]) -> list[str]:
    header = ("mode", "threads", "output tok/s", "device idle", "host ms/step", "device ms/job")
    cells = [
        (
            r["mode"],
            r["threads"],
            f"{r['tok_s']:.0f}",
            f"{r['device_idle_fraction']:.1%}",
            f"{r['host_ms_per_step']:.2f}",
            f"{r['device_ms_per_job']:.2f}",
        )
        for r in rows
    ]
    return [title, "", *cli.markdown_table(header, cells, "llllll")]


def _report(args: argparse.Namespace, work: Workload, result: dict[str, Any]) -> str:
    summary, p = result["summary"], result["summary"]["plain"]
    return "\n".join(
        [
            f"\n{len(work)} requests, {args.max_running} running at once, inputs {args.input}, "
            f"outputs {args.output}; model {Path(result['model']).name}; median of {args.rounds} alternating "
            "rounds\n",
            *_table(
                "pass 1, each mode at each thread setting (the device process pins the host to one core and\n"
                "runs the device on the rest, so its device threads are capped at cores - 1):",
                result["tried"],
            ),
            "",
            *_table(
                "pass 2, each mode at its best setting, alternating:",
                [{"mode": m, **s} for m, s in summary.items()],
            ),
            f"\noverlap / plain: {result['ratio']:.2f}x; overlap-thread / plain: "
            f"{summary['overlap-thread']['tok_s'] / p['tok_s']:.2f}x (ideal from the plain loop's host and "
            f"device time: {result['ideal_ratio']:.2f}x)",
        ]
    )


def _draw(out: Path, summary: dict[str, Any]) -> None:
    """`timeline.png`: the plain loop's trace above the overlap's, over 8 steps, past the first 8."""
    from gapless.bench.timeline import draw

    p, o = summary["plain"], summary["overlap"]
    window = 8 * max(p["device_ms_per_job"] + p["host_ms_per_step"], 1.0)
    draw(
        [
            (f"plain loop ({p['tok_s']:.0f} tok/s)", out / "trace_plain.json"),
            (f"overlap ({o['tok_s']:.0f} tok/s)", out / "trace_overlap.json"),
        ],
        out / "timeline.png",
        window_ms=window,
        skip_ms=window,
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run both passes, print the tables, return the results (with `--out`, also written there)."""
    args = _parse_args(argv)
    path, _ = cli.model_path(args)
    machine = cli.machine()  # before the runs change torch's threads
    (min_input, max_input), (min_output, max_output) = args.input, args.output
    vocab_size = cli.model_info(path)["vocab_size"]
    work = random_workload(args.num_seqs, min_input, max_input, min_output, max_output, vocab_size, seed=0)
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)

    # pass 1: each mode's best thread setting
    tried = [run_once(path, m, t, work, args.max_running) for t in args.threads for m in MODES]
    best = {m: max((r for r in tried if r["mode"] == m), key=lambda r: r["tok_s"])["threads"] for m in MODES}
    # pass 2: alternate the modes at those settings
    runs: list[dict[str, Any]] = []
    for i in range(args.rounds):
        for m in MODES:
            trace = str(out / f"trace_{m}.json") if out and i == args.rounds - 1 else None
            runs.append(run_once(path, m, best[m], work, args.max_running, trace))

    summary = {}
    for m in MODES:
        rs = [r for r in runs if r["mode"] == m]
        summary[m] = {k: statistics.median(r[k] for r in rs) for k in FIGURES}
        summary[m]["threads"] = best[m]
    p, o = summary["plain"], summary["overlap"]
    ideal = (p["host_ms_per_step"] + p["device_ms_per_job"]) / max(
        p["host_ms_per_step"], p["device_ms_per_job"]
    )
    result = {
        "args": vars(args),
        "model": str(path),
        "tried": tried,
        "runs": runs,
        "summary": summary,
        "ratio": o["tok_s"] / p["tok_s"],
        "ideal_ratio": ideal,
        "torch": torch.__version__,
        "machine": machine,
    }
    print(_report(args, work, result))
    if out:
        cli.write_json(out / "overlap.json", result)
        _draw(out, summary)
        print(f"wrote {out}/overlap.json, traces and timeline.png")
    return result


if __name__ == "__main__":
    main()
