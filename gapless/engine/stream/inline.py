"""The inline stream: each job runs in the caller's thread, inside `submit`."""

from __future__ import annotations

import time

from gapless.engine.batch import ForwardBatch, HostSamples
from gapless.engine.runner import ModelRunner
from gapless.engine.stream.base import Done, JobTiming, Pending


class InlineStream:
    """No overlap: `submit` returns when the job is done. On a CPU, `cpu_worker="auto"` picks it for the
    plain loop, and for the overlap loop where a device process would cost more than overlap hides (fewer
    than 4 cores, see `stream.cpu_worker`). The worker thread and the device process run their jobs
    through one too."""

    asynchronous = False

    def __init__(self, runner: ModelRunner) -> None:
        self.runner, self.info = runner, runner.info

    def submit(self, batch: ForwardBatch) -> Pending:
        start = time.perf_counter()
        samples = HostSamples.from_tensors(self.runner.run(batch))
        return Done(samples, JobTiming(start, start, time.perf_counter()))

    def close(self) -> None:
        pass
