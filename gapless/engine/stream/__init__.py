"""The device stream: where forward jobs run, in submission order, while the host goes on.

One interface (`base.DeviceStream`): `submit(batch) -> Pending`, `Pending.result() -> JobResult`.
The scheduler runs the same code on every stream; it reads `asynchronous` only to know whether the time
`submit` took is host time (a launch) or the device job itself (the inline stream). The streams:

- `InlineStream` (inline.py): runs the job in the caller's thread, at submit. `cpu_worker="auto"` picks
  it for the plain loop on a CPU, and for the overlap loop where there are too few cores for a device
  process (see `cpu_worker`).
- `ThreadStream` (thread.py): a worker thread running jobs in FIFO order, futures as events.
- `ProcessStream` (process.py): a device process that owns the weights, KV pool, request table and
  future-token slots, fed jobs through a pipe: what really overlaps host and device on a CPU.
- `CudaStream` (cuda.py): a forward stream separate from the scheduling stream, ordered with
  `wait_stream`; the sampled tokens are copied to pinned host memory with a completion event per batch.

Test support (chaos.py): with `chaos_seed` set, `make_stream` wraps the streams in `ChaosStream`s
(seeded random delays on both sides) and builds a `FutureCheckingRunner`.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from gapless.config import EngineConfig
from gapless.engine.runner import ModelRunner
from gapless.engine.stream.base import DeviceStream, JobResult, JobTiming, Pending
from gapless.engine.stream.chaos import device_side, host_side, make_runner
from gapless.engine.stream.cuda import CudaStream
from gapless.engine.stream.inline import InlineStream
from gapless.engine.stream.process import HostPinning, ProcessStream
from gapless.engine.stream.thread import ThreadStream

__all__ = ["DeviceSide", "DeviceStream", "JobResult", "JobTiming", "Pending", "make_stream"]

MIN_CORES_FOR_DEVICE_PROCESS = 4


def cpu_worker(cfg: EngineConfig) -> str:
    """The CPU device side `cfg` asks for, with "auto" settled: the device process when overlapping on a
    machine with at least `MIN_CORES_FOR_DEVICE_PROCESS` cores, else inline. The device process needs a
    core of its own for the host, and on 2 cores the device's compute loses more by giving one up than
    overlap hides (measured: README, "Why a device process")."""
    if cfg.cpu_worker != "auto":
        return cfg.cpu_worker
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return "process" if cfg.overlap and cores >= MIN_CORES_FOR_DEVICE_PROCESS else "inline"


class DeviceSide(NamedTuple):
    """Where the device side of an engine runs: its stream, and the in-process runner when there is one."""

    stream: DeviceStream
    runner: ModelRunner | None  # None: it lives in a device process (or the tensor-parallel ranks)


def make_stream(cfg: EngineConfig) -> DeviceSide:
    """The stream this config asks for; also the in-process runner, when there is one (None: it lives in
    the device process). On CUDA it is always `CudaStream`; on the CPU, see `cpu_worker`.

    The device process gets cores of its own: with `cpu_affinity`, this process is pinned to one core
    (`HostPinning`) until the stream closes. An in-process device side runs on this process's threads,
    so `device_threads` sets them here, for good."""
    if cfg.tensor_parallel_size > 1:  # the ranks' processes (imported here: gapless.engine.tp uses streams)
        from gapless.engine.tp import TPStream

        return DeviceSide(host_side(TPStream(cfg), cfg), None)
    worker = cpu_worker(cfg)
    on_cuda = cfg.device.startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available())
    if worker == "process" and not on_cuda:
        return DeviceSide(host_side(_device_process(cfg), cfg), None)
    if cfg.device_threads:
        torch.set_num_threads(cfg.device_threads)
    runner = make_runner(cfg)
    if runner.device.type == "cuda":
        stream: DeviceStream = CudaStream(runner)
    elif worker == "thread":
        stream = ThreadStream(device_side(InlineStream(runner), cfg))
    else:
        stream = InlineStream(runner)
    return DeviceSide(host_side(stream, cfg), runner)


def _device_process(cfg: EngineConfig) -> ProcessStream:
    """A `ProcessStream`, with this process pinned to one core first when `cpu_affinity` asks for it. The
    stream restores the pinning when it closes; if it fails to start, the pinning is restored here."""
    pinning = HostPinning.pin() if cfg.cpu_affinity else None
    try:
        return ProcessStream(cfg, pinning)
    except BaseException:
        if pinning is not None:
            pinning.restore()
        raise
