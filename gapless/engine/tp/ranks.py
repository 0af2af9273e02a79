"""This node's rank processes: started, watched, stopped.

Each rank is a fresh interpreter (`python -m gapless.engine.tp FD`) joined to this process by a socket
pair, on which it reports an error if it fails (rank 0 also answers jobs on it: `TPStream`). Watching
means: a rank that exits or reports an error while the engine waits on rank 0 ends the wait with an
error naming the rank (`check`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import subprocess
import sys
import time
from multiprocessing.connection import Connection, wait

from gapless.config import EngineConfig
from gapless.engine.stream.process import start_module
from gapless.engine.tp.worker import RankSpec
from gapless.model import parallel

log = logging.getLogger(__name__)


class RankFailed(RuntimeError):
    """A tensor-parallel rank died, hung or raised; the message names it."""


class RankRefused(RankFailed, ValueError):
    """A rank raised a ValueError (the configuration or checkpoint refused, as its model loaded): its
    message as it is, which a server still starting prints alone (`server.workers.child`)."""


def node_ranks(cfg: EngineConfig) -> range:
    """The ranks `cfg.node_rank`'s node runs: an equal share of `tensor_parallel_size`, in order."""
    per_node = cfg.tensor_parallel_size // cfg.nnodes
    return range(cfg.node_rank * per_node, (cfg.node_rank + 1) * per_node)


class LocalRanks:
    """This node's ranks (`node_ranks`), started in order; `procs[i]` / `conns[i]` is `ranks[i]`'s."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.ranks = node_ranks(cfg)
        self.size = cfg.tensor_parallel_size
        addr = cfg.dist_init_addr or "127.0.0.1:0"
        # node 0 serves the group's store (`serve_store`), so it outlives the ranks and tells which hung
        self.store = parallel.serve_store(addr, cfg.dist_timeout) if cfg.node_rank == 0 else None
        if self.store is not None:
            addr = f"{addr.rpartition(':')[0]}:{self.store.port}"
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = cfg.device_threads or max(1, cores // len(self.ranks))
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        try:
            for local, rank in enumerate(self.ranks):
                spec = RankSpec(rank, cfg.tensor_parallel_size, local, addr, threads)
                self._start(cfg, spec)
        except BaseException:
            self.stop(0.0)
            raise

    def _start(self, cfg: EngineConfig, spec: RankSpec) -> None:
        proc, conn = start_module("gapless.engine.tp", (cfg, spec))
        self.procs.append(proc)
        self.conns.append(conn)

    def failure(self, i: int) -> RankFailed:
        """Why rank `ranks[i]` is gone: the error it sent, or its exit code."""
        rank, conn = self.ranks[i], self.conns[i]
        with contextlib.suppress(EOFError, OSError):
            if conn.poll():
                msg = pickle.loads(conn.recv_bytes())
                if msg[0] == "error":
                    err = (
                        RankRefused(str(msg[1]))
                        if isinstance(msg[1], ValueError)
                        else RankFailed(f"tensor-parallel rank {rank} failed: {msg[1]!r}")
                    )
                    if sys.version_info >= (3, 11):  # notes are Python 3.11's
                        err.add_note(f"raised in rank {rank}:\n{msg[2]}")
                    return err
        code = None
        with contextlib.suppress(subprocess.TimeoutExpired):
            code = self.procs[i].wait(timeout=5)
        return RankFailed(f"tensor-parallel rank {rank} died (exit code {code})")

    def check(self, skip: int | None = None, grace: float = 0.0) -> None:
        """Raise `RankFailed` for the first rank (but `ranks[skip]`) that has exited or sent something
        (only errors come unasked), waiting up to `grace` seconds for one to."""
        end = time.monotonic() + grace
        while True:
            watched = [i for i in range(len(self.procs)) if i != skip]
            for i in watched:
                if self.procs[i].poll() is not None:
                    raise self.failure(i)
            ready = wait([self.conns[i] for i in watched], timeout=max(0.0, min(0.1, end - time.monotonic())))
            if ready:
                raise self.failure(next(i for i in watched if self.conns[i] is ready[0]))
            if time.monotonic() >= end:
                return

    def blame_hung(self, window: float = 1.5) -> None:
        """Raise `RankFailed` for the first rank of the group (any node) whose heartbeat
        (`worker._heartbeat`) did not move in `window` seconds: a stopped or stuck process."""
        if self.store is None:
            return
        store, keys = self.store, [f"beat/{r}" for r in range(self.size)]
        first = [store.get(k) if store.check([k]) else b"" for k in keys]
        time.sleep(window)
        # (a rank of this node that has exited, as rank 0 does after reporting the failure, beats no more)
        gone = {rank for rank, proc in zip(self.ranks, self.procs) if proc.poll() is not None}
        for rank, (key, was) in enumerate(zip(keys, first)):
            if rank not in gone and (store.get(key) if store.check([key]) else b"") == was:
                raise RankFailed(
                    f"tensor-parallel rank {rank} stopped answering: its heartbeat did not move for "
                    f"{window:g} s (it hung, or died on another node)"
                )

    def wait_for(self, i: int, poll: float = 0.2) -> None:
        """Until `conns[i]` has a message, raising `RankFailed` if another rank fails first."""
        while not self.conns[i].poll(poll):
            self.check(skip=i)

    def stop(self, timeout: float = 10.0) -> None:
        """Wait up to `timeout` seconds for every rank to exit (a stop was sent), then kill the rest."""
        end = time.monotonic() + timeout
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, end - time.monotonic()))
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for conn in self.conns:
            conn.close()


def run_node(cfg: EngineConfig) -> int:
    """A node other than 0: run its ranks until rank 0 stops them (0) or one of them fails (1, with the
    error logged, the others killed). SIGTERM or SIGINT stops them too (0)."""
    ranks = LocalRanks(cfg)
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not stopping:
            codes = [p.poll() for p in ranks.procs]
            for i, code in enumerate(codes):
                if code not in (None, 0) or (code is None and ranks.conns[i].poll()):
                    log.error("%s", ranks.failure(i))
                    return 1
            if all(code == 0 for code in codes):
                return 0
            time.sleep(0.2)
        return 0
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        ranks.stop(0.0 if stopping else 10.0)
