"""The scheduler's device stream under tensor parallelism: `ProcessStream`'s protocol, with rank 0 as
the device process and every rank of this node watched while the host waits."""

from __future__ import annotations

import subprocess
from multiprocessing.connection import Connection

from gapless.config import EngineConfig
from gapless.engine.stream.process import ProcessStream
from gapless.engine.tp.ranks import LocalRanks, RankFailed
from gapless.model.parallel import CollectiveError


class TPStream(ProcessStream):
    """Jobs go to rank 0 (which broadcasts each to the other ranks and runs it), results come back from
    it, in submission order. While the host waits for rank 0, a rank that dies or reports an error ends
    the wait with a `RankFailed` naming it; a failed collective rank 0 reports (`CollectiveError`: another
    rank is gone or stuck) is raised as that other rank's failure when one is found, and rank 0 ending
    without a word as its own."""

    asynchronous = True

    def __init__(self, cfg: EngineConfig) -> None:
        if cfg.node_rank != 0:
            raise ValueError(
                f"node_rank={cfg.node_rank} runs ranks only, no engine: start it with `gapless serve "
                f"--nnodes {cfg.nnodes} --node-rank {cfg.node_rank} ...`"
            )
        self.failed = False  # a rank failed: stopping kills the rest at once (none will stop cleanly)
        self.ranks: LocalRanks | None = None
        super().__init__(cfg)

    def _start(self, cfg: EngineConfig) -> tuple[subprocess.Popen, Connection]:
        """Every rank of this node; rank 0 is the device process the scheduler talks to."""
        self.ranks = LocalRanks(cfg)
        return self.ranks.procs[0], self.ranks.conns[0]

    def _recv(self) -> tuple:
        try:
            return self._recv_from_rank0()
        except RankFailed:
            self.failed = True
            raise

    def _recv_from_rank0(self) -> tuple:
        ranks = self.ranks
        assert ranks is not None, "the ranks start (`_start`) before anything is received"
        ranks.wait_for(0)
        try:
            return super()._recv()
        except CollectiveError:
            # a failed collective on rank 0: another rank that died, or hung, is the cause to name
            ranks.check(skip=0, grace=2.0)
            ranks.blame_hung()
            raise
        except RuntimeError as e:
            if isinstance(e.__cause__, (EOFError, OSError)):  # rank 0 itself is gone, saying nothing
                raise ranks.failure(0) from e
            raise

    def _stop(self) -> None:
        if not self.failed:
            super()._stop()  # tells rank 0 to stop, which tells the others
        if self.ranks is not None:  # (LocalRanks stops what it started if it fails itself)
            self.ranks.stop(0.0 if self.failed else 10.0)  # after a failure: kill what is left at once
