"""Ratio tables between serving runs: gapless against another OpenAI-compatible server (llama.cpp's
`llama-server`, vLLM, ...) measured by `gapless.bench.serving` with the same workload.

    python -m gapless.bench.compare bench/results/llamacpp_cpu      # files <engine>_c<C>.summary.json

`serving --compare-base-url URL` prints the same table for one concurrency; `bench/llamacpp_cpu.sh`
writes the files this reads. The first engine named (gapless, when present) is the numerator of every
ratio: above 1.0 it serves more output tokens per second than the other.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

_FILE = re.compile(r"^(?P<engine>.+)_c(?P<c>\d+)\.summary\.json$")


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def ratio_rows(summaries: dict[str, dict[str, Any]]) -> list[str]:
    """One markdown row per engine of one concurrency: output tok/s, TTFT and TPOT p50, and the first
    engine's throughput over this one's (`summaries`: engine -> `serving.summarize`'s dict)."""
    first = next(iter(summaries.values()))["output_throughput"]
    rows = []
    for engine, s in summaries.items():
        tput = s["output_throughput"]
        ratio = first / tput if first and tput else None
        ttft, tpot = _fmt(s["ttft_ms"]["p50"], ".0f"), _fmt(s["tpot_ms"]["p50"], ".1f")
        rows.append(
            f"| {engine} | {s['completed']}/{s['completed'] + s['failed']} | {_fmt(tput, '.1f')} | "
            f"{ttft} | {tpot} | {_fmt(ratio, '.2f')}x |"
        )
    return rows


HEADER = [
    "| engine | requests ok | output tok/s | TTFT p50 ms | TPOT p50 ms | first / this |",
    "|---|---:|---:|---:|---:|---:|",
]


def ratio_table(summaries: dict[str, dict[str, Any]]) -> str:
    """`ratio_rows` under a header."""
    return "\n".join(HEADER + ratio_rows(summaries))


def load_dir(path: Path) -> dict[int, dict[str, dict[str, Any]]]:
    """concurrency -> engine -> summary, from the `<engine>_c<C>.summary.json` files in `path` (engines
    in the order of their first file's name, gapless first)."""
    found: dict[int, dict[str, dict[str, Any]]] = defaultdict(dict)
    files = sorted(path.glob("*_c*.summary.json"), key=lambda f: (not f.name.startswith("gapless"), f.name))
    for f in files:
        m = _FILE.match(f.name)
        if m:
            found[int(m["c"])][m["engine"]] = json.loads(f.read_text())["summary"]
    if not found:
        raise SystemExit(f"error: no <engine>_c<C>.summary.json files in {path}")
    return dict(sorted(found.items()))


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(prog="python -m gapless.bench.compare", description=__doc__.split("\n")[0])
    p.add_argument("dir", type=Path, help="folder of <engine>_c<C>.summary.json files")
    args = p.parse_args(argv)
    lines = []
    for c, summaries in load_dir(args.dir).items():
        lines += [f"concurrency {c}", ratio_table(summaries), ""]
    out = "\n".join(lines)
    print(out)
    return out


if __name__ == "__main__":
    main()
