"""From scheduled requests to a `ForwardBatch`: the device inputs, built in bulk from host state (Python
per request, none per token), and the host's view of the launched batch.

Every index vector of a batch is a view of one host buffer, so the stream moves a batch in one copy (two
when it admits requests: their sampling values are floats). The vectors travel in named groups
(`DecodeVectors`, `ExtendVectors`, `TableWrites`, ...) and come back from the buffer as the same groups
(`pack_groups`). A request's sampling settings are turned into values once, when it is admitted
(`gapless.sampling.rows`); a decode batch carries only its rows, positions, KV slots and step counts.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, NamedTuple

import numpy as np
import torch

from gapless.engine.batch import (
    DECODE_VECTORS,
    DecodeVectors,
    ForwardBatch,
    PenaltyInit,
    TableWrites,
    decode_batch,
    decode_width,
)
from gapless.engine.pooling import PooledReq, plan_pool
from gapless.engine.prompt_logprobs import Scored, plan_scores
from gapless.engine.request import Extend, Req
from gapless.engine.scheduler.kv import DecodeSlots
from gapless.engine.scheduler.masks import MaskedRow, needs_mask
from gapless.engine.spec.inputs import HistoryWrites
from gapless.engine.vision import image_batch, image_limits, rope_batch
from gapless.lora.slots import SlotAssigner
from gapless.sampling.rows import RowParams, RowStages
from gapless.tensors import packed


@dataclass
class ScheduledBatch:
    """Host view of a launched batch: which requests, and which of them sample a token."""

    reqs: list[Req]
    forward: ForwardBatch
    is_decode: bool
    # extend batches only (a decode's requests each sample one token): per request, whether it samples a
    # token (False for a non-final chunk of a chunked prefill, and for a pooling request's every chunk)
    # and its kv_len once this batch has run
    samples_token: list[bool]
    kv_after: list[int]
    scored: Scored = field(default_factory=list)  # requests scoring prompt positions, with their counts
    pooled: list[PooledReq] = field(default_factory=list)  # requests pooling positions (embed, score)
    masked: list[MaskedRow] = field(default_factory=list)  # the sampled rows that need a token mask
    # verify batches only (speculative decoding): the drafts each request tries
    drafts: np.ndarray | None = None

    @property
    def kind(self) -> str:
        """The kind of batch, as the meter counts it: "decode" (a verify too) or "extend"."""
        return "decode" if self.is_decode else "extend"


class ExtendVectors(NamedTuple):
    """An extend batch's index vectors (int64): [T] per token, [B] per request, [S] per sampled row."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    out_slots: torch.Tensor  # [T]
    token_rows: torch.Tensor  # [T]
    rows: torch.Tensor  # [B]
    prefix_lens: torch.Tensor  # [B]
    extend_lens: torch.Tensor  # [B]
    q_start: torch.Tensor  # [B]
    sample_index: torch.Tensor  # [S]
    sample_rows: torch.Tensor  # [S]
    sample_steps: torch.Tensor  # [S]


class AdmitVectors(NamedTuple):
    """The int64 part of the sampling values of the requests a batch admits (`RowParams`)."""

    rows: torch.Tensor
    ints: torch.Tensor  # `RowParams.ints`, flattened


class HistoryVectors(NamedTuple):
    """`HistoryWrites`'s vectors."""

    rows: torch.Tensor
    positions: torch.Tensor
    tokens: torch.Tensor


def pack_groups(*groups: tuple) -> Iterator[Any]:
    """Named groups of 1-D int64 tensors, each rebuilt (same type, same order) with every vector a view of
    one new buffer (`gapless.tensors.packed`): the batch moves in one copy."""
    views = iter(packed(*chain.from_iterable(groups)))
    return (type(g)._make(next(views) for _ in g) for g in groups)  # type: ignore[attr-defined]  # groups are NamedTuples: `tuple` has no _make


class BatchBuilder:
    """Builds the scheduler's batches; keeps the host's side of the per-row sampling state (which stages
    each request-table row needs), set when a request is admitted."""

    def __init__(
        self, num_rows: int, vocab_size: int, enters_history: bool = False, lora: SlotAssigner | None = None
    ) -> None:
        self.vocab_size = vocab_size
        self.lora = lora  # the resident adapters' slots, when LoRA is on
        # speculative decoding: extends enter their tokens in the rows' token history, to draft from
        self.enters_history = enters_history
        self.stages = RowStages(num_rows)

    def decode(self, reqs: list[Req], slots: DecodeSlots, table_writes: TableWrites | None) -> ScheduledBatch:
        """The decode batch of `reqs`, whose new tokens' KV slots `slots` holds. Moves state at schedule
        time: each request's `sampled` counts this batch's token."""
        n = len(reqs)
        buf = torch.zeros(DECODE_VECTORS, decode_width(n), dtype=torch.int64)[:, :n]
        host = DecodeVectors(*buf.numpy())  # views of the buffer's rows, by name
        host.rows[:], host.positions[:], host.out_slots[:] = slots.rows, slots.positions, slots.out
        host.ones[:] = 1
        host.token_index[:] = np.arange(n)
        host.steps[:] = steps = [r.sampled for r in reqs]
        for r in reqs:
            r.sampled += 1
        vectors = DecodeVectors(*buf.unbind(0))
        if table_writes is not None:  # (after a retraction's drain) in the same buffer, to keep one copy
            vectors, table_writes = pack_groups(vectors, table_writes)
        flags = self.stages.flags(slots.rows)
        forward = decode_batch(vectors, int(slots.positions.max()) + 1, flags, table_writes)
        self.lora_batch(forward, reqs, [1] * n)
        return ScheduledBatch(reqs, forward, True, [], [], masked=_masked(forward, reqs, steps))

    def extend(
        self,
        entries: list[Extend],
        out_slots: torch.Tensor,
        table_writes: TableWrites | None,
        admitted: list[Req],
        penalty_inits: list[PenaltyInit],
    ) -> ScheduledBatch:
        """The extend batch of `entries` (request, tokens it computes; KV already allocated, `kv_len`
        already advanced); `admitted` are the requests that entered their rows in it. Moves state at
        schedule time: each sampling request's `sampled` counts this batch's token."""
        reqs = [e.req for e in entries]
        ext = torch.tensor([e.tokens for e in entries], dtype=torch.int64)
        kv_after = [r.kv_len for r in reqs]
        pre = torch.tensor(kv_after, dtype=torch.int64) - ext
        rows = torch.tensor([r.row for r in reqs], dtype=torch.int64)
        q_start = torch.cumsum(ext, 0) - ext
        # the whole sequence is in KV once this batch runs: sample its next token (a pooling request,
        # prefill only, never samples)
        samples_token = [r.kv_len == len(r.prompt_ids) + r.sampled and r.pool is None for r in reqs]
        sample_mask = torch.tensor(samples_token, dtype=torch.bool)
        sample_reqs = [r for r, s in zip(reqs, samples_token) if s]
        step_list = [r.sampled for r in sample_reqs]
        for r in sample_reqs:
            r.sampled += 1
        sample_rows = rows[sample_mask]
        host = ExtendVectors(
            input_ids=_tokens(entries),
            positions=torch.arange(int(ext.sum())) - torch.repeat_interleave(q_start - pre, ext),
            out_slots=out_slots,
            token_rows=torch.repeat_interleave(rows, ext),
            rows=rows,
            prefix_lens=pre,
            extend_lens=ext,
            q_start=q_start,
            sample_index=(q_start + ext - 1)[sample_mask],
            sample_rows=sample_rows,
            sample_steps=torch.tensor(step_list, dtype=torch.int64),
        )
        row_params = self._admit(admitted) if admitted else None
        groups: list[tuple] = [host]
        if row_params is not None:  # its index vectors travel in the batch's one int64 buffer
            groups.append(AdmitVectors(row_params.rows, row_params.ints.reshape(-1)))
        if table_writes is not None:
            groups.append(table_writes)
        if self.enters_history:
            groups.append(_history(entries, admitted))
        views = {type(g): g for g in pack_groups(*groups)}
        vec: ExtendVectors = views[ExtendVectors]
        if row_params is not None:
            admit = views[AdmitVectors]
            row_params.rows, row_params.ints = admit.rows, admit.ints.view(row_params.ints.shape)
        hist = views.get(HistoryVectors)
        forward = ForwardBatch(
            input_ids=vec.input_ids,
            positions=vec.positions,
            out_slots=vec.out_slots,
            token_rows=vec.token_rows,
            rows=vec.rows,
            prefix_lens=vec.prefix_lens,
            extend_lens=vec.extend_lens,
            q_start=vec.q_start,
            max_extend_len=int(ext.max()),
            max_seq_len=int((pre + ext).max()),
            is_decode=False,
            sample_index=vec.sample_index,
            sample_rows=vec.sample_rows,
            sample_steps=vec.sample_steps,
            sampling=self.stages.flags(sample_rows.numpy()) if sample_reqs else None,
            table_writes=views.get(TableWrites),
            penalty_inits=penalty_inits,
            row_params=row_params,
            spec=HistoryWrites(*hist) if hist is not None else None,
            images=image_batch(entries, q_start.tolist()),
            q_limits=image_limits(entries, q_start.tolist(), vec.positions),
            rope=rope_batch(entries),
        )
        forward.prompt_scores, scored = plan_scores(entries)
        self.lora_batch(forward, reqs, [e.tokens for e in entries])
        forward.pool, pooled = plan_pool(entries)
        masked = _masked(forward, sample_reqs, step_list)
        return ScheduledBatch(
            reqs, forward, False, samples_token, kv_after, scored=scored, pooled=pooled, masked=masked
        )

    def lora_batch(self, forward: ForwardBatch, reqs: list[Req], tokens: list[int]) -> None:
        """The batch's LoRA slot per token (`tokens[i]` of request i, in the batch's token order) and the
        adapters it loads first, when any row runs one."""
        if self.lora is None:
            return
        batch = self.lora.assign([r.lora for r in reqs], tokens)
        if batch is not None:
            forward.lora_slots, forward.lora_loads = batch

    def _admit(self, admitted: list[Req]) -> RowParams:
        """The sampling values of requests entering their rows (for the device), noting on the host which
        stages each row needs."""
        values, stages, logprobs = RowParams.build(
            [r.params for r in admitted],
            [r.row for r in admitted],  # type: ignore[misc]  # admitted requests hold rows (KVManager.admit)
            [r.seed for r in admitted],
            self.vocab_size,
        )
        self.stages.set(values.rows, stages, logprobs, values.ints[0])
        return values


def _tokens(entries: list[Extend]) -> torch.Tensor:
    """The input ids of an extend: the tokens each request computes, concatenated."""
    spans = (e.req.fill_ids[e.req.kv_len - e.tokens : e.req.kv_len] for e in entries)
    return torch.tensor(list(chain.from_iterable(spans)), dtype=torch.int64)


def _history(entries: list[Extend], admitted: list[Req]) -> HistoryVectors:
    """The tokens an extend enters in its rows' history: those it computes, and for a request entering
    its row, its cached prefix too."""
    new = {id(r) for r in admitted}
    reqs = [e.req for e in entries]
    ends = torch.tensor([r.kv_len for r in reqs], dtype=torch.int64)
    starts = torch.tensor([0 if id(e.req) in new else e.req.kv_len - e.tokens for e in entries])
    counts = ends - starts
    rows = torch.repeat_interleave(torch.tensor([r.row for r in reqs], dtype=torch.int64), counts)
    offsets = torch.cumsum(counts, 0) - counts - starts  # flat index minus position, per request
    positions = torch.arange(int(counts.sum())) - torch.repeat_interleave(offsets, counts)
    spans = (r.fill_ids[a:b] for r, a, b in zip(reqs, starts.tolist(), ends.tolist()))
    return HistoryVectors(rows, positions, torch.tensor(list(chain.from_iterable(spans)), dtype=torch.int64))


def _masked(forward: ForwardBatch, reqs: list[Req], steps: list[int]) -> list[MaskedRow]:
    """The sampled rows of `forward` (requests `reqs` at output `steps`) that need a token mask; looked
    for only when a row's stages say one may (`SampleFlags.need_mask`)."""
    if forward.sampling is None or not forward.sampling.need_mask:
        return []
    return [MaskedRow(i, r, s) for i, (r, s) in enumerate(zip(reqs, steps)) if needs_mask(r, s)]
