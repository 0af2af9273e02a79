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
- the plain decode graph ends at the final hidden states; the LM head of the real rows and sampling run
  eagerly after it (sampling's stages depend on the batch's params, a host-side choice per step).
- a decode whose sampling takes no per-step host input (no token mask, logit bias, penalties or logprobs:
  `sampling_shape`) of at most `sampled_max_bs` rows replays a *sampled* graph instead: the decoder, the
  LM head and the sampler's draw for every column, as one launch (the runner then keeps the real rows'
  tokens in their future-token slots, one small launch, as after an eager draw). Its stages are fixed
  by the batch's `SampleFlags` (its "shape"), so there is one such graph per bucket and shape: greedy
  and plain temperature are captured at start-up (the anchors' workloads), any other shape (top-k,
  top-p, min-p) on its first use, at most `MAX_LAZY_CAPTURES` times (with no device synchronisation:
  the step that captures runs its body three times). Each row's settings are gathered inside the graph
  from the sampler's per-row state by the static `rows`, its random stream by the static `steps`; a
  padded column samples as the reserved row (greedy), and its token goes nowhere.

Verify batches of speculative decoding (`verify_width` = 1 + K tokens per request) have graphs of their
own, bucketed by request count like decodes: request b of a bucket owns the token columns
[b * width, (b + 1) * width), and a request that tries fewer drafts than K fills the rest of its columns
with padding tokens (the reserved row, position 0, KV slot 0). Attention reads each request's real
extend and prefix lengths from the static buffers, so the padded tokens are neither queries nor keys of
any request; `max_extend_len` is the width, fixed at capture. What the verify reads is placed on the
device before the replay (`SpecState.prepare`: positions, slots and drafts from what the previous step
accepted), and scattered into the static buffers by the batch's token offsets, so a verify too is
launched before the host knows the previous step's outcome. The drafting itself (the n-gram lookup, or
the draft model's K proposal steps) runs eagerly before the replay, and a draft model's mirror of the
target's forward eagerly after it: their shapes follow the batch's own `max_drafts` and length, a
host-side choice per step, and the draft model is small next to the target, whose forward is the graph.

On the CPU nothing is captured: `run` executes the same body eagerly on the same padded buffers, so the
bucket, padding and static-buffer logic is tested without a GPU (`cuda_graph_max_bs` > 0 on CPU).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from gapless.attention.base import AttentionMetadata
from gapless.engine.batch import ForwardBatch
from gapless.engine.spec.inputs import VerifyInputs
from gapless.memory.req_table import ReqTable
from gapless.sampling.rows import SampleFlags

# the runner's decoder over a flat batch: (input_ids, positions, out_slots, metadata) -> hidden [T, hidden]
ForwardTokens = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
# the runner's LM head and draw of decode rows: (hidden [n, hidden], rows [n], steps [n], flags) -> tokens
SampleTokens = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, SampleFlags], torch.Tensor]

log = logging.getLogger(__name__)

DEFAULT_MAX_BS = 256
WARMUP_RUNS = 2  # before capture: Triton compiles its kernels, cuBLAS settles on its algorithms
SAMPLED_MAX_BS = 32  # buckets up to this size get sampled graphs: where a step's launches cost the most
# the sampling shapes captured at start-up: greedy, and temperature alone (no greedy row, no filter)
GREEDY = SampleFlags(True, True, False, False, False, False)
TEMPERATURE = SampleFlags(False, False, False, False, False, False)
SAMPLED_SHAPES = (GREEDY, TEMPERATURE)
MAX_LAZY_CAPTURES = 16  # sampled graphs captured on first use, over the runner's life


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
        verify_width: int = 0,
        sampled_max_bs: int = SAMPLED_MAX_BS,
    ) -> None:
        """`req_table` and `token_buf` (the future-token slots) are the device state a decode reads (the
        table's width bounds every request's length); `pad_row` is the reserved request-table row padded
        columns use (its token slot must hold a valid id). `verify_width`: 1 + the drafts per request of
        speculative decoding, whose verify batches get graphs too; 0 without speculation.
        `sampled_max_bs`: decodes of up to this many rows may sample inside their graph (0: none do).

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
        self.verify_width = w = verify_width
        # a verify's columns: per request its row, committed KV length and tokens run; per token (`w` per
        # request) its input id, position, KV slot and row. Padding: an empty request (the reserved row,
        # one token at position 0) and a padding token (id 0 at position 0 of the reserved row, slot 0)
        self.verify_reqs = torch.empty(3, max_bs, dtype=torch.int64, device=dev)
        self.verify_tokens = torch.empty(4, max_bs * w, dtype=torch.int64, device=dev)
        pad_req = torch.tensor([pad_row, 0, 1], dtype=torch.int64, device=dev)
        self.pad_req = pad_req[:, None].expand(3, max_bs).contiguous()
        pad_token = torch.tensor([0, 0, 0, pad_row], dtype=torch.int64, device=dev)
        self.pad_token = pad_token[:, None].expand(4, max_bs * w).contiguous()
        self.verify_reqs.copy_(self.pad_req)
        self.verify_tokens.copy_(self.pad_token)
        self.hidden = torch.empty(max_bs * max(w, 1), hidden_size, dtype=dtype, device=dev)
        # sampled graphs: each column's output step (its random stream) in, its sampled token out
        self.sampled_max_bs = min(sampled_max_bs, max_bs)
        self.steps = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.tokens = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.verify_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.sampled_graphs: dict[tuple[int, SampleFlags], torch.cuda.CUDAGraph] = {}
        self.refused: set[tuple[int, SampleFlags]] = set()  # sampled graphs whose capture failed
        self.lazy_captures = 0
        self._pool: Any = None  # the graphs' shared memory pool, once one is captured
        # every capture's stream: the allocator reuses a pool's free blocks on the stream that made them
        self._capture_stream: Any = None
        # host-side counters for tests and logs: decode runs per bucket (sampled or not) and sampled ones
        # per (bucket, shape), padded rows run (decode and verify), and padding tokens run by verifies
        # (padded requests' and those of requests drafting fewer than K)
        self.runs: Counter[int] = Counter()
        self.sampled: torch.Tensor | None = None  # the tokens the last run sampled in its graph
        self.sampled_runs: Counter[tuple[int, SampleFlags]] = Counter()
        self.verify_runs: Counter[int] = Counter()
        self.padded_rows = 0
        self.padded_tokens = 0

    def can_run(self, batch: ForwardBatch) -> bool:
        """Whether `batch` fits a bucket: a decode, or a verify of at most K drafts per request."""
        if batch.rows.shape[0] > self.max_bs:
            return False
        spec = batch.spec
        return batch.is_decode or (isinstance(spec, VerifyInputs) and spec.max_drafts < self.verify_width)

    def _body(self, n: int, forward_tokens: ForwardTokens) -> None:
        """The captured work for bucket `n`: table writes, embedding of the future tokens, the decoder;
        the final hidden states land in `self.hidden[:n]`."""
        rows, positions, out_slots = self.rows[:n], self.positions[:n], self.out_slots[:n]
        self.req_table.apply_writes(rows, positions, out_slots)
        table = self.req_table.device_table
        assert table is not None, "a graph runner's request table lives on its device"
        meta = AttentionMetadata(
            rows=rows,
            prefix_lens=positions,  # a decode token's position is the number of tokens before it
            extend_lens=self.extend_lens[:n],
            q_start=self.q_start[:n],
            req_table=table,
            max_extend_len=1,
            max_seq_len=self.req_table.max_context,
            is_decode=True,
            static=True,
        )
        self.hidden[:n].copy_(forward_tokens(self.token_buf[rows], positions, out_slots, meta))

    def _verify_body(self, n: int, forward_tokens: ForwardTokens) -> None:
        """The captured work of a verify of `n` requests, `verify_width` tokens each: table writes and the
        decoder over the placed tokens; the final hidden states land in `self.hidden[:n * width]`."""
        w = self.verify_width
        rows, prefix_lens, extend_lens = self.verify_reqs[:, :n].unbind(0)
        ids, positions, out_slots, token_rows = self.verify_tokens[:, : n * w].unbind(0)
        self.req_table.apply_writes(token_rows, positions, out_slots)
        table = self.req_table.device_table
        assert table is not None, "a graph runner's request table lives on its device"
        meta = AttentionMetadata(
            rows=rows,
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            q_start=self.q_start[:n] * w,
            req_table=table,
            max_extend_len=w,
            max_seq_len=self.req_table.max_context,
            is_decode=False,
            static=True,
        )
        self.hidden[: n * w].copy_(forward_tokens(ids, positions, out_slots, meta))

    def _sampled_body(
        self, n: int, flags: SampleFlags, forward_tokens: ForwardTokens, sample_tokens: SampleTokens
    ) -> None:
        """The captured work of a sampled decode of bucket `n`: `_body`, then the LM head and the draw
        (`sample_tokens` under `flags`) of every column into `self.tokens[:n]`."""
        self._body(n, forward_tokens)
        self.tokens[:n].copy_(sample_tokens(self.hidden[:n], self.rows[:n], self.steps[:n], flags))

    def _record(
        self,
        graphs: dict,
        key: object,
        body: Callable[[], None],
        stream: torch.cuda.Stream,
        lazy: bool = False,
    ) -> None:
        """Warm `body` up and capture it as `graphs[key]`, on `stream` (after the current stream's work),
        in the shared memory pool; the inputs are the padding while it runs. `lazy`: mid-run, so without
        `torch.cuda.graph`'s device synchronisation, and in thread-local mode (another thread's CUDA
        calls meanwhile do not break the capture); the current stream then waits for `stream`."""
        current = torch.cuda.current_stream(self.device)
        stream.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(stream):
                self.inputs.copy_(self.pad)
                for _ in range(WARMUP_RUNS):
                    body()
            if lazy:
                with torch.cuda.stream(stream):
                    graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                    try:
                        body()
                    finally:
                        graph.capture_end()
            else:
                with torch.cuda.graph(graph, pool=self._pool, stream=stream):
                    body()
        finally:
            current.wait_stream(stream)
        self._pool = graph.pool()
        graphs[key] = graph

    @torch.inference_mode()
    def capture(self, forward_tokens: ForwardTokens, sample_tokens: SampleTokens | None = None) -> None:
        """Record one graph per bucket (largest first, so the smaller ones share its memory pool) of
        `forward_tokens`, the runner's decoder, and with `sample_tokens` (the runner's LM head and draw)
        the sampled graphs of `SAMPLED_SHAPES` for the buckets up to `sampled_max_bs`. On the CPU there
        is nothing to capture."""
        dev = self.device
        if dev.type != "cuda":
            return
        t0 = time.perf_counter()
        stream = self._capture_stream = torch.cuda.Stream(dev)
        # verifies first: the largest graphs, whose pool the decodes' then share
        bodies = [(self.verify_graphs, self._verify_body)] if self.verify_width else []
        for graphs, body in [*bodies, (self.graphs, self._body)]:
            for n in reversed(self.buckets):
                self._record(graphs, n, partial(body, n, forward_tokens), stream)
        sampled = [n for n in reversed(self.buckets) if n <= self.sampled_max_bs] if sample_tokens else []
        if sample_tokens is not None:
            for n in sampled:
                for flags in SAMPLED_SHAPES:
                    body = partial(self._sampled_body, n, flags, forward_tokens, sample_tokens)
                    self._record(self.sampled_graphs, (n, flags), body, stream)
        torch.cuda.synchronize(dev)
        log.info(
            "CUDA graphs: %d batch sizes up to %d captured for decode%s%s in %.1f s",
            len(self.buckets),
            self.max_bs,
            f" and verify ({self.verify_width} tokens per request)" if self.verify_width else "",
            f", greedy and temperature sampling up to {sampled[0]}" if sampled else "",
            time.perf_counter() - t0,
        )

    def sampling_shape(self, batch: ForwardBatch) -> SampleFlags | None:
        """The flags a sampled graph of `batch` is keyed by, where its sampling can run inside one: a
        decode of at most `sampled_max_bs` rows whose stages need nothing the host gives per step (a
        token mask), change state (penalties) or return more than the tokens (logprobs), without logit
        bias; else None (the batch samples eagerly after its decode graph)."""
        flags = batch.sampling
        if flags is None or not batch.is_decode or batch.rows.shape[0] > self.sampled_max_bs:
            return None
        if batch.token_mask is not None or batch.defer_sampling or batch.prompt_scores is not None:
            return None
        if flags.need_penalties or flags.need_bias or flags.need_mask or flags.num_logprobs >= 0:
            return None
        return flags

    @torch.inference_mode()
    def has_sampled(
        self,
        batch: ForwardBatch,
        flags: SampleFlags,
        forward_tokens: ForwardTokens,
        sample_tokens: SampleTokens,
    ) -> bool:
        """Whether `batch` (with its `sampling_shape`, `flags`) can run a sampled graph: one is
        captured, or is now (its first use, while `MAX_LAZY_CAPTURES` allow; a failed capture is logged
        and not tried again); always on the CPU, where the same body runs eagerly."""
        if self.device.type != "cuda":
            return True
        key = (self.buckets[bisect.bisect_left(self.buckets, batch.rows.shape[0])], flags)
        if key in self.sampled_graphs:
            return True
        if key in self.refused or self.lazy_captures >= MAX_LAZY_CAPTURES or self._capture_stream is None:
            return False
        self.lazy_captures += 1
        body = partial(self._sampled_body, key[0], flags, forward_tokens, sample_tokens)
        try:
            self._record(self.sampled_graphs, key, body, self._capture_stream, lazy=True)
        except Exception:  # noqa: BLE001 - the batch samples eagerly instead; say why once
            log.warning(
                "CUDA graphs: sampling %s at %d rows cannot be captured", flags, key[0], exc_info=True
            )
            self.refused.add(key)
            return False
        log.info("CUDA graphs: captured sampling %s at %d rows on first use", flags, key[0])
        return True

    def _place(self, batch: ForwardBatch, b: int, n: int) -> None:
        """A decode's rows, positions and KV slots into the first `b` static columns, the padding into the
        rest of bucket `n`'s."""
        self.inputs[:, :b].copy_(torch.stack((batch.rows, batch.positions, batch.out_slots)))
        if n > b:  # columns a larger batch left behind name live rows: point them back at the padding
            self.inputs[:, b:n].copy_(self.pad[:, b:n])

    def run(
        self,
        batch: ForwardBatch,
        forward_tokens: ForwardTokens,
        sampling: tuple[SampleFlags, SampleTokens] | None = None,
    ) -> torch.Tensor:
        """Run `batch` (on the device, `can_run`) through its bucket: its graph's replay, or
        `forward_tokens` (the decoder the graph was captured from) where none was captured (the CPU).
        Returns its tokens' final hidden states [T, hidden]; for a decode a view of the static output
        (read it before the next batch runs). `sampling`: the decode's `sampling_shape` (for which
        `has_sampled` said yes) and the runner's LM head and draw: its sampled graph runs, and its tokens
        wait in `sampled` (`take_sampled`) for the runner to keep; else `sampled` is None."""
        b = batch.rows.shape[0]
        n = self.buckets[bisect.bisect_left(self.buckets, b)]
        self.sampled = None
        if not batch.is_decode:
            return self._run_verify(batch, n, forward_tokens)
        self._place(batch, b, n)
        if sampling is None:
            self._replay(self.graphs, self._body, n, forward_tokens)
        else:
            flags, sample_tokens = sampling
            self.steps[:b].copy_(batch.sample_steps)
            graph = self.sampled_graphs.get((n, flags))
            if graph is not None:
                graph.replay()
            else:
                self._sampled_body(n, flags, forward_tokens, sample_tokens)
            self.sampled_runs[n, flags] += 1
            self.sampled = self.tokens[:b].clone()  # the next replay overwrites the static buffer
        self.runs[n] += 1
        self.padded_rows += n - b
        return self.hidden[:b]

    def take_sampled(self) -> torch.Tensor | None:
        """The tokens [B] (on the device) the last `run` sampled inside its graph, once; None if it
        sampled nothing."""
        tokens, self.sampled = self.sampled, None
        return tokens

    @staticmethod
    def _replay(
        graphs: dict[int, torch.cuda.CUDAGraph],
        body: Callable[[int, ForwardTokens], None],
        n: int,
        forward_tokens: ForwardTokens,
    ) -> None:
        """Bucket `n`'s graph, or where none was captured (the CPU) the body it would have recorded."""
        graph = graphs.get(n)
        if graph is not None:
            graph.replay()
        else:
            body(n, forward_tokens)

    def verify_columns(self, spec: VerifyInputs) -> torch.Tensor:
        """Each real token's column in a verify graph's static buffers ([T]: request b's at b * width)."""
        return spec.batch_index * self.verify_width + spec.offsets

    def verify_layout(self, batch: ForwardBatch, values: torch.Tensor, pad: int) -> torch.Tensor:
        """Per-token `values` [T] of a verify batch (`can_run`) laid out as its graph's columns (its bucket
        times the width), every padding column `pad`: what a per-token static input (LoRA's slots) holds."""
        assert isinstance(batch.spec, VerifyInputs)
        n = self.buckets[bisect.bisect_left(self.buckets, batch.rows.shape[0])]
        out = torch.full((n * self.verify_width,), pad, dtype=values.dtype, device=values.device)
        return out.index_copy_(0, self.verify_columns(batch.spec), values)

    def _run_verify(self, batch: ForwardBatch, n: int, forward_tokens: ForwardTokens) -> torch.Tensor:
        """A verify batch (placed by `SpecState.prepare`) through bucket `n`: its requests and tokens
        scattered into the static columns, every other column of the bucket padding."""
        spec = batch.spec
        assert isinstance(spec, VerifyInputs)
        b, w = batch.rows.shape[0], self.verify_width
        self.verify_reqs[:, :b].copy_(torch.stack((batch.rows, batch.prefix_lens, batch.extend_lens)))
        if n > b:
            self.verify_reqs[:, b:n].copy_(self.pad_req[:, b:n])
        tokens = self.verify_tokens[:, : n * w]
        tokens.copy_(self.pad_token[:, : n * w])
        columns = self.verify_columns(spec)
        placed = torch.stack((batch.input_ids, batch.positions, batch.out_slots, batch.token_rows))
        tokens.index_copy_(1, columns, placed)
        self._replay(self.verify_graphs, self._verify_body, n, forward_tokens)
        self.verify_runs[n] += 1
        self.padded_rows += n - b
        self.padded_tokens += n * w - batch.token_rows.shape[0]
        return self.hidden[columns]
