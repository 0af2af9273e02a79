"""Test support, never on by default: seeded random delays around any stream, and a runner that checks
every future-token slot a decode reads.

`make_stream` installs both when `EngineConfig.chaos_seed` is set (a testing-only option): a
`ChaosStream` around the stream the host submits to, shaking the host loop (delays before a launch and
before a batch's results are processed), and another around the jobs the device side runs (delays
before and after each job; in the worker thread or the device process, which builds its own runner).
A seed fixes the sequence of delays (not the threads' own timing), so several seeds shake different
interleavings.

`FutureCheckingRunner` marks a row's future-token slot consumed (-1) once a decode has read it, and
raises when a decode would read a slot the sampler has not written since: overlap scheduling must never
launch a decode before the batch that samples its input.
"""

from __future__ import annotations

import random
import time

import torch

from gapless.config import EngineConfig
from gapless.engine.batch import DeviceJob, ForwardBatch
from gapless.engine.cpu_compile import warm_up
from gapless.engine.runner import ModelRunner
from gapless.engine.stream.base import DeviceStream, JobResult, Pending


class Chaos:
    """Seeded random sleeps, at most `max_delay` seconds each, with probability `p` per call."""

    def __init__(self, seed: int, max_delay: float = 0.004, p: float = 0.5) -> None:
        self.rng = random.Random(seed)
        self.max_delay, self.p = max_delay, p

    def delay(self) -> None:
        d = self.rng.uniform(0, self.max_delay) if self.rng.random() < self.p else 0.0
        if d:
            time.sleep(d)


class _ChaosPending:
    def __init__(self, pending: Pending, chaos: Chaos) -> None:
        self.pending, self.chaos = pending, chaos

    def result(self) -> JobResult:
        self.chaos.delay()
        return self.pending.result()


class ChaosStream:
    """`stream`, with a random delay before each `submit` and before each `Pending.result()`. Both run
    in the thread that uses the stream, so one instance must be used from one thread."""

    def __init__(self, stream: DeviceStream, seed: int) -> None:
        self.stream, self.chaos = stream, Chaos(seed)
        self.info, self.asynchronous = stream.info, stream.asynchronous

    def submit(self, batch: DeviceJob) -> Pending:
        self.chaos.delay()
        return _ChaosPending(self.stream.submit(batch), self.chaos)

    def close(self) -> None:
        self.stream.close()


def host_side(stream: DeviceStream, cfg: EngineConfig) -> DeviceStream:
    """The stream the scheduler submits to: with host-loop delays when `cfg.chaos_seed` is set."""
    return stream if cfg.chaos_seed is None else ChaosStream(stream, cfg.chaos_seed)


def device_side(jobs: DeviceStream, cfg: EngineConfig) -> DeviceStream:
    """The synchronous stream a worker thread or the device process runs its jobs through: with delays
    around each job when `cfg.chaos_seed` is set (another seed than the host side's)."""
    return jobs if cfg.chaos_seed is None else ChaosStream(jobs, cfg.chaos_seed + 1)


class FutureCheckingRunner(ModelRunner):
    """A `ModelRunner` that fails loudly when a decode reads an unwritten future-token slot. The check is
    a host sync per decode batch: test machinery only."""

    @torch.inference_mode()
    def forward_hidden(self, batch: ForwardBatch) -> torch.Tensor:
        if not batch.reads_future_tokens:
            return super().forward_hidden(batch)
        if bool((self.token_buf[batch.rows] < 0).any()):
            raise RuntimeError(f"decode read an unwritten future-token slot (rows {batch.rows.tolist()})")
        hidden = super().forward_hidden(batch)
        self.token_buf[batch.rows] = -1  # the forward has read the slots (stream order): consumed
        return hidden


def make_runner(cfg: EngineConfig) -> ModelRunner:
    """The model runner for `cfg`: the checking one when `cfg.chaos_seed` is set; with `cpu_compile` on
    the CPU, its decode layers compiled before it runs anything (`gapless.engine.cpu_compile`)."""
    runner = ModelRunner(cfg) if cfg.chaos_seed is None else FutureCheckingRunner(cfg)
    if cfg.cpu_compile and runner.device.type == "cpu":
        warm_up(runner)
    return runner
