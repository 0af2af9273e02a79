"""The bubble meter: host time per step, device time per job, and the device's idle time while work
was pending. Optionally keeps every span for a Chrome/Perfetto trace."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass


@dataclass
class StepStats:
    steps: int
    device_jobs: int
    device_busy_s: float
    device_idle_s: float  # gaps between consecutive jobs while requests were pending
    host_s: float  # schedule + prepare + process, the waits on the device excluded

    @property
    def device_idle_fraction(self) -> float:
        total = self.device_busy_s + self.device_idle_s
        return self.device_idle_s / total if total > 0 else 0.0

    @property
    def mean_host_ms_per_step(self) -> float:
        return 1e3 * self.host_s / self.steps if self.steps else 0.0

    @property
    def mean_device_ms_per_job(self) -> float:
        return 1e3 * self.device_busy_s / self.device_jobs if self.device_jobs else 0.0


class BubbleMeter:
    def __init__(self, keep_trace: bool = False) -> None:
        self.keep_trace = keep_trace
        self.reset()

    def reset(self) -> None:
        self.steps = self.jobs = 0
        self.busy = self.idle_time = self.host = 0.0
        self._last_end: float | None = None
        self.spans: list[tuple[str, str, float, float]] = []  # (track, name, start, end)

    def host_span(self, name: str, start: float, end: float) -> None:
        self.host += end - start
        if self.keep_trace:
            self.spans.append(("host", name, start, end))

    def step_done(self) -> None:
        self.steps += 1

    def job(self, name: str, start: float, end: float) -> None:
        """A device job ran [start, end]; the gap since the previous job was a bubble."""
        self.jobs += 1
        self.busy += end - start
        if self._last_end is not None:
            self.idle_time += max(0.0, start - self._last_end)
        self._last_end = end
        if self.keep_trace:
            self.spans.append(("device", name, start, end))

    def went_idle(self) -> None:
        """No requests pending: the device's wait until the next job is not a bubble."""
        self._last_end = None

    def stats(self) -> StepStats:
        return StepStats(self.steps, self.jobs, self.busy, self.idle_time, self.host)

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
