"""The device process of `ProcessStream`: `python -m gapless.engine.stream FD`, FD its end of the pipe.

It builds its own runner (the future-slot checking one under `chaos_seed`) and runs each job through an
inline stream (with device-side chaos delays under `chaos_seed`), in the order the jobs arrive.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Protocol

import torch

from gapless.config import EngineConfig
from gapless.engine.heap import frozen_heap
from gapless.engine.stream.chaos import device_side, make_runner
from gapless.engine.stream.inline import InlineStream


class HostPipe(Protocol):
    """What the device loop needs of its pipe to the host: a `Connection`, or rank 0's broadcasting one
    (`gapless.engine.tp.worker`)."""

    def recv_bytes(self) -> bytes: ...

    def send_bytes(self, data: bytes, /) -> None: ...


def _device_main(conn: HostPipe, cfg: EngineConfig, threads: int | None, cpus: set[int] | None) -> None:
    """The device process: builds the runner, then runs jobs from the pipe until told to stop."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    if threads:
        torch.set_num_threads(threads)
    try:
        jobs = device_side(InlineStream(make_runner(cfg)), cfg)
    except BaseException as e:  # noqa: BLE001
        _send_error(conn, e)
        return
    with frozen_heap(collect=True):  # what start-up built lives as long as the process
        conn.send_bytes(pickle.dumps(("ready", jobs.info)))
        while True:
            msg = pickle.loads(conn.recv_bytes())  # EOF when the host is gone: the process ends
            if msg[0] == "stop":
                return
            _, job_id, batch = msg
            try:
                tokens, timing = jobs.submit(batch).result()
                conn.send_bytes(pickle.dumps(("done", job_id, tokens, timing.start, timing.end)))
            except BaseException as e:  # noqa: BLE001
                _send_error(conn, e)
                return


def _send_error(conn: HostPipe, e: BaseException) -> None:
    """Hand the exception itself to the host (re-raised there), with the device-side traceback."""
    tb = traceback.format_exc()
    try:
        payload = pickle.dumps(("error", e, tb))
    except Exception:  # noqa: BLE001 - an unpicklable exception travels as text
        payload = pickle.dumps(("error", RuntimeError(str(e)), tb))
    conn.send_bytes(payload)


def _device_process_entry(fd: int) -> None:
    """`python -m gapless.engine.stream FD`: the device process. It ignores SIGINT (the host
    decides when to stop it) and exits (status 0) when told to, after sending an error, or when the host's
    end of the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(fd)
    cfg, threads, cpus = pickle.loads(conn.recv_bytes())
    with contextlib.suppress(EOFError, OSError):  # the host went away: end quietly
        _device_main(conn, cfg, threads, cpus)
    # without the interpreter's teardown of torch (a second or two the host would wait for)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _device_process_entry(int(sys.argv[1]))
