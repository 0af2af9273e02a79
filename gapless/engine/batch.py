"""The batch types the host and the device side share: what one forward runs, and what the host needs
to know of the device side.

The scheduler builds a `ForwardBatch` from host state; the device stream moves it to the device; the
model runner and the CUDA graph runner read it. `RunnerInfo` travels the other way, once, at start-up.
This module imports nothing of the engine, so every side can import it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field, fields

import torch

from gapless.attention.base import AttentionMetadata
from gapless.engine.spec.inputs import HistoryWrites, VerifyInputs
from gapless.sampling.logprobs import PromptScoreAsk
from gapless.sampling.mask import TokenMask
from gapless.sampling.rows import RowParams, SampleFlags


@dataclass
class ForwardBatch:
    """Inputs of one forward, built on the host as CPU tensors; the device stream moves them over.

    Requests are contiguous in the flat token dimension, in `rows` order. A decode batch carries no
    input ids: each request's input is the token its previous batch sampled, which the device keeps in
    `ModelRunner.token_buf[row]` (the future-token slot). So a decode can be launched before that token
    ever reaches the host, and stream order guarantees the sampler wrote it first. Nor does it carry
    sampling settings: the sampler keeps them per row (`row_params`, sent once, by the batch that
    admits a request), so a batch brings only its sampling rows' step counts and the stages to run.

    The scheduler builds the tensors as views of as few host buffers as it can (a decode: one), so the
    stream moves each buffer in one copy (`gapless.tensors.dataclass_to_device`).
    """

    input_ids: torch.Tensor  # [T] extend tokens; empty in decode (read from the token slots)
    positions: torch.Tensor  # [T]
    out_slots: torch.Tensor  # [T] KV slot each new token is stored in
    token_rows: torch.Tensor  # [T] request-table row of each token
    rows: torch.Tensor  # [B]
    prefix_lens: torch.Tensor  # [B]
    extend_lens: torch.Tensor  # [B]
    q_start: torch.Tensor  # [B]
    max_extend_len: int
    max_seq_len: int
    is_decode: bool
    sample_index: torch.Tensor  # [S] flat index of the tokens whose next token is sampled
    sample_rows: torch.Tensor  # [S] their rows: where the sampled tokens are kept for the next decode
    sample_steps: torch.Tensor  # [S] output tokens each of them had before this one (its random stream)
    sampling: SampleFlags | None  # the sampling stages the batch needs; None: it samples nothing
    # sampling values of the requests this batch admits, kept per row by the sampler from now on
    row_params: RowParams | None = None
    # (rows, positions, slots) request-table entries the batch needs besides its own new tokens:
    # prefixes matched in the radix cache
    table_writes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # (row, prompt_ids, output_ids) whose sampler penalty state is (re)built before sampling
    penalty_inits: list[tuple[int, list[int], list[int]]] = field(default_factory=list)
    # prompt positions whose logprobs the batch returns (requests with prompt_logprobs), else None
    prompt_scores: PromptScoreAsk | None = None

    # allowed tokens of the rows a grammar or min_tokens constrains (`gapless.engine.grammar`)
    token_mask: TokenMask | None = None
    # the mask waits for the previous batch's tokens: run the forward and keep the logits; a `SampleJob`
    # with the mask, submitted next once the host has it, samples them
    defer_sampling: bool = False

    # speculative decoding (gapless.engine.spec): a verify batch's inputs, or an extend's token history
    spec: VerifyInputs | HistoryWrites | None = None

    @property
    def reads_future_tokens(self) -> bool:
        """Whether the batch's inputs are its rows' future-token slots: a decode's, or a verify's."""
        return self.is_decode or isinstance(self.spec, VerifyInputs)

    def attention_metadata(self, req_table: torch.Tensor) -> AttentionMetadata:
        """What attention reads of this batch (its fields of the same names), with the device's
        request table."""
        # (a batch's max_seq_len is its longest request's: `static` stays False, as only a graph sets it)
        shared = {
            f.name: getattr(self, f.name)
            for f in fields(AttentionMetadata)
            if f.name not in ("req_table", "static")
        }
        return AttentionMetadata(req_table=req_table, **shared)


DECODE_VECTORS = 6  # a decode batch's index vectors: rows, positions, KV slots, ones, 0..n-1, steps


def decode_batch(
    vectors: Sequence[torch.Tensor],
    max_seq_len: int,
    sampling: SampleFlags | None,
    table_writes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> ForwardBatch:
    """The decode batch whose `DECODE_VECTORS` index vectors are `vectors` (in that order): the one place
    that says which field each vector is, for the scheduler that builds a decode and for the device
    process that rebuilds one from the bytes of its buffer (`decode_from_bytes`)."""
    rows, positions, out_slots, ones, ar, steps = vectors
    return ForwardBatch(
        input_ids=ar[:0],  # the device reads each row's future-token slot
        positions=positions,
        out_slots=out_slots,
        token_rows=rows,
        rows=rows,
        prefix_lens=positions,
        extend_lens=ones,
        q_start=ar,
        max_extend_len=1,
        max_seq_len=max_seq_len,
        is_decode=True,
        sample_index=ar,
        sample_rows=rows,
        sample_steps=steps,
        sampling=sampling,
        table_writes=table_writes,
    )


# every field of a `ForwardBatch` that has a default (what rides with a batch only sometimes), with it:
# a batch that carries none of them is a plain decode's, whatever fields are added later
_OPTIONAL_FIELDS = [
    (f, f.default_factory() if f.default is MISSING else f.default)  # type: ignore[misc]
    for f in fields(ForwardBatch)
    if f.default is not MISSING or f.default_factory is not MISSING
]


def plain_decode_buffer(batch: ForwardBatch) -> torch.Tensor | None:
    """The [DECODE_VECTORS, B] buffer whose rows are the index vectors of `batch`, when `batch` is a plain
    decode made by `decode_batch` from one such buffer and nothing else rides with it (every optional
    field at its default: no table writes, mask, new rows or speculative inputs); else None. Such a
    batch travels to the device process as its buffer's bytes and three scalars' worth of header
    (`gapless.engine.stream.process`) instead of a pickled dataclass of views: the launch's largest cost
    at 256 rows."""
    if not batch.is_decode or any(getattr(batch, f.name) != default for f, default in _OPTIONAL_FIELDS):
        return None
    rows, n = batch.rows, batch.rows.shape[0]
    storage = rows.untyped_storage()
    if rows.device.type != "cpu" or rows.storage_offset() != 0 or storage.nbytes() != DECODE_VECTORS * n * 8:
        return None
    buf = torch.empty(0, dtype=torch.int64).set_(storage, 0, (DECODE_VECTORS, n))
    if batch.sample_steps.data_ptr() != buf[DECODE_VECTORS - 1].data_ptr():  # not decode_batch's layout
        return None
    return buf


def decode_from_bytes(data: bytes, max_seq_len: int, sampling: SampleFlags | None) -> ForwardBatch:
    """The decode batch `plain_decode_buffer` found, from its buffer's bytes (a writable copy)."""
    buf = torch.frombuffer(bytearray(data), dtype=torch.int64).view(DECODE_VECTORS, -1)
    return decode_batch(buf.unbind(0), max_seq_len, sampling)


@dataclass
class SampleJob:
    """The second half of a batch launched with `defer_sampling`: sample its kept logits under `mask`.
    The host submits it when the previous batch's tokens have advanced the grammars, so the forward ran
    meanwhile; stream order puts it before the next batch's forward, which reads the tokens it samples."""

    mask: TokenMask | None


DeviceJob = ForwardBatch | SampleJob  # what a device stream runs


@dataclass(frozen=True)
class RunnerInfo:
    """What the host-side scheduler needs to know of the device side (which may live in another process)."""

    device: str
    num_pages: int
    kv_tokens: int
    max_context: int
    max_running_requests: int
    chunked_prefill_size: int  # as chosen for the device when the config left it unset (engine.defaults)
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    # the model's sliding window and which layers slide: a request's KV behind the window is freed when
    # every layer slides (gapless.engine.scheduler.window)
    sliding_window: int | None = None
    window_layers: tuple[bool, ...] = ()
