"""Summarize py-spy's collapsed stacks (`py-spy record --format raw`) of a served run, one file per process,
so a profile of the server's processes reads as a short table (`bench/profile_served.sh`).

    python bench/experiments/spy.py --rate 200 --seconds 60 bench/results/cpu_profile/c1_pid*.txt

Each line of a raw file is `frame;frame;...;leaf COUNT`, a frame `function (file:line)`. Without `--idle`,
py-spy keeps only the samples where a thread was running (by its OS state), so samples / (rate x
seconds) is the share of the recording that process kept a core busy; native work under a Python frame
(torch's kernels) counts for that frame. A process is named by the worker function on its stacks
(`scheduler_main` -> scheduler, ...; the API server has uvicorn's). For each it prints the functions
holding the most samples, by self time (the leaf) and inclusive time (anywhere on the stack).
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

ROLES = {
    "scheduler_main": "scheduler",
    "tokenizer_main": "tokenizer",
    "detokenizer_main": "detokenizer",
    "device_main": "device",
}
_FUNC = re.compile(r"^(.*?) \((.*?)(?::\d+)?\)$")


def parse(path: Path) -> Counter[tuple[str, ...]]:
    """Stack (outermost first) -> samples."""
    stacks: Counter[tuple[str, ...]] = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stacks[tuple(stack.split(";"))] += int(count)
    return stacks


def short(frame: str) -> str:
    """`function (file)` with the file's path cut to its last two parts and no line number."""
    m = _FUNC.match(frame)
    if not m:
        return frame
    name, file = m.groups()
    return f"{name} ({'/'.join(file.split('/')[-2:])})"


def role(stacks: Counter[tuple[str, ...]]) -> str:
    """The worker this process runs, from the functions on its stacks (api when it runs none)."""
    names = {_FUNC.match(f).group(1) for s in stacks for f in s if _FUNC.match(f)}  # type: ignore[union-attr]
    for func, name in ROLES.items():
        if func in names:
            return name
    return "api" if any("uvicorn" in f for s in stacks for f in s) else "other"


def summarize(path: Path, possible: float, top: int = 12) -> str:
    """One process's table: its busy share of `possible` samples, then its top functions."""
    busy = parse(path)
    nbusy = sum(busy.values())
    lines = [
        f"== {role(busy)} ({path.name}): {nbusy} samples, on a core {100 * nbusy / possible:.1f}% of the run"
    ]
    self_time: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    for stack, n in busy.items():
        self_time[short(stack[-1])] += n
        for frame in {short(f) for f in stack}:
            inclusive[frame] += n
    lines.append("  self (% of busy)")
    lines += [f"    {100 * n / max(nbusy, 1):5.1f}%  {f}" for f, n in self_time.most_common(top)]
    lines.append("  inclusive (% of busy)")
    lines += [f"    {100 * n / max(nbusy, 1):5.1f}%  {f}" for f, n in inclusive.most_common(top)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python bench/experiments/spy.py", description=__doc__.split("\n")[0])
    p.add_argument("--rate", type=float, required=True, help="py-spy's --rate (samples/s)")
    p.add_argument("--seconds", type=float, required=True, help="how long py-spy recorded")
    p.add_argument("files", nargs="+", type=Path)
    args = p.parse_args(argv)
    possible = args.rate * args.seconds
    print("\n\n".join(summarize(f, possible) for f in args.files if f.stat().st_size))


if __name__ == "__main__":
    main()
