"""Which processes `gapless serve` runs its workers in, chosen from the machine's cores.

- `split`: the tokenizer, the scheduler (engine + model runner) and the detokenizer each in a process
  of their own, beside the API server: each stage gets a core when the machine has them.
- `merged`: the tokenizer and the detokenizer share one process (`tokenizer+detokenizer`), beside the
  API server and the scheduler: on a machine with few cores, one process fewer that wakes every step
  beside the model.
- `auto` (the default): `merged` below `MIN_CORES_FOR_SPLIT` usable cores, else `split`.

Both layouts run the same stage code on the same sockets and messages (`gapless.server.workers`); only
which process binds which address differs. This module imports nothing heavy: the command line's parser
uses it.
"""

from __future__ import annotations

import os

LAYOUTS = ("auto", "split", "merged")
# One busy process per stage (API server, tokenizer, scheduler, detokenizer) needs four cores; below
# that the tokenizer and detokenizer share one (README, "Process layout": on 2 cores the measured
# throughput difference is within the noise either way).
MIN_CORES_FOR_SPLIT = 4


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def choose_layout(requested: str, cores: int | None = None) -> str:
    """`requested` with `auto` settled for `cores` (default: this machine's usable cores)."""
    if requested not in LAYOUTS:
        raise ValueError(f"process layout must be one of {', '.join(LAYOUTS)}, not {requested!r}")
    if requested != "auto":
        return requested
    cores = usable_cores() if cores is None else cores
    return "split" if cores >= MIN_CORES_FOR_SPLIT else "merged"


def worker_stages(layout: str) -> list[tuple[str, ...]]:
    """The text stages of each text worker process: one process per tuple (the scheduler aside)."""
    if layout == "merged":
        return [("tokenizer", "detokenizer")]
    return [("tokenizer",), ("detokenizer",)]


def describe(requested: str, layout: str, cores: int | None = None) -> str:
    """The start-up line's words for the chosen layout, and why."""
    cores = usable_cores() if cores is None else cores
    why = f"auto, {cores} cores" if requested == "auto" else "--process-layout"
    if layout == "merged":
        return f"process layout merged ({why}): tokenizer and detokenizer share one process"
    return f"process layout split ({why}): tokenizer, scheduler and detokenizer in a process each"
