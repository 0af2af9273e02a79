"""How every process of the server logs: one format, gapless's own records at the chosen level, and the
periodic stats line of the scheduler worker.

The API server configures its logging from `--log-level` and passes the level to the workers it starts
through `GAPLESS_LOG_LEVEL` (`gapless.env.LOG_LEVEL`, which also serves as the flag's default).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gapless.engine.engine import Engine

log = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s %(processName)s %(levelname)s %(message)s"

Stats = dict[str, float | int | str]  # `Engine.get_stats()`


def configure_logging(level: str) -> None:
    """Log gapless's records at `level` and above and other libraries' at info and above (their debug
    records would drown ours), in one format for every process of the server."""
    number = logging.getLevelName(level.upper())
    logging.basicConfig(level=max(number, logging.INFO), format=LOG_FORMAT)
    logging.getLogger("gapless").setLevel(number)


class StatsLog:
    """A line every `interval_s` seconds while the engine has work, as vLLM prints one: prompt and
    generation throughput since the last line, running and waiting requests, KV use and the prefix-cache
    hit rate. Quiet while idle; an `interval_s` of 0 turns it off."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.since = time.monotonic()
        self.last: Stats = {}

    def tick(self, engine: Engine) -> None:
        """Log the line if `interval_s` passed since the last one (cheap otherwise: call it every step)."""
        if self.interval_s <= 0 or time.monotonic() - self.since < self.interval_s:
            return
        now, stats = time.monotonic(), dict[str, float | int | str](engine.get_stats())
        line = stats_line(stats, self.last, now - self.since)
        self.since, self.last = now, stats
        if line is not None:
            log.info("%s", line)


def stats_line(now: Stats, before: Stats, seconds: float) -> str | None:
    """The stats line for the `seconds` between two `Engine.get_stats()`; None if the engine did nothing
    in them and has nothing to do."""

    def grew(key: str) -> float:
        return float(now[key]) - float(before.get(key, 0))

    prompt, cached, generated = grew("prompt_tokens"), grew("cached_prompt_tokens"), grew("generated_tokens")
    running, waiting = now["running_requests"], now["waiting_requests"]
    if not (prompt or generated or running or waiting):
        return None
    total = float(now["kv_total_tokens"]) or 1.0
    hits = f"{100 * cached / (prompt + cached):.1f}%" if prompt + cached else "-"
    return (
        f"engine: prompt {prompt / seconds:.1f} tok/s, generation {generated / seconds:.1f} tok/s, "
        f"running {running}, waiting {waiting}, KV {100 * float(now['kv_used_tokens']) / total:.1f}% used "
        f"+ {100 * float(now['kv_cached_tokens']) / total:.1f}% cached, prefix cache hits {hits}"
    )
