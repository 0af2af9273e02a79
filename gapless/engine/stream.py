"""The device stream: where forward jobs run, in submission order, while the host goes on.

One interface, `submit(batch) -> Pending` and `Pending.result() -> (samples, timing)`, and four
implementations the scheduler cannot tell apart:

- `InlineStream`: runs the job in the caller's thread at submit (the plain loop; debugging).
- `ThreadStream`: a worker thread executing jobs in FIFO order, futures as events.
- `ProcessStream`: a device process that owns the weights, KV pool, request table and future-token
  slots, fed jobs through a pipe. On a CPU this is what lets host and device really overlap: a worker
  thread shares the GIL with the host loop, and a forward's many small ops each need it (measured:
  see the README). It also makes "the stream owns device state" physical, as on a GPU.
- `CudaStream`: a forward stream separate from the scheduling stream, ordered with `wait_stream`;
  the sampled tokens are copied to pinned host memory with a completion event per batch.

`Chaos` injects seeded random delays into the device side and the host loop so tests shake the
interleavings deterministically.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Protocol

import torch

from gapless.config import EngineConfig
from gapless.engine.batch import ForwardBatch, RunnerInfo
from gapless.engine.runner import ModelRunner
from gapless.sampling.sampler import HostSamples, SampleOutput
from gapless.tensors import dataclass_to_device, from_numpy, to_numpy


@dataclass
class JobTiming:
    """perf_counter seconds (one clock for every process on the machine)."""

    submit: float
    start: float
    end: float


class Chaos:
    """Seeded random sleeps, at most `max_delay` seconds each, with probability `p` per call."""

    def __init__(self, seed: int, max_delay: float = 0.004, p: float = 0.5) -> None:
        self.rng = random.Random(seed)
        self.max_delay, self.p = max_delay, p
        self.lock = threading.Lock()

    def delay(self) -> None:
        with self.lock:
            d = self.rng.uniform(0, self.max_delay) if self.rng.random() < self.p else 0.0
        if d:
            time.sleep(d)


class Pending(Protocol):
    def result(self) -> tuple[HostSamples, JobTiming]:
        """Wait for the job (the one deliberate host wait of the step loop); its sampled tokens."""


class DeviceStream(Protocol):
    info: RunnerInfo
    asynchronous: bool  # False: submit runs the job before returning

    def submit(self, batch: ForwardBatch) -> Pending: ...

    def close(self) -> None: ...


def _run_job(
    runner: ModelRunner, batch: ForwardBatch, chaos: Chaos | None
) -> tuple[HostSamples, float, float]:
    if chaos:
        chaos.delay()
    start = time.perf_counter()
    tokens = HostSamples.from_tensors(runner.run(batch))
    end = time.perf_counter()
    if chaos:
        chaos.delay()
    return tokens, start, end


class _Done:
    def __init__(self, tokens: HostSamples, timing: JobTiming) -> None:
        self._value = (tokens, timing)

    def result(self) -> tuple[HostSamples, JobTiming]:
        return self._value


class InlineStream:
    asynchronous = False

    def __init__(self, runner: ModelRunner, chaos: Chaos | None = None) -> None:
        self.runner, self.chaos, self.info = runner, chaos, runner.info

    def submit(self, batch: ForwardBatch) -> Pending:
        submit = time.perf_counter()
        tokens, start, end = _run_job(self.runner, batch, self.chaos)
        return _Done(tokens, JobTiming(submit, start, end))

    def close(self) -> None:
        pass


class _FuturePending:
    def __init__(self, fut: Future, submit: float) -> None:
        self.fut, self.submit = fut, submit

    def result(self) -> tuple[HostSamples, JobTiming]:
        tokens, start, end = self.fut.result()
        return tokens, JobTiming(self.submit, start, end)


class ThreadStream:
    """A worker thread running jobs in FIFO order. Grad mode is thread-local, so the runner's own
    `inference_mode` decorators matter here."""

    asynchronous = True

    def __init__(self, runner: ModelRunner, chaos: Chaos | None = None) -> None:
        self.runner, self.chaos, self.info = runner, chaos, runner.info
        self.jobs: queue.SimpleQueue[tuple[ForwardBatch, Future] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="gapless-device", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while (job := self.jobs.get()) is not None:
            batch, fut = job
            try:
                fut.set_result(_run_job(self.runner, batch, self.chaos))
            except BaseException as e:  # noqa: BLE001 - handed to the host through the future
                fut.set_exception(e)

    def submit(self, batch: ForwardBatch) -> Pending:
        fut: Future = Future()
        self.jobs.put((batch, fut))
        return _FuturePending(fut, time.perf_counter())

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=10)


def _device_main(
    conn: Any, cfg: EngineConfig, chaos_seed: int | None, threads: int | None, cpus: set[int] | None = None
) -> None:
    """The device process: builds the runner, then runs jobs from the pipe until told to stop."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    if threads:
        torch.set_num_threads(threads)
    try:
        runner = ModelRunner(cfg)
        runner.check_future_reads = chaos_seed is not None
    except BaseException as e:  # noqa: BLE001
        _send_error(conn, e)
        return
    chaos = Chaos(chaos_seed + 1) if chaos_seed is not None else None
    conn.send_bytes(pickle.dumps(("ready", runner.info)))
    while True:
        msg = pickle.loads(conn.recv_bytes())  # EOF when the host is gone: the process ends
        if msg[0] == "stop":
            return
        _, job_id, batch = msg
        try:
            tokens, start, end = _run_job(runner, from_numpy(batch), chaos)
            conn.send_bytes(pickle.dumps(("done", job_id, tokens, start, end)))
        except BaseException as e:  # noqa: BLE001
            _send_error(conn, e)
            return


def _send_error(conn: Any, e: BaseException) -> None:
    """Hand the exception itself to the host (re-raised there), with the device-side traceback."""
    tb = traceback.format_exc()
    try:
        payload = pickle.dumps(("error", e, tb))
    except Exception:  # noqa: BLE001 - an unpicklable exception travels as text
        payload = pickle.dumps(("error", RuntimeError(str(e)), tb))
    conn.send_bytes(payload)


class _ProcessPending:
    def __init__(self, stream: ProcessStream, job_id: int, submit: float) -> None:
        self.stream, self.job_id, self.submit = stream, job_id, submit

    def result(self) -> tuple[HostSamples, JobTiming]:
        tokens, start, end = self.stream._wait(self.job_id)
        return tokens, JobTiming(self.submit, start, end)


class ProcessStream:
    """Jobs run in a device process; the pipe is FIFO, so results come back in submission order.
    Messages are pickled between our own two processes only (never from the network)."""

    asynchronous = True

    def __init__(self, cfg: EngineConfig, chaos_seed: int | None = None, threads: int | None = None) -> None:
        # Host and device on separate cores. Without it, each result the device sends wakes the host
        # on the device's own core (the kernel's wake-affine placement), and the device waits ~2 ms
        # a step for the host to yield it back: measured, that bubble was most of the device's idle
        # time. The host's affinity (and torch threads) are restored by `close()`.
        self._host_affinity: set[int] | None = None
        self._host_threads = torch.get_num_threads()
        device_cpus = None
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if cfg.cpu_affinity and len(cpus) >= 2:
            self._host_affinity = set(cpus)
            os.sched_setaffinity(0, {cpus[0]})
            torch.set_num_threads(1)
            device_cpus = set(cpus[1:])
            threads = min(threads or len(device_cpus), len(device_cpus))  # never more threads than cores
        # A fresh interpreter running this module (not multiprocessing's spawn/forkserver, which
        # re-import the user's main script in the child), connected by a socketpair.
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gapless.engine.stream", str(theirs.fileno())], pass_fds=[theirs.fileno()]
        )
        theirs.close()
        self.conn = Connection(ours.detach())
        self._next_id = 0
        self._done: dict[int, tuple[HostSamples, float, float]] = {}
        try:
            self.conn.send_bytes(pickle.dumps((cfg, chaos_seed, threads, device_cpus)))
            _, self.info = self._recv()
        except BaseException:
            self.close()  # a failed start leaves no process behind and the host's affinity as it was
            raise

    def _recv(self) -> tuple:
        try:
            msg = pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError) as e:
            raise RuntimeError(f"device process died (exit code {self._exit_code()})") from e
        if msg[0] == "error":
            self._exit_code()
            _, exc, tb = msg
            if hasattr(exc, "add_note"):  # Python 3.11+
                exc.add_note(f"raised in the device process:\n{tb}")
            raise exc
        return msg

    def submit(self, batch: ForwardBatch) -> Pending:
        job_id = self._next_id
        self._next_id += 1
        try:
            self.conn.send_bytes(
                pickle.dumps(("run", job_id, to_numpy(batch)), protocol=pickle.HIGHEST_PROTOCOL)
            )
        except OSError as e:
            raise RuntimeError(f"device process died (exit code {self._exit_code()})") from e
        return _ProcessPending(self, job_id, time.perf_counter())

    def _wait(self, job_id: int) -> tuple[HostSamples, float, float]:
        while job_id not in self._done:
            _, done_id, tokens, start, end = self._recv()
            self._done[done_id] = (tokens, start, end)
        return self._done.pop(job_id)

    def _exit_code(self) -> int | None:
        try:
            return self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.conn.send_bytes(pickle.dumps(("stop",)))
            except OSError:
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.conn.close()
        if self._host_affinity is not None:
            os.sched_setaffinity(0, self._host_affinity)
            torch.set_num_threads(self._host_threads)
            self._host_affinity = None


class _CudaPending:
    def __init__(
        self, out: SampleOutput, host: list[torch.Tensor], done: Any, start: Any, submit: float
    ) -> None:
        self.out, self.host, self.done, self.start, self.submit = out, host, done, start, submit

    def result(self) -> tuple[HostSamples, JobTiming]:
        self.done.synchronize()
        # device times from events, placed on the host clock by the wait's end
        end = time.perf_counter()
        dur = self.start.elapsed_time(self.done) / 1e3
        return HostSamples.from_tensors(self.out, self.host), JobTiming(self.submit, end - dur, end)


class CudaStream:
    """Forward and sampling run on their own CUDA stream, after whatever the scheduling stream queued
    (`wait_stream`); the host never waits except in `result()`, on the batch's completion event."""

    asynchronous = True

    def __init__(self, runner: ModelRunner, chaos: Chaos | None = None) -> None:
        self.runner, self.chaos, self.info = runner, chaos, runner.info
        self.schedule_stream = torch.cuda.current_stream(runner.device)
        self.forward_stream = torch.cuda.Stream(runner.device)

    def submit(self, batch: ForwardBatch) -> Pending:
        submit = time.perf_counter()
        if self.chaos:
            self.chaos.delay()
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
        return _CudaPending(out, host, done, start, submit)

    def close(self) -> None:
        self.forward_stream.synchronize()


MIN_CORES_FOR_DEVICE_PROCESS = 4


def make_stream(cfg: EngineConfig) -> tuple[DeviceStream, ModelRunner | None]:
    """The stream this config asks for; also the in-process runner, when there is one.

    On CUDA it is always `CudaStream`. On the CPU, `cpu_worker="auto"` picks the device process when
    overlapping on a machine with at least `MIN_CORES_FOR_DEVICE_PROCESS` cores, and the inline stream
    otherwise: the device process needs a core of its own for the host, and on 2 cores the device's
    compute loses more by giving one up than overlap hides (measured: README, "Why a device process").
    """
    chaos = Chaos(cfg.chaos_seed) if cfg.chaos_seed is not None else None
    worker = cfg.cpu_worker
    if worker == "auto":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        worker = "process" if cfg.overlap and cores >= MIN_CORES_FOR_DEVICE_PROCESS else "inline"
    on_cuda = cfg.device.startswith("cuda") or (cfg.device == "auto" and torch.cuda.is_available())
    if worker == "process" and not on_cuda:
        return ProcessStream(cfg, cfg.chaos_seed, cfg.device_threads), None
    if cfg.device_threads:
        torch.set_num_threads(cfg.device_threads)
    runner = ModelRunner(cfg)
    runner.check_future_reads = chaos is not None
    if runner.device.type == "cuda":
        return CudaStream(runner, chaos), runner
    if worker == "thread":
        return ThreadStream(runner, chaos), runner
    return InlineStream(runner, chaos), runner


def _device_process_entry(fd: int) -> None:
    """`python -m gapless.engine.stream FD`: the device process. It ignores SIGINT (the host decides
    when to stop it) and exits when told to or when the host's end of the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(fd)
    cfg, chaos_seed, threads, cpus = pickle.loads(conn.recv_bytes())
    with contextlib.suppress(EOFError, OSError):  # the host went away: end quietly
        _device_main(conn, cfg, chaos_seed, threads, cpus)


if __name__ == "__main__":
    _device_process_entry(int(sys.argv[1]))
