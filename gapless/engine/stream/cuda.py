"""The CUDA stream: forwards run on a CUDA stream of their own, results come back through pinned memory."""

from __future__ import annotations

import time

import torch

from gapless.engine.batch import ForwardBatch, HostSamples
from gapless.engine.runner import ModelRunner
from gapless.engine.stream.base import JobResult, JobTiming, Pending
from gapless.sampling.sampler import SampleOutput
from gapless.tensors import dataclass_to_device


class _CudaPending:
    def __init__(
        self,
        out: SampleOutput,
        host: list[torch.Tensor],
        start: torch.cuda.Event,
        done: torch.cuda.Event,
        submit: float,
    ) -> None:
        self.out, self.host, self.start, self.done, self.submit = out, host, start, done, submit

    def result(self) -> JobResult:
        self.done.synchronize()
        # device times from events, placed on the host clock by the wait's end
        end = time.perf_counter()
        dur = self.start.elapsed_time(self.done) / 1e3
        return JobResult(
            HostSamples.from_tensors(self.out, self.host), JobTiming(self.submit, end - dur, end)
        )


class CudaStream:
    """Forward and sampling run on their own CUDA stream, after whatever the scheduling stream queued
    (`wait_stream`); the sampled tokens are copied to pinned host memory and an event marks the batch
    done. The host never waits except in `result()`, on that event."""

    asynchronous = True

    def __init__(self, runner: ModelRunner) -> None:
        self.runner, self.info = runner, runner.info
        self.schedule_stream = torch.cuda.current_stream(runner.device)
        self.forward_stream = torch.cuda.Stream(runner.device)

    def submit(self, batch: ForwardBatch) -> Pending:
        submit = time.perf_counter()
        start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.forward_stream):
            self.forward_stream.wait_stream(self.schedule_stream)
            start.record()
            # inputs are allocated and copied (non-blocking, from pinned memory) on the forward stream,
            # so the caching allocator never hands their memory out while the forward may read it
            batch = dataclass_to_device(batch, self.runner.device)
            out = self.runner.run(batch)
            host = []
            for t in out.tensors():
                host.append(torch.empty(t.shape, dtype=t.dtype, pin_memory=True))
                host[-1].copy_(t, non_blocking=True)
            done.record()
        return _CudaPending(out, host, start, done, submit)

    def close(self) -> None:
        self.forward_stream.synchronize()
