"""Tensor parallelism: the model split over ranks, one process per rank, started by gapless itself.

- `ranks.LocalRanks` starts this node's rank processes (`python -m gapless.engine.tp`, a fresh interpreter
  each, as the device process is; no launcher) and watches them: a rank that exits, or reports an
  error, is named in the error that ends the engine.
- `stream.TPStream` is the scheduler's device stream on node 0: the scheduler runs once, in the engine's
  process, and submits each job to rank 0 as it would to the device process (`ProcessStream`); rank 0
  broadcasts the job's bytes to every rank (gloo, on the host) before it runs it, so every rank runs the
  same jobs in the same order on its own KV pool slice and device request table. The host never waits
  on that: the broadcast is part of the job. Overlap stays overlap.
- `worker` is a rank's process: it joins the group (`gapless.model.parallel.connect`), builds its runner
  (the parallel layers shard themselves), then runs jobs: rank 0 from the host's pipe, the others from
  the broadcast. Every rank all-gathers the logits and samples alike (the sampler's random stream is a
  function of each request's seed and step), so each rank's future-token slots hold the same tokens.
- `run_node` is a node other than 0 (`--node-rank N`): its ranks only, until rank 0 tells them to stop.
"""

from gapless.engine.tp.ranks import run_node
from gapless.engine.tp.stream import TPStream

__all__ = ["TPStream", "run_node"]
