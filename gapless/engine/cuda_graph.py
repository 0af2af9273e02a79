"""CUDA graphs for decode: one graph per batch-size bucket, replayed on static, padded input buffers.

A decode step launches a few hundred small kernels for one token per request; at small batch sizes the
launches, not the math, set the pace. A CUDA graph records them once and replays them as one launch.

A graph replays fixed shapes at fixed addresses, so:
- batch sizes are bucketed (`batch_size_buckets`) and a decode batch is padded up to its bucket;
- the graph reads its inputs from static buffers, one column per row of the largest bucket, and the
  batch is copied into them at the start of its job, on the forward stream: in stream order, like every
  other device write, so it composes with overlap scheduling. The graph reads each request's input token
  from the future-token slots itself (`token_buf[rows]`), so it runs before the host knows that token;
- padded rows point at the runner's reserved request-table row (`pad_row`, whose token slot
  holds a valid token) and at KV slot 0, in the padding page no request owns, so they never touch real
  state;
- attention metadata is graph-safe: the graph is captured with `max_seq_len` = the runner's max context
  (a request's real length is read from device tensors at run time), so the Triton decode kernel's split
  count, a host int chosen from that maximum and the bucket size, is fixed at capture;
- the graph ends at the final hidden states; the LM head of the real rows and sampling run eagerly
  after it (sampling's stages depend on the batch's params, a host-side choice per step).

On the CPU nothing is captured: `run` executes the same body eagerly on the same padded buffers, so the
bucket, padding and static-buffer logic is tested without a GPU (`cuda_graph_max_bs` > 0 on CPU).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import Counter
from collections.abc import Callable

import torch

from gapless.attention.base import AttentionMetadata
from gapless.engine.batch import ForwardBatch
from gapless.memory.req_table import ReqTable

# the runner's decoder over a flat batch: (input_ids, positions, out_slots, metadata) -> hidden [T, hidden]
ForwardTokens = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]

log = logging.getLogger(__name__)

DEFAULT_MAX_BS = 256
WARMUP_RUNS = 2  # before capture: Triton compiles its kernels, cuBLAS settles on its algorithms


def batch_size_buckets(max_bs: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, then every multiple of 8, up to and including `max_bs`."""
    if max_bs < 1:
        raise ValueError(f"max_bs must be >= 1, got {max_bs}")
    sizes = [s for s in (1, 2, 4) if s < max_bs] + list(range(8, max_bs + 1, 8))
    if not sizes or sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


class GraphRunner:
    """Decode forwards of up to `max_bs` requests on static buffers; CUDA graphs on a GPU."""

    def __init__(
        self,
        max_bs: int,
        *,
        req_table: ReqTable,
        token_buf: torch.Tensor,
        pad_row: int,
        hidden_size: int,
        dtype: torch.dtype,
    ) -> None:
        """`req_table` and `token_buf` (the future-token slots) are the device state a decode reads (the
        table's width bounds every request's length); `pad_row` is the reserved request-table row padded
        columns use (its token slot must hold a valid id).

        The decoder itself (`ForwardTokens`, the runner's bound method) is passed to `capture` and `run`
        rather than kept: a graph runner holding its runner's method while the runner holds it would be a
        reference cycle, and the weights, KV pool and graph pool would then outlive the engine until the
        garbage collector happened to run."""
        self.req_table, self.token_buf = req_table, token_buf
        self.buckets = batch_size_buckets(max_bs)
        self.max_bs = max_bs
        self.device = dev = token_buf.device
        # one column per row: request-table row, position (in decode also the tokens cached before it),
        # KV slot of the new token; copied in with one kernel per step
        self.inputs = torch.empty(3, max_bs, dtype=torch.int64, device=dev)
        self.rows, self.positions, self.out_slots = self.inputs.unbind(0)
        # what a padded column holds: the reserved row, position 0, KV slot 0 (the padding page)
        pad = torch.tensor([pad_row, 0, 0], dtype=torch.int64, device=dev)
        self.pad = pad[:, None].expand(3, max_bs).contiguous()
        self.inputs.copy_(self.pad)
        self.extend_lens = torch.ones(max_bs, dtype=torch.int64, device=dev)
        self.q_start = torch.arange(max_bs, dtype=torch.int64, device=dev)
        self.hidden = torch.empty(max_bs, hidden_size, dtype=dtype, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # host-side counters for tests and logs: runs per bucket, padded rows run
        self.runs: Counter[int] = Counter()
        self.padded_rows = 0

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.is_decode and batch.rows.shape[0] <= self.max_bs

    def _body(self, n: int, forward_tokens: ForwardTokens) -> None:
        """The captured work for bucket `n`: table writes, embedding of the future tokens, the decoder;
        the final hidden states land in `self.hidden[:n]`."""
        rows, positions, out_slots = self.rows[:n], self.positions[:n], self.out_slots[:n]
        self.req_table.apply_writes(rows, positions, out_slots)
        meta = AttentionMetadata(
            rows=rows,
            prefix_lens=positions,  # a decode token's position is the number of tokens before it
            extend_lens=self.extend_lens[:n],
            q_start=self.q_start[:n],
            req_table=self.req_table.device_table,
            max_extend_len=1,
            max_seq_len=self.req_table.max_context,
            is_decode=True,
            static=True,
        )
        self.hidden[:n].copy_(forward_tokens(self.token_buf[rows], positions, out_slots, meta))

    @torch.inference_mode()
    def capture(self, forward_tokens: ForwardTokens) -> None:
        """Record one graph per bucket (largest first, so the smaller ones share its memory pool) of
        `forward_tokens`, the runner's decoder. On the CPU there is nothing to capture."""
        dev = self.device
        if dev.type != "cuda":
            return
        t0 = time.perf_counter()
        self.inputs.copy_(self.pad)  # warm-up and capture run on padding only
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        pool = None
        for n in reversed(self.buckets):
            with torch.cuda.stream(stream):
                for _ in range(WARMUP_RUNS):
                    self._body(n, forward_tokens)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self._body(n, forward_tokens)
            pool = graph.pool()
            self.graphs[n] = graph
        torch.cuda.synchronize(dev)
        log.info(
            "CUDA graphs: %d decode batch sizes up to %d captured in %.1f s",
            len(self.buckets),
            self.max_bs,
            time.perf_counter() - t0,
        )

    def run(self, batch: ForwardBatch, forward_tokens: ForwardTokens) -> torch.Tensor:
        """Decode `batch` (on the device, `can_run`) through its bucket: its graph's replay, or
        `forward_tokens` (the decoder the graph was captured from) where none was captured (the CPU).
        Returns its rows' final hidden states [B, hidden], a view of the static output (read it before
        the next decode runs)."""
        b = batch.rows.shape[0]
        n = self.buckets[bisect.bisect_left(self.buckets, b)]
        self.inputs[:, :b].copy_(torch.stack((batch.rows, batch.positions, batch.out_slots)))
        if n > b:  # columns a larger batch left behind name live rows: point them back at the padding
            self.inputs[:, b:n].copy_(self.pad[:, b:n])
        graph = self.graphs.get(n)
        if graph is not None:
            graph.replay()
        else:
            self._body(n, forward_tokens)
        self.runs[n] += 1
        self.padded_rows += n - b
        return self.hidden[:b]
