"""From scheduled requests to a `ForwardBatch`: the device inputs, built in bulk from host state (no
per-token Python), and the host's view of the launched batch.

Every index vector of a batch is a view of one host buffer, so the stream moves a batch in one copy (two
when it admits requests: their sampling values are floats). A request's sampling settings are turned
into values once, when it is admitted (`gapless.sampling.rows`); a decode batch carries only its rows,
positions, KV slots and step counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from gapless.engine.batch import DECODE_VECTORS, ForwardBatch, decode_batch
from gapless.engine.prompt_logprobs import Scored, plan_scores
from gapless.engine.request import Req
from gapless.engine.scheduler.kv import DecodeSlots, TableWrites
from gapless.engine.scheduler.masks import needs_mask
from gapless.engine.spec.inputs import HistoryWrites
from gapless.sampling.rows import RowParams, RowStages
from gapless.tensors import packed


@dataclass
class ScheduledBatch:
    """Host view of a launched batch: which requests, and which of them sample a token."""

    reqs: list[Req]
    forward: ForwardBatch
    is_decode: bool
    # extend batches only (a decode's requests each sample one token): per request, whether it samples
    # (False for a non-final chunk of a chunked prefill) and its kv_len once this batch has run
    samples: list[bool]
    kv_after: list[int]
    scored: Scored = field(default_factory=list)  # requests scoring prompt positions, with their counts
    # the sampled rows that need a token mask: (position among them, request, output step)
    masked: list[tuple[int, Req, int]] = field(default_factory=list)
    # verify batches only (speculative decoding): the drafts each request tries
    drafts: np.ndarray | None = None


class BatchBuilder:
    """Builds the scheduler's batches; keeps the host's side of the per-row sampling state (which stages
    each request-table row needs), set when a request is admitted."""

    def __init__(self, num_rows: int, vocab_size: int, history: bool = False) -> None:
        self.vocab_size = vocab_size
        self.history = history  # speculative decoding: extends enter their tokens in the rows' history
        self.stages = RowStages(num_rows)

    def decode(self, reqs: list[Req], slots: DecodeSlots, table_writes: TableWrites | None) -> ScheduledBatch:
        """The decode batch of `reqs`, whose new tokens' KV slots `slots` holds. Moves state at schedule
        time: each request's `sampled` counts this batch's token."""
        n = len(reqs)
        buf = np.empty((DECODE_VECTORS, n), dtype=np.int64)
        buf[0], buf[1], buf[2], buf[3] = slots.rows, slots.positions, slots.out, 1
        buf[4] = np.arange(n)
        buf[5] = steps = [r.sampled for r in reqs]
        for r in reqs:
            r.sampled += 1
        writes = None
        if table_writes is None:
            vectors = torch.from_numpy(buf).unbind(0)
        else:  # (after a retraction's drain) in the same buffer, to keep one copy
            *vectors, w0, w1, w2 = packed(*torch.from_numpy(buf), *table_writes)
            writes = (w0, w1, w2)
        forward = decode_batch(vectors, int(slots.positions.max()) + 1, self.stages.flags(slots.rows), writes)
        return ScheduledBatch(reqs, forward, True, [], [], masked=_masked(forward, reqs, steps))

    def extend(
        self,
        entries: list[tuple[Req, int]],
        out_slots: torch.Tensor,
        table_writes: TableWrites | None,
        admitted: list[Req],
        penalty_inits: list[tuple[int, list[int], list[int]]],
    ) -> ScheduledBatch:
        """The extend batch of `entries` (request, tokens it computes; KV already allocated, `kv_len`
        already advanced); `admitted` are the requests that entered their rows in it. Moves state at
        schedule time: each sampling request's `sampled` counts this batch's token."""
        reqs = [r for r, _ in entries]
        row_params = self._admit(admitted) if admitted else None
        ext = torch.tensor([n for _, n in entries], dtype=torch.int64)
        pre = torch.tensor([r.kv_len - n for r, n in entries], dtype=torch.int64)
        rows = torch.tensor([r.row for r in reqs], dtype=torch.int64)
        q_start = torch.cumsum(ext, 0) - ext
        input_ids = torch.tensor([t for r, n in entries for t in r.fill_ids[r.kv_len - n : r.kv_len]])
        token_rows = torch.repeat_interleave(rows, ext)
        positions = torch.arange(int(ext.sum())) - torch.repeat_interleave(q_start - pre, ext)
        # the whole sequence is in KV once this batch runs: sample its next token
        samples = [r.kv_len == len(r.prompt_ids) + r.sampled for r in reqs]
        sample_mask = torch.tensor(samples, dtype=torch.bool)
        sample_reqs = [r for r, s in zip(reqs, samples) if s]
        step_list = [r.sampled for r in sample_reqs]
        steps = torch.tensor(step_list, dtype=torch.int64)
        for r in sample_reqs:
            r.sampled += 1
        sample_rows = rows[sample_mask]
        admit = (row_params.rows, row_params.ints.reshape(-1)) if row_params is not None else ()
        hist = self._history(entries, admitted) if self.history else ()
        parts = packed(
            input_ids.to(torch.int64),
            positions,
            out_slots,
            token_rows,
            rows,
            pre,
            ext,
            q_start,
            (q_start + ext - 1)[sample_mask],
            sample_rows,
            steps,
            *admit,
            *(table_writes or ()),
            *hist,
        )
        if row_params is not None:  # its index vectors travel in the batch's one int64 buffer
            row_params.rows, row_params.ints = parts[11], parts[12].view(row_params.ints.shape)
        forward = ForwardBatch(
            *parts[:8],
            max_extend_len=int(ext.max()),
            max_seq_len=int((pre + ext).max()),
            is_decode=False,
            sample_index=parts[8],
            sample_rows=parts[9],
            sample_steps=parts[10],
            sampling=self.stages.flags(sample_rows.numpy()) if sample_reqs else None,
            table_writes=tuple(parts[11 + len(admit) : 14 + len(admit)]) if table_writes else None,  # type: ignore[arg-type]
            penalty_inits=penalty_inits,
            row_params=row_params,
            spec=HistoryWrites(*parts[-3:]) if hist else None,
        )
        forward.prompt_scores, scored = plan_scores(entries)
        masked = _masked(forward, sample_reqs, step_list)
        return ScheduledBatch(
            reqs, forward, False, samples, [r.kv_len for r in reqs], scored=scored, masked=masked
        )

    @staticmethod
    def _history(entries: list[tuple[Req, int]], admitted: list[Req]) -> tuple[torch.Tensor, ...]:
        """(rows, positions, tokens) of the tokens an extend enters in its rows' history: those it
        computes, and for a request entering its row, its cached prefix too."""
        new = {id(r) for r in admitted}
        spans = [(r, 0 if id(r) in new else r.kv_len - n, r.kv_len) for r, n in entries]
        rows = torch.tensor([r.row for r, a, b in spans for _ in range(a, b)], dtype=torch.int64)
        positions = torch.tensor([p for _, a, b in spans for p in range(a, b)], dtype=torch.int64)
        tokens = torch.tensor([t for r, a, b in spans for t in r.fill_ids[a:b]], dtype=torch.int64)
        return rows, positions, tokens

    def _admit(self, admitted: list[Req]) -> RowParams:
        """The sampling values of requests entering their rows (for the device), noting on the host which
        stages each row needs."""
        values, stages, logprobs = RowParams.build(
            [r.params for r in admitted],
            [r.row for r in admitted],  # type: ignore[misc]
            [r.seed for r in admitted],
            self.vocab_size,
        )
        self.stages.set(values.rows, stages, logprobs, values.ints[0])
        return values


def _masked(forward: ForwardBatch, reqs: list[Req], steps: list[int]) -> list[tuple[int, Req, int]]:
    """The sampled rows of `forward` (requests `reqs` at output `steps`) that need a token mask; looked
    for only when a row's stages say one may (`SampleFlags.need_mask`)."""
    if forward.sampling is None or not forward.sampling.need_mask:
        return []
    return [(i, r, s) for i, (r, s) in enumerate(zip(reqs, steps)) if needs_mask(r, s)]
