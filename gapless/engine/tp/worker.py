"""A rank's process: join the group, build this rank's runner, run the jobs every rank runs.

Rank 0 is the device process of `TPStream`: it runs `gapless.engine.stream`'s device loop unchanged, on a
pipe that broadcasts each message it reads from the host to the other ranks first (`_Broadcasting`). The
other ranks build the same runner and run each broadcast job; their results stay with them (rank 0's go
to the host, and every rank sampled the same tokens). A "stop" reaches every rank the same way.

Errors go back on the rank's own pipe to the process that started it, which names the rank; a rank
whose parent dies is ended by the kernel (`_die_with_parent`), so no rank outlives its engine.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import pickle
import signal
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from gapless.config import EngineConfig
from gapless.engine.heap import frozen_heap
from gapless.engine.runner import pick_device
from gapless.engine.stream.__main__ import _device_main, _send_error
from gapless.engine.stream.chaos import make_runner
from gapless.model import parallel


@dataclass(frozen=True)
class RankSpec:
    """One rank's place: its rank and the group's size, its index on its node (its GPU), rank 0's
    address, and its torch threads."""

    rank: int
    size: int
    local_rank: int
    addr: str
    threads: int


class _Broadcasting:
    """Rank 0's pipe to the host, as `_device_main` uses it: each message read from the host is
    broadcast to the other ranks before rank 0 acts on it."""

    def __init__(self, conn: Connection, group: parallel.TPGroup) -> None:
        self.conn, self.group = conn, group

    def recv_bytes(self) -> bytes:
        data = self.conn.recv_bytes()
        try:
            return self.group.broadcast_bytes(data)
        except BaseException as e:  # noqa: BLE001 - a rank is gone: tell the host, end the loop
            _send_error(self.conn, e)
            raise EOFError from e

    def send_bytes(self, data: bytes) -> None:
        self.conn.send_bytes(data)


def rank_config(cfg: EngineConfig, spec: RankSpec) -> EngineConfig:
    """`cfg` as this rank runs it: on CUDA, on its own GPU (the node's `local_rank`-th), and without CUDA
    graphs unless asked for (capturing NCCL collectives in graphs is untested here)."""
    if pick_device(cfg.device).type == "cuda":
        graphs = 0 if cfg.cuda_graph_max_bs is None else cfg.cuda_graph_max_bs
        return dataclasses.replace(cfg, device=f"cuda:{spec.local_rank}", cuda_graph_max_bs=graphs)
    return cfg


def _follow(conn: Connection, cfg: EngineConfig, group: parallel.TPGroup) -> None:
    """A rank other than 0: build the runner, then run each broadcast job until the stop."""
    try:
        runner = make_runner(cfg)
        with frozen_heap(collect=True):  # what start-up built lives as long as the process
            while True:
                msg = pickle.loads(group.broadcast_bytes(None))
                if msg[0] == "stop":
                    return
                runner.run(msg[2])
    except BaseException as e:  # noqa: BLE001 - handed to the process that started this rank
        _send_error(conn, e)


def run_rank(conn: Connection, cfg: EngineConfig, spec: RankSpec) -> None:
    """Join the group, then serve as rank 0 (the device loop, fed by the host) or as a follower."""
    torch.set_num_threads(spec.threads)
    cfg = rank_config(cfg, spec)
    try:
        group = parallel.connect(spec.addr, spec.rank, spec.size, cfg.dist_timeout, pick_device(cfg.device))
    except BaseException as e:  # noqa: BLE001
        _send_error(conn, e)
        return
    parallel.use(group)
    threading.Thread(target=_heartbeat, args=(group, spec.rank), name="heartbeat", daemon=True).start()
    if spec.rank == 0:
        _device_main(_Broadcasting(conn, group), cfg, None, None)
    else:
        _follow(conn, cfg, group)


def _heartbeat(group: parallel.TPGroup, rank: int, every: float = 0.5) -> None:
    """Count up `beat/RANK` in the group's store every `every` seconds while this process runs (a rank
    waiting in a collective still beats: its wait releases the GIL), so that when a collective fails the
    engine can name a rank that stopped (`LocalRanks.blame_hung`)."""
    beat = 0
    with contextlib.suppress(Exception):  # the store is gone: the group is over
        while True:
            beat += 1
            group.store.set(f"beat/{rank}", str(beat))
            time.sleep(every)


def _die_with_parent() -> None:
    """Have the kernel end this process when its parent dies (Linux; elsewhere the pipe's EOF does)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def rank_entry(fd: int) -> None:
    """`python -m gapless.engine.tp FD`: read the config and this rank's spec from the pipe and run.
    SIGINT is ignored: the process that started the rank decides when it stops."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    conn = Connection(fd)
    cfg, spec = pickle.loads(conn.recv_bytes())
    with contextlib.suppress(EOFError, OSError):  # the parent went away: end quietly
        run_rank(conn, cfg, spec)
    # without the interpreter's teardown, where destroying a live gloo group aborts the process
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
