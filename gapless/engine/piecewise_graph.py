"""Piecewise CUDA graphs for small extend (prefill) batches: the decoder captured between its attentions.

An eager prefill forward launches every op of every layer from Python, so for a few hundred tokens the
host's launches take longer than the GPU's work (`python -m gapless.bench.prefill_launch` measures both),
and the running requests' next decode waits behind them. A whole-forward graph cannot take an extend
batch: how its attention launches depends on how the tokens split into requests. So, as vLLM V1 does, the
forward is cut at each attention: piece 0 is the embedding and layer 0 up to its attention (norm,
projections, q/k norm, RoPE, KV store: `DecoderLayer.before_attention`); piece i the rest of layer i - 1
(output projection, norms, MLP: `after_attention`) and layer i up to its attention; the last piece the
rest of the last layer and the final norm. Each piece is captured once per bucket of token counts; the
attention between two pieces runs as it comes, on the batch's real tokens and metadata.

- Token counts are bucketed (`token_buckets`) and a batch is padded up to its bucket. A padded token is
  token 0 at position 0 stored in KV slot 0, in the padding page no request owns, so it touches no real
  state; every op of a piece treats tokens one by one, so padding changes no real token's result (beyond
  what a GEMM of another row count may round differently).
- Pieces read static buffers and write static buffers: the tokens' ids, positions and KV slots (copied in
  at the start of the job, on the device stream, like every other device write), the queries and the
  residual stream a piece hands on, the attention's output (its first T rows copied in after each
  attention) and the final hidden states. Padded rows of the attention buffer keep what an earlier batch
  left there, which only padded rows read.

The graphs are off unless `piecewise_cuda_graph_max_tokens` > 0: they wait for a GPU run that measures them
against the eager forward. On the CPU nothing is captured: `run` executes the same pieces eagerly on the
same padded buffers, so the buckets, the padding and the static buffers are tested without a GPU.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import Counter
from collections.abc import Sequence
from typing import cast

import torch

from gapless.attention.base import AttentionBackend, AttentionMetadata
from gapless.engine.batch import ForwardBatch
from gapless.memory.kv_pool import KVPool
from gapless.model.decoder import CausalLM, DecoderLayer, ForwardContext

log = logging.getLogger(__name__)

WARMUP_RUNS = 2  # before capture: Triton compiles its kernels, cuBLAS settles on its algorithms
MIN_BUCKET = 16


def token_buckets(max_tokens: int) -> list[int]:
    """Captured token counts: powers of two from 16 up, and `max_tokens` itself."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    sizes = []
    n = MIN_BUCKET
    while n < max_tokens:
        sizes.append(n)
        n *= 2
    return [*sizes, max_tokens]


class PiecewiseGraphs:
    """Extend forwards of up to `max_tokens` tokens through pieces captured per token bucket (on a GPU)."""

    def __init__(
        self, max_tokens: int, model: CausalLM, kv_pool: KVPool, backend: AttentionBackend, dtype: torch.dtype
    ) -> None:
        """`model`'s decoder, storing K/V in `kv_pool` and attending with `backend` (both the runner's).
        The pieces call into the model; the graphs (on a GPU) hold what they captured."""
        self.buckets = token_buckets(max_tokens)
        self.max_tokens = max_tokens
        self.model, self.kv_pool, self.backend = model, kv_pool, backend
        # nn.ModuleList is not generic: its items type as nn.Module, though the body holds DecoderLayers
        self.layers = cast("Sequence[DecoderLayer]", model.model.layers)
        cfg = model.cfg
        self.device = dev = kv_pool.device
        # per token: input id, position, KV slot; zeros are what a padded token holds
        self.inputs = torch.zeros(3, max_tokens, dtype=torch.int64, device=dev)
        self.ids, self.positions, self.slots = self.inputs.unbind(0)
        q_width = self.layers[0].self_attn.qkv_proj.output_sizes[0]  # this rank's heads x head dim
        self.queries = torch.zeros(max_tokens, q_width, dtype=dtype, device=dev)
        self.attn = torch.zeros(max_tokens, q_width, dtype=dtype, device=dev)
        self.residual = torch.zeros(max_tokens, cfg.hidden_size, dtype=dtype, device=dev)
        self.hidden = torch.zeros(max_tokens, cfg.hidden_size, dtype=dtype, device=dev)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        # host-side counters for tests and logs: runs per bucket, padded tokens run
        self.runs: Counter[int] = Counter()
        self.padded_tokens = 0

    @property
    def num_pieces(self) -> int:
        return len(self.layers) + 1

    def can_run(self, batch: ForwardBatch) -> bool:
        """Whether `batch` is an extend of at most `max_tokens` tokens that brings its own input ids."""
        tokens = batch.input_ids.shape[0]
        return not batch.reads_future_tokens and 0 < tokens <= self.max_tokens

    def piece(self, n: int, i: int) -> None:
        """Piece `i` of bucket `n` (what a graph records): static buffers in, static buffers out."""
        body = self.model.model
        if i == 0:
            x, residual = body.embed(self.ids[:n]), None
        else:
            x, residual = self.layers[i - 1].after_attention(self.attn[:n], self.residual[:n])
        if i < len(self.layers):
            ctx = ForwardContext(self.positions[:n], self.slots[:n], self.kv_pool, self.backend, None)
            q, residual = self.layers[i].before_attention(x, residual, ctx)
            self.queries[:n].copy_(q.reshape(n, -1))
            self.residual[:n].copy_(residual)
        else:
            self.hidden[:n].copy_(body.finish(x, residual))

    @torch.inference_mode()
    def capture(self) -> None:
        """Record every piece of every bucket (largest first, all in one memory pool). Nothing on the
        CPU. The warm-up and capture run on padding only (token 0, position 0, KV slot 0)."""
        if self.device.type != "cuda":
            return
        t0 = time.perf_counter()
        self.inputs.zero_()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        pool = None
        for n in reversed(self.buckets):
            with torch.cuda.stream(stream):
                for _ in range(WARMUP_RUNS):
                    for i in range(self.num_pieces):
                        self.piece(n, i)
            graphs = []
            for i in range(self.num_pieces):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.piece(n, i)
                pool = graph.pool()
                graphs.append(graph)
            self.graphs[n] = graphs
        torch.cuda.synchronize(self.device)
        log.info(
            "piecewise CUDA graphs: %d token counts up to %d, %d pieces each, captured for prefill in %.1f s",
            len(self.buckets),
            self.max_tokens,
            self.num_pieces,
            time.perf_counter() - t0,
        )

    def run(self, batch: ForwardBatch, meta: AttentionMetadata) -> torch.Tensor:
        """Run `batch` (`can_run`, on the device, its table writes applied) through its bucket: each piece's
        replay (or, where none was captured, the piece itself), the attention of its real tokens between
        them. Returns their final hidden states [T, hidden], a view of the static output (read it before
        the next batch runs)."""
        t = batch.input_ids.shape[0]
        n = self.buckets[bisect.bisect_left(self.buckets, t)]
        self.inputs[:, :t].copy_(torch.stack((batch.input_ids, batch.positions, batch.out_slots)))
        if n > t:  # columns a larger batch left behind: back to padding
            self.inputs[:, t:n].zero_()
        ctx = ForwardContext.prepared(batch.positions, batch.out_slots, self.kv_pool, self.backend, meta)
        graphs = self.graphs.get(n)
        for i in range(self.num_pieces):
            if graphs is not None:
                graphs[i].replay()
            else:
                self.piece(n, i)
            if i < len(self.layers):
                attn = self.layers[i].self_attn
                q = self.queries[:t].view(t, -1, attn.cfg.head_dim)
                self.attn[:t].copy_(attn.attend(q, ctx).reshape(t, -1))
        self.runs[n] += 1
        self.padded_tokens += n - t
        return self.hidden[:t]
