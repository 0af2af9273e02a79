"""The bubble meter: host time per step, device time per job, and the device's idle time while work
was pending. It writes these figures into the engine's `EngineStats`, and optionally keeps every span
for a Chrome/Perfetto trace."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

from gapless.engine.stats import EngineStats


class BubbleMeter:
    """Fills the time figures of an `EngineStats` (`steps`, `device_jobs`, `device_busy_s` and
    `host_s` with their prefill/decode splits, `device_idle_s`). The scheduler wraps each host span of its
    loop in `span` (and the part of one that is not its own in `paused`), reports each device job
    (`job`), and at the end of a step says what the step launched (`step_done`)."""

    def __init__(self, keep_trace: bool = False, stats: EngineStats | None = None) -> None:
        self.keep_trace = keep_trace
        self._stats = stats if stats is not None else EngineStats()
        self.reset()

    def reset(self) -> None:
        """Zero the meter's figures (the scheduler's counters beside them keep counting) and its trace."""
        st = self._stats
        st.steps = st.device_jobs = st.prefill_steps = st.decode_steps = 0
        st.device_busy_s = st.device_idle_s = st.host_s = st.prefill_host_s = st.decode_host_s = 0.0
        st.prefill_device_s = st.decode_device_s = 0.0
        self._step_host = 0.0  # host time of the step under way
        self._last_end: float | None = None
        self.spans: list[tuple[str, str, float, float]] = []  # (track, name, start, end)
        self._open: list | None = None  # [name, start] of the innermost span under way

    @contextmanager
    def span(self, name: str, record: bool = True) -> Iterator[None]:
        """Meter the block as host span `name` (unless not `record`), less any part of it `paused`."""
        outer, self._open = self._open, [name, time.perf_counter()]
        try:
            yield
        finally:
            name, start = self._open
            if record:
                self.host_span(name, start, time.perf_counter())
            self._open = outer

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Inside a span, a block that is not its time (a wait for the device, and spans of its own): the
        span's part so far is metered now, and it goes on after the block."""
        if self._open is None:
            yield
            return
        self.host_span(self._open[0], self._open[1], time.perf_counter())
        try:
            yield
        finally:
            self._open[1] = time.perf_counter()

    def stats(self) -> EngineStats:
        """The figures this meter writes into."""
        return self._stats

    def host_span(self, name: str, start: float, end: float) -> None:
        self._stats.host_s += end - start
        self._step_host += end - start
        if self.keep_trace:
            self.spans.append(("host", name, start, end))

    def step_done(self, launched: str | None = None, idle: bool = False) -> None:
        """The step is over; it launched a batch of kind `launched` ("extend" or "decode"), or none. `idle`:
        no requests are pending after it (`went_idle`)."""
        st = self._stats
        st.steps += 1
        if launched == "extend":
            st.prefill_steps += 1
            st.prefill_host_s += self._step_host
        elif launched == "decode":
            st.decode_steps += 1
            st.decode_host_s += self._step_host
        self._step_host = 0.0
        if idle:
            self.went_idle()

    def job(self, name: str, start: float, end: float, idle: float = 0.0) -> None:
        """A device job of kind `name` ("extend" or "decode") ran [start, end], waiting `idle` of it (a
        sampling deferred for its mask); the gap since the previous job was a bubble."""
        st = self._stats
        busy = end - start - idle
        st.device_jobs += 1
        st.device_busy_s += busy
        if name == "extend":
            st.prefill_device_s += busy
        elif name == "decode":
            st.decode_device_s += busy
        st.device_idle_s += idle
        if self._last_end is not None:
            st.device_idle_s += max(0.0, start - self._last_end)
        self._last_end = end
        if self.keep_trace:
            self.spans.append(("device", name, start, end))

    def went_idle(self) -> None:
        """No requests pending: the device's wait until the next job is not a bubble."""
        self._last_end = None

    def write_trace(self, path: str | os.PathLike[str]) -> None:
        """Chrome trace-event JSON (open in Perfetto or chrome://tracing): one track host, one device."""
        t0 = min((s for _, _, s, _ in self.spans), default=0.0)
        tids = {"host": 1, "device": 2}
        events: list[dict] = [
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": track}}
            for track, tid in tids.items()
        ]
        for track, name, start, end in self.spans:
            events.append(
                {
                    "name": name,
                    "ph": "X",
                    "pid": 1,
                    "tid": tids[track],
                    "ts": (start - t0) * 1e6,
                    "dur": (end - start) * 1e6,
                }
            )
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
