"""Overlap vs no overlap, in one run, alternating: `python -m gapless.bench.overlap`.

The workload is the offline one on a model small enough that host time is a visible share of a step
(random-weight Qwen3 of size `overlap`: hidden 128, 2 layers) with 128 requests running at once. Each
mode runs at its best thread setting (tried in a first pass), then the modes alternate for `--rounds`
rounds, so machine noise hits both alike. Reports output tokens/s, device idle fraction, host ms per
step and device ms per job of each, the ratio, and the ideal ratio (host + device) / max(host, device).
With `--out DIR` it also writes one trace per mode and `timeline.png` drawing them one above the other.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from gapless import LLM, SamplingParams
from gapless.bench.workload import random_workload
from gapless.testing import cached_checkpoint

MODES = {
    "plain": {"overlap": False, "cpu_worker": "inline"},
    "overlap": {"overlap": True, "cpu_worker": "process"},  # the CPU default: a device process
    "overlap-thread": {"overlap": True, "cpu_worker": "thread"},  # shown for the choice in the README
}


def run_once(
    path: str, mode: str, threads: int, work: Any, max_running: int, trace: str | None = None
) -> dict:
    torch.set_num_threads(threads)  # the host's threads (and the device's, when in this process)
    opts = dict(MODES[mode], device_threads=threads, max_running_requests=max_running, trace_path=trace)
    with LLM(path, device="cpu", **opts) as llm:
        llm.generate([[1, 2, 3]] * 2, SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        llm.engine.scheduler.meter.reset()
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in work.output_lens]
        t = time.perf_counter()
        outs = llm.generate(work.prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t
        st = llm.engine.stats
    tokens = sum(len(o.token_ids) for o in outs)
    assert tokens == work.output_tokens, "every request must run to its length"
    return {
        "mode": mode,
        "threads": threads,
        "tok_s": tokens / wall,
        "wall_s": wall,
        "steps": st.steps,
        "device_idle_fraction": st.device_idle_fraction,
        "host_ms_per_step": st.mean_host_ms_per_step,
        "device_ms_per_job": st.mean_device_ms_per_job,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="overlap", help="random-weight qwen3 size (gapless.testing)")
    ap.add_argument("--model", help="HF checkpoint dir instead of the random-weight one")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--max-running", type=int, default=128)
    # short contexts keep the device step small, so host time is a visible share of it
    ap.add_argument("--input", type=int, nargs=2, default=(8, 32), metavar=("MIN", "MAX"))
    ap.add_argument("--output", type=int, nargs=2, default=(32, 96), metavar=("MIN", "MAX"))
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread settings to try per mode")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", help="directory for JSON results, traces and timeline.png")
    args = ap.parse_args(argv)

    path = args.model or str(cached_checkpoint("qwen3", size=args.size))
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    work = random_workload(args.num_seqs, *args.input, *args.output, vocab_size=vocab, seed=0)
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)

    # pass 1: each mode's best thread setting
    tried = [run_once(path, m, t, work, args.max_running) for t in args.threads for m in MODES]
    best = {m: max((r for r in tried if r["mode"] == m), key=lambda r: r["tok_s"])["threads"] for m in MODES}
    # pass 2: alternate the modes at those settings
    runs: list[dict] = []
    for i in range(args.rounds):
        for m in MODES:
            trace = str(out / f"trace_{m}.json") if out and i == args.rounds - 1 else None
            runs.append(run_once(path, m, best[m], work, args.max_running, trace))

    summary = {}
    for m in MODES:
        rs = [r for r in runs if r["mode"] == m]
        summary[m] = {
            k: statistics.median(r[k] for r in rs)
            for k in ("tok_s", "device_idle_fraction", "host_ms_per_step", "device_ms_per_job")
        }
        summary[m]["threads"] = best[m]
    p, o = summary["plain"], summary["overlap"]
    ideal = (p["host_ms_per_step"] + p["device_ms_per_job"]) / max(
        p["host_ms_per_step"], p["device_ms_per_job"]
    )
    result = {
        "args": vars(args),
        "model": path,
        "tried": tried,
        "runs": runs,
        "summary": summary,
        "ratio": o["tok_s"] / p["tok_s"],
        "ideal_ratio": ideal,
        "torch": torch.__version__,
    }

    print(
        f"\n{len(work)} requests, {args.max_running} running at once, inputs {args.input}, "
        f"outputs {args.output}; model {Path(path).name}; median of {args.rounds} alternating rounds\n"
    )
    print("pass 1, each mode at each thread setting (the device process pins the host to one core and")
    print("runs the device on the rest, so its device threads are capped at cores - 1):\n")
    print("| mode | threads | output tok/s | device idle | host ms/step | device ms/job |")
    print("|---|---|---|---|---|---|")
    for r in tried:
        print(
            f"| {r['mode']} | {r['threads']} | {r['tok_s']:.0f} | {r['device_idle_fraction']:.1%} | "
            f"{r['host_ms_per_step']:.2f} | {r['device_ms_per_job']:.2f} |"
        )
    print("\npass 2, each mode at its best setting, alternating:\n")
    print("| mode | threads | output tok/s | device idle | host ms/step | device ms/job |")
    print("|---|---|---|---|---|---|")
    for m, s in summary.items():
        print(
            f"| {m} | {s['threads']} | {s['tok_s']:.0f} | {s['device_idle_fraction']:.1%} | "
            f"{s['host_ms_per_step']:.2f} | {s['device_ms_per_job']:.2f} |"
        )
    print(
        f"\noverlap / plain: {result['ratio']:.2f}x; overlap-thread / plain: "
        f"{summary['overlap-thread']['tok_s'] / p['tok_s']:.2f}x (ideal from the plain loop's host and "
        f"device time: {ideal:.2f}x)"
    )
    if out:
        (out / "overlap.json").write_text(json.dumps(result, indent=1))
        from gapless.bench.timeline import draw

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
        print(f"wrote {out}/overlap.json, traces and timeline.png")
    return result


if __name__ == "__main__":
    main()
