"""Token masks per batch, and how a grammar keeps the overlap loop: the host fills step N+1's mask while
the device runs step N+1's forward.

A batch's mask covers its sampled rows that a grammar constrains or whose `min_tokens` is not reached
(`BatchBuilder` lists them, with their output step, in `ScheduledBatch.masked`). Its min_tokens part is
known when the batch is built; its grammar part depends on every earlier token of the request. When
every such token has been processed (no constrained request of the batch is still in flight), the mask is
made at launch and travels with the batch: one job, as usual.

Otherwise (the overlap loop's steady state: batch N+1 is launched while N's tokens are unknown) the batch
is launched with `defer_sampling`: the device runs its forward and keeps the logits. The host goes on
processing batch N (`ResultProcessor.process`, which advances the matchers), then `release` fills the
masks and submits a `SampleJob` that samples the kept logits under them. So the mask fill overlaps the
forward, the host never waits on the device for it, and the device only waits (a bubble, measured: the
job's `idle`) when the host's processing plus fill outlasts the forward. Stream order keeps the
future-token rule: the sample job is submitted before the next batch's forward, which reads the tokens it
writes.

`release` runs for the oldest batch in flight only, once every batch before it was processed: the
scheduler calls it after processing a batch, and `result()` calls it (the plain loop, a drain).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from gapless.engine.batch import ForwardBatch, SampleJob
from gapless.engine.request import Req
from gapless.engine.spec.grammar import fill_grammars
from gapless.engine.stream import DeviceStream, JobResult, JobTiming, Pending
from gapless.sampling.mask import TokenMask, mask_words


class MaskedRow(NamedTuple):
    """A sampled row of a batch that needs a token mask."""

    position: int  # among the batch's sampled rows
    req: Req
    step: int  # the output step it samples


Masked = Sequence[MaskedRow]


def needs_mask(req: Req, step: int) -> bool:
    """True when `req`'s token at output `step` is sampled under a mask."""
    return req.grammar is not None or step < req.params.min_tokens


def make_mask(masked: Masked, num_rows: int, vocab_size: int) -> TokenMask:
    """The allowed tokens of the `masked` rows (of a batch sampling `num_rows`) now: each grammar's next
    tokens (all, for a request that finished meanwhile: its token is dropped), without the stop tokens
    below min_tokens; every other row allows all."""
    bits = torch.full((num_rows, mask_words(vocab_size)), -1, dtype=torch.int32)
    words = bits.numpy().view(np.uint32)
    fill_grammars(bits, masked)  # (a verify's grammar rows: after each draft, gapless.engine.spec.grammar)
    for i, req, step in masked:
        if req.finished:
            continue
        if step < req.params.min_tokens:
            for t in req.stop_ids:
                if t < vocab_size:
                    words[i, t // 32] &= ~np.uint32(1 << (t % 32))
    return TokenMask([m.position for m in masked], bits)


class DeferredSample:
    """The `Pending` of a batch launched with `defer_sampling`: its forward's, and, once `release`d, its
    `SampleJob`'s."""

    def __init__(self, stream: DeviceStream, forward: Pending, masked: Masked, rows: int, vocab: int) -> None:
        self.stream, self.forward, self.masked, self.rows, self.vocab = stream, forward, masked, rows, vocab
        self.sample: Pending | None = None

    def release(self) -> None:
        """Every batch before this one was processed: fill the masks and submit the sampling (once)."""
        if self.sample is None:
            self.sample = self.stream.submit(SampleJob(make_mask(self.masked, self.rows, self.vocab)))

    def result(self) -> JobResult:
        self.release()
        assert self.sample is not None
        _, first = self.forward.result()
        samples, second = self.sample.result()
        idle = max(0.0, second.start - first.end)  # the device waited for the mask
        return JobResult(samples, JobTiming(first.submit, first.start, second.end, idle))


def launch(stream: DeviceStream, forward: ForwardBatch, masked: Masked, vocab_size: int) -> Pending:
    """Submit `forward`: with its mask when every token its grammars depend on is processed, else
    deferred (see the module). Call it before the batch's requests count it in flight."""
    if not masked:
        return stream.submit(forward)
    rows = len(forward.sample_rows)
    if any(m.req.grammar is not None and m.req.inflight > 0 for m in masked):
        forward.defer_sampling = True
        return DeferredSample(stream, stream.submit(forward), masked, rows, vocab_size)
    forward.token_mask = make_mask(masked, rows, vocab_size)
    return stream.submit(forward)


def release(pending: Pending) -> None:
    """Every batch before `pending`'s is processed: release it if it waits for its mask."""
    if isinstance(pending, DeferredSample):
        pending.release()
