"""What every device stream offers the scheduler: `submit(batch) -> Pending`, then `Pending.result()`, a
`JobResult`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

from gapless.engine.batch import DeviceJob, HostSamples, RunnerInfo


@dataclass
class JobTiming:
    """perf_counter seconds (one clock for every process on the machine)."""

    submit: float
    start: float
    end: float
    idle: float = 0.0  # of [start, end], the time the device waited inside the job (a deferred mask)


class JobResult(NamedTuple):
    """What a finished job gives the host: its sampled tokens, and when it ran."""

    samples: HostSamples
    timing: JobTiming


class Pending(Protocol):
    def result(self) -> JobResult:
        """Wait for the job (the one deliberate host wait of the step loop); its sampled tokens."""


class DeviceStream(Protocol):
    info: RunnerInfo
    asynchronous: bool  # False: submit runs the job before returning

    def submit(self, batch: DeviceJob) -> Pending: ...

    def close(self) -> None: ...


class Done:
    """The `Pending` of a job that has already run."""

    def __init__(self, samples: HostSamples, timing: JobTiming) -> None:
        self._value = JobResult(samples, timing)

    def result(self) -> JobResult:
        return self._value
