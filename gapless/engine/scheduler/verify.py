"""Verify batches (speculative decoding): every running request's last token and its drafts, in one
forward, placed by the device.

Under overlap the host builds step N+1 before it knows how many drafts step N accepted, so it works
with upper bounds: `Req.sampled` counts every token a launched verify may produce (1 + its drafts), and
the request holds KV slots for every position those tokens may take (`KVManager.alloc_runs`), so that
`kv_len == len(prompt_ids) + sampled - 1` for a decoding request. The device reads the true positions
from what the previous step accepted (`gapless.engine.spec.device`). When a verify is processed
(`verify_results`), the bound drops to the truth and the slots past it go back (`KVManager.trim`).

A request tries no drafts where speculating cannot pay or would be wrong: in batches larger than
`speculative_disable_batch_size`, with penalties (their token counts would have to follow each draft),
under a grammar unless it drafts n-grams (`gapless.engine.spec.grammar.can_draft`), near its
`max_tokens` or the context limit, or when the pool is short. A batch in which none drafts and whose
positions the host knows runs as a plain decode batch. Token masks (`_masked`): a grammar request's
positions take the grammar's state after the drafts before each (`gapless.engine.spec.grammar`); below a
request's `min_tokens` the stop tokens are masked at the positions whose true output step (read on the
device) is under it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from gapless.config import EngineConfig
from gapless.engine.batch import ForwardBatch, TableWrites
from gapless.engine.request import Req
from gapless.engine.scheduler.build import BatchBuilder, ScheduledBatch, pack_groups
from gapless.engine.scheduler.kv import DecodeSlots, KVManager
from gapless.engine.scheduler.masks import MaskedRow
from gapless.engine.spec.grammar import can_draft
from gapless.engine.spec.inputs import VerifyInputs

KEEP = np.iinfo(np.int64).max  # a mask kept whatever the position's step


@dataclass
class VerifyPlan:
    """The drafts each request of a verify batch tries, and the device-table writes of the slots taken
    for them."""

    drafts: np.ndarray  # [B] int64
    writes: TableWrites


class SpecDecode:
    def __init__(self, cfg: EngineConfig, kv: KVManager, builder: BatchBuilder, max_context: int) -> None:
        self.kv, self.builder, self.max_context = kv, builder, max_context
        self.num_drafts = cfg.speculative_num_draft_tokens
        self.ngram = (cfg.ngram_min, cfg.ngram_max)
        self.max_batch = cfg.speculative_disable_batch_size
        self.grammar_drafts = cfg.speculative_algorithm == "ngram"  # repeated on the host (spec.grammar)

    def alloc(self, reqs: list[Req]) -> VerifyPlan | None:
        """Slots for each request's next verify (with drafts, else without); None, taking nothing, if the
        pool cannot give even one slot each."""
        drafts = self._drafts(reqs)
        writes = self.kv.alloc_runs(reqs, drafts + 1)
        if writes is None and drafts.any():
            drafts[:] = 0
            writes = self.kv.alloc_runs(reqs, drafts + 1)
        return None if writes is None else VerifyPlan(drafts, writes)

    def _drafts(self, reqs: list[Req]) -> np.ndarray:
        """Drafts per request: K, within its max_tokens and the context; 0 for penalised requests, under a
        grammar, or past the batch size where speculation stops paying."""
        if len(reqs) > self.max_batch:
            return np.zeros(len(reqs), dtype=np.int64)
        k, ctx = self.num_drafts, self.max_context
        # a verify yields at most 1 + drafts tokens, and writes positions up to kv_len + drafts (< context)
        return np.array(
            [
                0
                if r.params.has_penalties or (r.grammar is not None and not self._grammar_drafts(r))
                else max(0, min(k, r.params.max_tokens - r.sampled - 1, ctx - 2 - r.kv_len))
                for r in reqs
            ],
            dtype=np.int64,
        )

    def _grammar_drafts(self, r: Req) -> bool:
        """Whether grammar request `r` drafts (n-grams, repeated on the host for its masks)."""
        if not (self.grammar_drafts and can_draft(r)):
            return False
        assert r.grammar is not None
        r.grammar.ngram = self.ngram
        return True

    def batch(self, reqs: list[Req], plan: VerifyPlan, table_writes: TableWrites | None) -> ScheduledBatch:
        """The verify batch of `reqs`. Moves state at schedule time: `sampled` counts every token it may
        yield. Where none drafts and the host knows every position (no verify with drafts in flight), a
        plain decode batch instead: cheaper, and it runs through the CUDA graphs (it keeps the rows'
        device state as an extend does, `SpecState.keep`)."""
        if not plan.drafts.any() and not any(r.unresolved_drafts for r in reqs):
            rows, positions, slots = (t.numpy() for t in plan.writes)
            return self.builder.decode(reqs, DecodeSlots(rows, positions, slots), table_writes)
        ext = plan.drafts + 1
        n, total = len(reqs), int(ext.sum())
        rows = np.array([r.row for r in reqs], dtype=np.int64)
        owner = np.repeat(np.arange(n), ext)
        q_start = np.cumsum(ext) - ext
        offsets = np.arange(total) - q_start[owner]
        token_rows = rows[owner]
        max_seq = max(r.kv_len for r in reqs)  # kv_len is past every position the batch may take
        masked, keep_below_np = _masked(reqs, ext, q_start)
        for r, e in zip(reqs, ext.tolist()):
            r.sampled += e
            r.unresolved_drafts += e - 1
        writes = plan.writes
        if table_writes is not None:  # (a retraction's drain queued some: they go in the same buffer)
            writes = TableWrites(*(torch.cat([a, b]) for a, b in zip(writes, table_writes)))
        arrays = (rows, ext, q_start, token_rows, owner, offsets, keep_below_np, np.arange(total))
        host = VerifyVectors(*(torch.from_numpy(a) for a in arrays))
        vec: VerifyVectors
        vec, writes = pack_groups(host, writes)  # one buffer: the batch moves in one copy
        empty = vec.sample_index[:0]  # filled on the device (`SpecState.prepare`)
        forward = ForwardBatch(
            input_ids=empty,
            positions=empty,
            out_slots=empty,
            token_rows=vec.token_rows,
            rows=vec.rows,
            prefix_lens=empty,
            extend_lens=vec.extend_lens,
            q_start=vec.q_start,
            max_extend_len=int(ext.max()),
            max_seq_len=max_seq,
            is_decode=False,
            sample_index=vec.sample_index,
            sample_rows=vec.token_rows,
            sample_steps=empty,
            sampling=self.builder.stages.flags(token_rows),
            table_writes=writes,
            spec=VerifyInputs(
                vec.batch_index,
                vec.offsets,
                int(plan.drafts.max()),
                *self.ngram,
                vec.keep_mask_below if masked else None,
            ),
        )
        # each token runs its request's adapter: the target verifies with it (the drafter never does)
        self.builder.lora_batch(forward, reqs, ext.tolist())
        return ScheduledBatch(reqs, forward, True, [], [], masked=masked, drafts=plan.drafts)


class VerifyVectors(NamedTuple):
    """A verify batch's index vectors (int64): [B] per request, [T] per token."""

    rows: torch.Tensor  # [B]
    extend_lens: torch.Tensor  # [B] 1 + its drafts
    q_start: torch.Tensor  # [B]
    token_rows: torch.Tensor  # [T]
    batch_index: torch.Tensor  # [T] its request's index in the batch
    offsets: torch.Tensor  # [T] its offset among its request's tokens
    keep_mask_below: torch.Tensor  # [T] (`VerifyInputs.keep_mask_below`)
    sample_index: torch.Tensor  # [T] 0..T-1: every token samples


def _masked(reqs: list[Req], ext: np.ndarray, q_start: np.ndarray) -> tuple[list[MaskedRow], np.ndarray]:
    """The positions of a verify batch sampled under a token mask (`masks.make_mask`), with the output
    step the mask is made for; and the step below which the device keeps each position's mask ([T]).

    A grammar request's positions take its grammar's masks (made after the drafts before each), kept
    whatever the step (it drafts only without min_tokens; a request that drafts nothing has one position,
    whose step is exact, `sampled`, as a decode's, for min_tokens' part). For min_tokens alone the host
    knows only bounds of a position's step: at least the tokens processed so far plus its offset. Every
    position whose lower bound is under min_tokens gets the mask without the stop tokens, and the device
    keeps it only where the true step is under min_tokens (`SpecState.verify_mask`), so the tokens are
    decoding's."""
    masked: list[MaskedRow] = []
    keep_below = np.zeros(int(ext.sum()), dtype=np.int64)
    for r, e, start in zip(reqs, ext.tolist(), q_start.tolist()):
        if r.grammar is not None:  # each position: the grammar's state after the drafts before it
            masked.extend(MaskedRow(start + o, r, r.sampled + o) for o in range(e))
            keep_below[start : start + e] = KEEP
            continue
        low, need = len(r.output_ids), r.params.min_tokens
        for o in range(min(e, need - low)):
            masked.append(MaskedRow(start + o, r, low + o))
            keep_below[start + o] = need
    return masked, keep_below
