"""The device process stream: on a CPU, the one that really overlaps host and device.

A worker thread shares the GIL with the host loop, and a forward's many small ops each need it
(measured: see the README). So the device side runs in a process of its own that owns the weights, KV
pool, request table and future-token slots, as a GPU would ("the stream owns device state"), fed jobs
through a pipe. This module is the host's side; the device process runs `python -m gapless.engine.stream`.

`HostPinning` is the step that gives host and device their own cores: `make_stream` takes it before it
starts the stream (and undoes it if the start fails), the stream undoes it when it closes.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from typing import NamedTuple

import torch

from gapless.config import EngineConfig
from gapless.engine.batch import DeviceJob, ForwardBatch, HostSamples, decode_from_bytes, plain_decode_buffer
from gapless.engine.stream.base import JobResult, JobTiming, Pending
from gapless.tensors import dumps


class HostPinning:
    """This (the host) process on the first of its cores with one torch thread; the others are left to
    the device process (`device_cpus`).

    Without it, each result the device sends wakes the host on the device's own core (the kernel's
    wake-affine placement), and the device waits ~2 ms a step for the host to yield it back: measured,
    that bubble was most of the device's idle time. `restore()` gives the host back the affinity and
    torch thread count it had.
    """

    def __init__(self, cpus: list[int]) -> None:
        self.host_cpus, self.device_cpus = set(cpus), set(cpus[1:])
        self.host_threads = torch.get_num_threads()
        os.sched_setaffinity(0, {cpus[0]})
        torch.set_num_threads(1)
        self.pinned = True

    @classmethod
    def pin(cls) -> HostPinning | None:
        """Pin the host now; None (nothing changed) where there are fewer than 2 cores to split."""
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        return cls(cpus) if len(cpus) >= 2 else None

    def restore(self) -> None:
        if self.pinned:
            os.sched_setaffinity(0, self.host_cpus)
            torch.set_num_threads(self.host_threads)
            self.pinned = False


class Child(NamedTuple):
    """A process this one started (`start_module`), and its end of the socketpair to it."""

    proc: subprocess.Popen
    conn: Connection


def start_module(module: str, payload: object) -> Child:
    """A fresh interpreter running `python -m module FD`, connected to this process by a socketpair (FD
    is its end), and sent `payload` (pickled) as its first message. A fresh interpreter, not
    multiprocessing's spawn/forkserver, which re-import the user's main script in the child. Nothing is
    left running if this raises."""
    ours, theirs = socket.socketpair()
    conn = Connection(ours.detach())
    proc = None
    try:
        with theirs:
            proc = subprocess.Popen(
                [sys.executable, "-m", module, str(theirs.fileno())], pass_fds=[theirs.fileno()]
            )
        conn.send_bytes(pickle.dumps(payload))
    except BaseException:
        if proc is not None:
            proc.kill()
            proc.wait()
        conn.close()
        raise
    return Child(proc, conn)


class _DecodeOnWire:
    """A plain decode batch as it crosses the pipe: its buffer's bytes, its size, its longest sequence
    and its sampling flags. Unpickled, it is the `ForwardBatch` again (`decode_from_bytes`), so every
    reader of the pipe (the device process, a tensor-parallel rank) gets the batch it always got."""

    __slots__ = ("args",)

    def __init__(self, buf: torch.Tensor, batch: ForwardBatch) -> None:
        self.args = (buf.numpy().tobytes(), batch.rows.shape[0], batch.max_seq_len, batch.sampling)

    def __reduce__(self) -> tuple:
        return decode_from_bytes, self.args


def _job_message(job_id: int, batch: DeviceJob) -> bytes:
    """The pipe's message for a job: a plain decode (nearly every step) as `_DecodeOnWire`, which costs a
    fraction of pickling its dataclass of tensor views; anything else through `gapless.tensors.dumps`."""
    if isinstance(batch, ForwardBatch) and (buf := plain_decode_buffer(batch)) is not None:
        return pickle.dumps(("run", job_id, _DecodeOnWire(buf, batch)), protocol=pickle.HIGHEST_PROTOCOL)
    return dumps(("run", job_id, batch))


class _ProcessPending:
    def __init__(self, stream: ProcessStream, job_id: int, submit: float) -> None:
        self.stream, self.job_id, self.submit = stream, job_id, submit

    def result(self) -> JobResult:
        samples, start, end = self.stream._wait(self.job_id)
        return JobResult(samples, JobTiming(self.submit, start, end))


class ProcessStream:
    """Jobs run in a device process; the pipe is FIFO, so results come back in submission order.
    Messages are pickled between our own two processes only (never from the network); a batch's tensors
    travel as their host buffers, each written once (`gapless.tensors.dumps`)."""

    asynchronous = True

    def __init__(self, cfg: EngineConfig, pinning: HostPinning | None = None) -> None:
        """Start the device process and wait until its runner is built (its errors are raised here, with
        no process left behind). With `pinning` (already applied to this process), the device process
        runs on `pinning.device_cpus`, with no more torch threads than those, and `close()` restores it."""
        self.pinning = pinning
        self._next_id = 0
        self._done: dict[int, tuple[HostSamples, float, float]] = {}
        self.proc: subprocess.Popen | None = None
        self.conn: Connection | None = None
        try:
            self.proc, self.conn = self._start(cfg)
            _, self.info = self._recv()
        except BaseException:
            self._stop()
            raise

    def _start(self, cfg: EngineConfig) -> tuple[subprocess.Popen, Connection]:
        """The device process and its connection (a subclass may start it otherwise)."""
        threads, device_cpus = cfg.device_threads, None
        if self.pinning is not None:
            device_cpus = self.pinning.device_cpus
            threads = min(threads or len(device_cpus), len(device_cpus))
        return start_module("gapless.engine.stream", (cfg, threads, device_cpus))

    @property
    def _pipe(self) -> Connection:
        """The connection to the device process (set with it, in `__init__`)."""
        if self.conn is None:
            raise RuntimeError("the device process was never started")
        return self.conn

    def _recv(self) -> tuple:
        try:
            msg = pickle.loads(self._pipe.recv_bytes())
        except (EOFError, OSError) as e:
            raise RuntimeError(f"device process died (exit code {self._exit_code()})") from e
        if msg[0] == "error":
            self._exit_code()
            _, exc, tb = msg
            if hasattr(exc, "add_note"):  # Python 3.11+
                exc.add_note(f"raised in the device process:\n{tb}")
            raise exc
        return msg

    def submit(self, batch: DeviceJob) -> Pending:
        job_id = self._next_id
        self._next_id += 1
        try:
            self._pipe.send_bytes(_job_message(job_id, batch))
        except OSError as e:
            raise RuntimeError(f"device process died (exit code {self._exit_code()})") from e
        return _ProcessPending(self, job_id, time.perf_counter())

    def _wait(self, job_id: int) -> tuple[HostSamples, float, float]:
        while job_id not in self._done:
            _, done_id, tokens, start, end = self._recv()
            self._done[done_id] = (tokens, start, end)
        return self._done.pop(job_id)

    def _exit_code(self) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        self._stop()
        if self.pinning is not None:
            self.pinning.restore()

    def _stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self._pipe.send_bytes(pickle.dumps(("stop",)))
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.conn is not None:
            self.conn.close()
