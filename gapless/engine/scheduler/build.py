"""From scheduled requests to a `ForwardBatch`: the device inputs, built in bulk from host state (no
per-token Python), and the host's view of the launched batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gapless.engine.batch import ForwardBatch
from gapless.engine.request import Req
from gapless.sampling.sampler import SamplingBatch


@dataclass
class ScheduledBatch:
    """Host view of a launched batch: which requests, and which of them sample a token."""

    reqs: list[Req]
    samples: list[bool]  # False for a non-final chunk of a chunked prefill
    kv_after: list[int]  # each request's kv_len once this batch has run
    forward: ForwardBatch
    is_decode: bool


def build_batch(
    entries: list[tuple[Req, int]],
    out_slots: torch.Tensor,
    is_decode: bool,
    table_writes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    penalty_inits: list[tuple[int, list[int], list[int]]],
    vocab_size: int,
) -> ScheduledBatch:
    """The batch of `entries` (request, tokens it computes; KV already allocated, `kv_len` already
    advanced). Moves state at schedule time: each sampling request's `sampled` counts this batch's token."""
    reqs = [r for r, _ in entries]
    ext = torch.tensor([n for _, n in entries], dtype=torch.int64)
    pre = torch.tensor([r.kv_len - n for r, n in entries], dtype=torch.int64)
    rows = torch.tensor([r.row for r in reqs], dtype=torch.int64)
    q_start = torch.cumsum(ext, 0) - ext
    if is_decode:
        input_ids: list[int] = []  # the device reads each row's future-token slot
        positions, token_rows = pre, rows
    else:
        input_ids = [t for r, n in entries for t in r.fill_ids[r.kv_len - n : r.kv_len]]
        token_rows = torch.repeat_interleave(rows, ext)
        positions = torch.arange(int(ext.sum())) - torch.repeat_interleave(q_start - pre, ext)
    # the whole sequence is in KV once this batch runs: sample its next token
    samples = [r.kv_len == len(r.prompt_ids) + r.sampled for r in reqs]
    sample_reqs = [r for r, s in zip(reqs, samples) if s]
    sample_mask = torch.tensor(samples, dtype=torch.bool)
    sampling = None
    if sample_reqs:
        sampling = SamplingBatch.build(
            [r.params for r in sample_reqs],
            [r.sampled for r in sample_reqs],  # counts tokens still in flight
            [r.row for r in sample_reqs],
            [r.seed for r in sample_reqs],
            "cpu",  # the stream moves the whole batch to the device
            vocab_size=vocab_size,
        )
        for r in sample_reqs:
            r.sampled += 1
    forward = ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        positions=positions,
        out_slots=out_slots,
        token_rows=token_rows,
        rows=rows,
        prefix_lens=pre,
        extend_lens=ext,
        q_start=q_start,
        max_extend_len=int(ext.max()),
        max_seq_len=int((pre + ext).max()),
        is_decode=is_decode,
        sample_index=(q_start + ext - 1)[sample_mask],
        sample_rows=rows[sample_mask],
        sampling=sampling,
        table_writes=table_writes,
        penalty_inits=penalty_inits,
    )
    return ScheduledBatch(reqs, samples, [r.kv_len for r in reqs], forward, is_decode)
