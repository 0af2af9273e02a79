"""The scheduler worker's periodic stats line: its figures over the window since the last line, quiet
while idle, off at an interval of 0 (a live server prints it in test_lifecycle)."""

from __future__ import annotations

import logging

from gapless.server.logs import StatsLog, stats_line

IDLE = {
    "prompt_tokens": 100,
    "cached_prompt_tokens": 60,
    "generated_tokens": 500,
    "running_requests": 0,
    "waiting_requests": 0,
    "kv_total_tokens": 1000,
    "kv_used_tokens": 0,
    "kv_cached_tokens": 50,
}


def test_stats_line_reports_the_window_and_is_quiet_when_idle():
    busy = {
        **IDLE,
        "prompt_tokens": 130,
        "cached_prompt_tokens": 70,
        "generated_tokens": 700,
        "running_requests": 3,
        "waiting_requests": 1,
        "kv_used_tokens": 250,
    }
    assert stats_line(busy, IDLE, 2.0) == (
        "engine: prompt 15.0 tok/s, generation 100.0 tok/s, running 3, waiting 1, KV 25.0% used + 5.0% "
        "cached, prefix cache hits 25.0%"
    )
    assert stats_line(IDLE, IDLE, 10.0) is None  # nothing done, nothing to do
    # a window with no new prompt has no hit rate to show
    decoding = {**busy, "prompt_tokens": 100, "cached_prompt_tokens": 60}
    assert stats_line(decoding, IDLE, 1.0).endswith("prefix cache hits -")


class _Engine:
    def __init__(self) -> None:
        self.calls = 0

    def get_stats(self) -> dict:
        self.calls += 1
        return {**IDLE, "running_requests": 1, "generated_tokens": 500 + self.calls}


def test_stats_log_logs_once_per_interval_and_never_at_zero(caplog):
    caplog.set_level(logging.INFO, logger="gapless.server.logs")
    engine, off = _Engine(), StatsLog(0)
    off.since -= 100
    off.tick(engine)
    assert engine.calls == 0
    every = StatsLog(10)
    every.tick(engine)  # too soon
    assert engine.calls == 0
    every.since -= 10  # as if 10 s passed
    every.tick(engine)
    every.tick(engine)  # too soon again
    assert engine.calls == 1
    (line,) = [r.getMessage() for r in caplog.records]
    # the first window runs from the log's start: all 100 prompt tokens so far, in about 10 s
    assert line.startswith("engine: prompt ") and "running 1, waiting 0" in line, line
    assert 9.0 < float(line.split()[2]) <= 10.0, line
