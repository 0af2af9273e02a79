"""Ratio tables between serving runs: gapless against another OpenAI-compatible server (llama.cpp's
`llama-server`, vLLM, ...) measured by `gapless.bench.serving` with the same workload.

    python -m gapless.bench.compare bench/results/llamacpp_cpu      # files <engine>_c<C>.summary.json

`serving --compare-base-url URL` prints the same table for one concurrency; `bench/llamacpp_cpu.sh`
writes the files this reads. The first engine named (gapless, when present) is the numerator of every
ratio: above 1.0 it serves more output tokens per second than the other. Engines named
`gapless-<FILE>` and `llama.cpp-<FILE>` (the same GGUF file served by each) are also set side by side,
one row per file, one column per concurrency: `same_file_table`.
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


_GAPLESS, _LLAMA = "gapless-", "llama.cpp-"


def same_file_table(found: dict[int, dict[str, dict[str, Any]]]) -> str:
    """One row per file that both engines served (engines `gapless-<FILE>[-<dtype>]` and
    `llama.cpp-<FILE>`), one column per concurrency: "gapless vs llama.cpp tok/s = ratio"; "" if none."""
    cs = list(found)
    rows = sorted({e for by in found.values() for e in by if e.startswith(_GAPLESS)})
    lines = []
    for g in rows:
        other = _LLAMA + g[len(_GAPLESS) :].split("-")[0]
        cells = []
        for c in cs:
            a, b = found[c].get(g), found[c].get(other)
            if a is None or b is None:
                cells.append("-")
                continue
            x, y = a["output_throughput"], b["output_throughput"]
            cells.append(f"{_fmt(x, '.1f')} vs {_fmt(y, '.1f')} = {_fmt(x / y if x and y else None, '.2f')}x")
        if any(cell != "-" for cell in cells):
            lines.append(f"| {g} vs {other} | " + " | ".join(cells) + " |")
    if not lines:
        return ""
    head = "| same file: gapless vs llama.cpp, output tok/s | "
    head += " | ".join(f"{c} requests" for c in cs) + " |"
    return "\n".join([head, "|---|" + "---:|" * len(cs), *lines])


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(prog="python -m gapless.bench.compare", description=__doc__.split("\n")[0])
    p.add_argument("dir", type=Path, help="folder of <engine>_c<C>.summary.json files")
    args = p.parse_args(argv)
    lines = []
    found = load_dir(args.dir)
    for c, summaries in found.items():
        lines += [f"concurrency {c}", ratio_table(summaries), ""]
    pairs = same_file_table(found)
    if pairs:
        lines += [pairs, ""]
    out = "\n".join(lines)
    print(out)
    return out


if __name__ == "__main__":
    main()
