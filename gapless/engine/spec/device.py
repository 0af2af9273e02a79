"""The device side of speculative decoding: per-row state that the next verify reads, kept in stream order.

Each request-table row holds, on the device, its tokens so far (prompt and accepted output), its
committed KV length and its prompt length. An extend batch fills them for its rows; a verify batch reads
them to place its tokens (positions, KV slots, the drafts and the sampling steps) and, once sampled,
advances them by what it accepted. So a verify can be launched before the host knows what the previous
one accepted: stream order guarantees that the previous one has written them first.
"""

from __future__ import annotations

import dataclasses

import torch

from gapless.engine.batch import ForwardBatch
from gapless.engine.spec.draft import DraftModel
from gapless.engine.spec.inputs import HistoryWrites, VerifyInputs
from gapless.engine.spec.ngram import ngram_drafts
from gapless.memory.req_table import ReqTable
from gapless.sampling.mask import TokenMask
from gapless.sampling.speculative import accept_lengths


class SpecState:
    """Per-row token history, committed KV length and prompt length, for rows [0, num_rows); and the draft
    model, when one proposes the drafts (else they are n-gram lookups in the history)."""

    def __init__(
        self,
        num_rows: int,
        max_context: int,
        max_drafts: int,
        device: torch.device,
        draft: DraftModel | None = None,
    ) -> None:
        self.draft = draft
        # room past the context for the tokens a verify samples beyond what it accepts (never read)
        self.width = max_context + max_drafts + 2
        self.tokens = torch.zeros(num_rows, self.width, dtype=torch.int64, device=device)
        self.kv_lens = torch.zeros(num_rows, dtype=torch.int64, device=device)
        self.prompt_lens = torch.zeros(num_rows, dtype=torch.int64, device=device)

    def prepare(self, batch: ForwardBatch, token_buf: torch.Tensor, req_table: ReqTable) -> ForwardBatch:
        """Before the forward: an extend's history writes; a verify's positions, KV slots, input ids
        (the row's last token, then its drafts), prefix lengths and sampling steps, read from the rows'
        state. `batch` is on the device."""
        spec = batch.spec
        if isinstance(spec, HistoryWrites):
            self.tokens[spec.rows, spec.positions] = spec.tokens
            return batch
        if not isinstance(spec, VerifyInputs):
            return batch
        if batch.table_writes is not None:  # the slots taken for this step, read just below
            req_table.apply_writes(*batch.table_writes)
        table = req_table.device_table
        assert table is not None, "a verify reads the request table on its device"
        kv_lens = self.kv_lens[batch.rows]
        positions = kv_lens[spec.batch_index] + spec.offsets
        input_ids = token_buf[batch.token_rows]
        if spec.max_drafts:
            drafts = self._drafts(batch, kv_lens, input_ids[batch.q_start], spec, req_table)
            drafted = drafts[spec.batch_index, (spec.offsets - 1).clamp(min=0)]
            input_ids = torch.where(spec.offsets > 0, drafted, input_ids)
        return dataclasses.replace(
            batch,
            input_ids=input_ids,
            positions=positions,
            out_slots=table[batch.token_rows, positions].long(),
            prefix_lens=kv_lens,
            sample_steps=positions + 1 - self.prompt_lens[batch.token_rows],
            table_writes=None,
        )

    def _drafts(
        self,
        batch: ForwardBatch,
        kv_lens: torch.Tensor,
        last: torch.Tensor,
        spec: VerifyInputs,
        table: ReqTable,
    ) -> torch.Tensor:
        """Each request's drafts [B, max_drafts]: the draft model's, or n-gram lookups in its history."""
        if self.draft is not None:
            num = batch.extend_lens - 1
            return self.draft.propose(
                batch.rows, kv_lens, last, num, spec.max_drafts, table, batch.max_seq_len
            )
        window = self.tokens[batch.rows, : min(batch.max_seq_len + 1, self.width)]
        return ngram_drafts(window, kv_lens + 1, spec.max_drafts, spec.ngram_min, spec.ngram_max)

    @staticmethod
    def verify_mask(batch: ForwardBatch, mask: TokenMask | None) -> TokenMask | None:
        """A verify's token mask as sampling applies it: each position's mask only where its true output
        step (`prepare`) is below the step the host made it up to (min_tokens'); the rest allow all. The
        mask may come with the batch or after it (a `SampleJob`), so this runs at sampling."""
        spec = batch.spec
        if mask is None or not isinstance(spec, VerifyInputs) or spec.keep_mask_below is None:
            return mask
        under = (batch.sample_steps < spec.keep_mask_below)[:, None]
        return dataclasses.replace(mask, bits=torch.where(under, mask.bits, torch.full_like(mask.bits, -1)))

    def keep(self, batch: ForwardBatch, sampled: torch.Tensor, token_buf: torch.Tensor) -> torch.Tensor:
        """After sampling: keep each row's next input in its future-token slot and advance its state.
        Returns what goes to the host: the sampled tokens, and for a verify also the accepted drafts
        per request appended ([T + B])."""
        spec = batch.spec
        if not isinstance(spec, VerifyInputs):  # an extend, or a plain decode: each row's next token
            token_buf[batch.sample_rows] = sampled
            last = batch.positions[batch.sample_index]
            self.tokens[batch.sample_rows, last + 1] = sampled
            self.kv_lens[batch.sample_rows] = last + 1
            self.prompt_lens[batch.sample_rows] = last + 1 - batch.sample_steps
            return sampled
        accepted = accept_lengths(
            sampled, batch.input_ids, spec.batch_index, spec.offsets, batch.rows.shape[0], spec.max_drafts
        )
        token_buf[batch.rows] = sampled[batch.q_start + accepted]
        # the token after each position: what was accepted, and beyond it tokens no later step reads
        self.tokens[batch.token_rows, batch.positions + 1] = sampled
        self.kv_lens[batch.rows] = batch.prefix_lens + accepted + 1
        return torch.cat([sampled, accepted])
