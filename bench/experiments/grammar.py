"""Device idle time with and without grammars, in one run: `python bench/experiments/grammar.py`.

The overlap benchmark's workload and model (random-weight Qwen3 of size `overlap`, 128 requests running
at once), run free and with every request constrained by a regex (`[a-z ]{4000}`: it cannot end within
the outputs' lengths, so both runs generate the same number of tokens), in the plain loop and in the
overlap loop with the device process, alternating for `--rounds` rounds (medians). In the overlap loop a
constrained decode is launched before its previous token is processed, so its sampling waits for the
mask the host fills while the forward runs (`gapless.engine.scheduler.masks`): the device idle fraction
says how much of that wait the forward hides.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import torch

from gapless.bench import cli
from gapless.bench.overlap import FIGURES, _table, workload_parser
from gapless.bench.runs import run_gapless
from gapless.bench.workload import Workload, random_workload

LOOPS = {
    "plain": {"overlap": False, "cpu_worker": "inline"},
    "overlap": {"overlap": True, "cpu_worker": "process"},
}
GRAMMARS: dict[str, dict[str, Any]] = {"free": {}, "regex": {"regex": "[a-z ]{4000}"}}


def run_once(path: Path, loop: str, grammar: str, work: Workload, max_running: int) -> dict[str, Any]:
    options = dict(LOOPS[loop], max_running_requests=max_running)
    g = run_gapless(path, work, 1, options=options, sampling=GRAMMARS[grammar])
    if g["wrong_length_requests"]:
        raise RuntimeError(f"{g['wrong_length_requests']} requests did not run to their length")
    m = g["meter"]
    return dict(loop=loop, grammar=grammar, tok_s=g["output_tokens_per_s"], **{k: m[k] for k in FIGURES[1:]})


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = workload_parser(__doc__)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", help="JSON file for the results")
    args = ap.parse_args(argv)
    path, _ = cli.model_path(args)
    machine = cli.machine()
    torch.set_num_threads(1)
    vocab = cli.model_info(path)["vocab_size"]
    work = random_workload(args.num_seqs, *args.input, *args.output, vocab_size=vocab, seed=0)
    runs = [
        run_once(path, loop, grammar, work, args.max_running)
        for _ in range(args.rounds)
        for loop in LOOPS
        for grammar in GRAMMARS
    ]
    rows = []
    for loop in LOOPS:
        for grammar in GRAMMARS:
            rs = [r for r in runs if r["loop"] == loop and r["grammar"] == grammar]
            figures = {k: statistics.median(r[k] for r in rs) for k in FIGURES}
            rows.append(
                {"loop": loop, "grammar": grammar, "mode": f"{loop}, {grammar}", "threads": 1, **figures}
            )
    print(
        f"\n{len(work)} requests, {args.max_running} running at once, inputs {args.input}, outputs "
        f"{args.output}; model {Path(path).name}; median of {args.rounds} alternating rounds\n"
    )
    print("\n".join(_table("each loop free and with a regex on every request:", rows)))
    by = {(r["loop"], r["grammar"]): r for r in rows}
    for loop in LOOPS:
        print(
            f"{loop}: regex / free throughput {by[loop, 'regex']['tok_s'] / by[loop, 'free']['tok_s']:.2f}x"
        )
    result = {"args": vars(args), "model": str(path), "runs": runs, "summary": rows, "machine": machine}
    if args.out:
        cli.write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
