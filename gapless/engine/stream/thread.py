"""The thread stream: jobs run on a worker thread, in FIFO order, with futures as events."""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future

from gapless.engine.batch import ForwardBatch
from gapless.engine.stream.base import DeviceStream, JobResult, JobTiming, Pending


class _FuturePending:
    def __init__(self, fut: Future[JobResult], submit: float) -> None:
        self.fut, self.submit = fut, submit

    def result(self) -> JobResult:
        samples, timing = self.fut.result()
        return JobResult(samples, JobTiming(self.submit, timing.start, timing.end))


class ThreadStream:
    """Runs the jobs of `jobs`, a synchronous stream (an `InlineStream`, possibly wrapped), on a worker
    thread. The thread shares the GIL with the host loop, so on a CPU it overlaps less than the device
    process does. Grad mode is thread-local, so the runner's own `inference_mode` decorators matter."""

    asynchronous = True

    def __init__(self, jobs: DeviceStream) -> None:
        self.jobs, self.info = jobs, jobs.info
        self._queue: queue.SimpleQueue[tuple[ForwardBatch, Future] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="gapless-device", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while (job := self._queue.get()) is not None:
            batch, fut = job
            try:
                fut.set_result(self.jobs.submit(batch).result())
            except BaseException as e:  # noqa: BLE001 - handed to the host through the future
                fut.set_exception(e)

    def submit(self, batch: ForwardBatch) -> Pending:
        fut: Future[JobResult] = Future()
        self._queue.put((batch, fut))
        return _FuturePending(fut, time.perf_counter())

    def close(self) -> None:
        self._queue.put(None)
        self.thread.join(timeout=10)
        self.jobs.close()
