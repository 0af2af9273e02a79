"""The batch types the host and the device side share: what one forward runs, and what the host needs
to know of the device side.

The scheduler builds a `ForwardBatch` from host state; the device stream moves it to the device; the
model runner and the CUDA graph runner read it. `HostSamples` (a batch's sampled tokens, as lists) and
`RunnerInfo` (once, at start-up) travel the other way. This module imports nothing of the engine but the
speculative inputs and the pooling ask, and not the device sampler, so every side can import it.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING, Generic, NamedTuple, TypeVar

import torch

from gapless.attention.base import AttentionMetadata
from gapless.engine.pooling import PoolAsk
from gapless.engine.spec.inputs import HistoryWrites, VerifyInputs
from gapless.sampling.logprobs import PromptLogprob, PromptScoreAsk, host_scores
from gapless.sampling.mask import TokenMask
from gapless.sampling.rows import RowParams, SampleFlags
from gapless.tensors import ALIGN_BYTES

if TYPE_CHECKING:
    from gapless.engine.vision import ImageBatch, RopeBatch
    from gapless.lora.table import LoRALoad
    from gapless.sampling.sampler import SampleOutput

V = TypeVar("V")  # a vector: a host numpy array or a tensor


class TableWrites(NamedTuple):
    """Request-table entries a batch writes on the device before its forward: `slots[i]` at
    (`rows[i]`, `positions[i]`)."""

    rows: torch.Tensor  # int64
    positions: torch.Tensor  # int64
    slots: torch.Tensor  # int64


class PenaltyInit(NamedTuple):
    """A row whose sampler penalty state is (re)built from its tokens before the batch samples (copies:
    the device side must never read lists the host goes on mutating)."""

    row: int
    prompt_ids: list[int]
    output_ids: list[int]


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
    # request-table entries the batch needs besides its own new tokens: prefixes matched in the radix
    # cache, slots taken ahead
    table_writes: TableWrites | None = None
    # rows whose sampler penalty state is (re)built before sampling
    penalty_inits: list[PenaltyInit] = field(default_factory=list)
    # prompt positions whose logprobs the batch returns (requests with prompt_logprobs), else None
    prompt_scores: PromptScoreAsk | None = None
    # positions a pooling model's requests pool (embed, score: gapless.engine.pooling), else None
    pool: PoolAsk | None = None

    # allowed tokens of the rows a grammar or min_tokens constrains (`gapless.engine.grammar`)
    token_mask: TokenMask | None = None
    # the mask waits for the previous batch's tokens: run the forward and keep the logits; a `SampleJob`
    # with the mask, submitted next once the host has it, samples them
    defer_sampling: bool = False

    # speculative decoding (gapless.engine.spec): a verify batch's inputs, or an extend's token history
    spec: VerifyInputs | HistoryWrites | None = None

    # LoRA (gapless.lora): each token's adapter slot ([T] int64, -1: the base model; None: every row runs
    # the base), and the adapters the device puts into their slots before the forward
    lora_slots: torch.Tensor | None = None
    lora_loads: list[LoRALoad] = field(default_factory=list)
    # a vision-language model's image tokens in this extend: the encoder's rows replace their embeddings
    images: ImageBatch | None = None
    # [T] int64: each token's last visible position where an image attends both ways (Gemma 3), else None
    # (`AttentionMetadata.q_limits`, `gapless.engine.vision.image_limits`)
    q_limits: torch.Tensor | None = None
    # an M-RoPE model's extend of prompts with images: its positions over time, height and width
    rope: RopeBatch | None = None

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


class DecodeVectors(NamedTuple, Generic[V]):
    """A decode batch's index vectors ([B] int64 each), in the order of the rows of the one buffer they
    are views of: the one place that says which field each is, for the scheduler that builds a decode
    (as numpy rows, then tensors) and for the device process that rebuilds one from the bytes of its
    buffer (`decode_from_bytes`)."""

    rows: V
    positions: V  # each new token's position: its request's kv_len before the step
    out_slots: V  # its KV slot
    ones: V  # every request extends by one token
    token_index: V  # 0..B-1: each request's one token, and its sampled row
    steps: V  # output tokens each request had before this one (its random stream)


DECODE_VECTORS = len(DecodeVectors._fields)


def decode_width(n: int) -> int:
    """The row pitch, in elements, of the [DECODE_VECTORS, width] buffer of a decode of `n` requests: `n`
    padded so that every vector starts `ALIGN_BYTES`-aligned, as `gapless.tensors.packed` starts them."""
    return n + -n % (ALIGN_BYTES // 8)


def decode_batch(
    vectors: DecodeVectors[torch.Tensor],
    max_seq_len: int,
    sampling: SampleFlags | None,
    table_writes: TableWrites | None = None,
) -> ForwardBatch:
    """The decode batch of `vectors`."""
    v = vectors
    return ForwardBatch(
        input_ids=v.token_index[:0],  # the device reads each row's future-token slot
        positions=v.positions,
        out_slots=v.out_slots,
        token_rows=v.rows,
        rows=v.rows,
        prefix_lens=v.positions,
        extend_lens=v.ones,
        q_start=v.token_index,
        max_extend_len=1,
        max_seq_len=max_seq_len,
        is_decode=True,
        sample_index=v.token_index,
        sample_rows=v.rows,
        sample_steps=v.steps,
        sampling=sampling,
        table_writes=table_writes,
    )


# every field of a `ForwardBatch` that has a default (what rides with a batch only sometimes), with it:
# a batch that carries none of them is a plain decode's, whatever fields are added later
_OPTIONAL_FIELDS = [
    (f, f.default if f.default_factory is MISSING else f.default_factory())
    for f in fields(ForwardBatch)
    if f.default is not MISSING or f.default_factory is not MISSING
]


def plain_decode_buffer(batch: ForwardBatch) -> torch.Tensor | None:
    """The [DECODE_VECTORS, decode_width(B)] buffer whose rows hold the index vectors of `batch`, when
    `batch` is a plain decode made by `decode_batch` from one such buffer and nothing else rides with it
    (every optional field at its default: no table writes, mask, new rows or speculative inputs); else
    None. Such a batch travels to the device process as its buffer's bytes and four scalars' worth of
    header (`gapless.engine.stream.process`) instead of a pickled dataclass of views: the launch's
    largest cost at 256 rows."""
    if not batch.is_decode or any(getattr(batch, f.name) != default for f, default in _OPTIONAL_FIELDS):
        return None
    rows, width = batch.rows, decode_width(batch.rows.shape[0])
    storage = rows.untyped_storage()
    if rows.device.type != "cpu" or rows.storage_offset() or storage.nbytes() != DECODE_VECTORS * width * 8:
        return None
    buf = torch.empty(0, dtype=torch.int64).set_(storage, 0, (DECODE_VECTORS, width), (width, 1))
    if batch.sample_steps.data_ptr() != buf[DECODE_VECTORS - 1].data_ptr():  # not decode_batch's layout
        return None
    return buf


def decode_from_bytes(data: bytes, n: int, max_seq_len: int, sampling: SampleFlags | None) -> ForwardBatch:
    """The decode batch of `n` requests `plain_decode_buffer` found, from its buffer's bytes (a writable
    copy)."""
    buf = torch.frombuffer(bytearray(data), dtype=torch.int64).view(DECODE_VECTORS, -1)[:, :n]
    return decode_batch(DecodeVectors(*buf.unbind(0)), max_seq_len, sampling)


@dataclass
class SampleJob:
    """The second half of a batch launched with `defer_sampling`: sample its kept logits under `mask`.
    The host submits it when the previous batch's tokens have advanced the grammars, so the forward ran
    meanwhile; stream order puts it before the next batch's forward, which reads the tokens it samples."""

    mask: TokenMask | None


DeviceJob = ForwardBatch | SampleJob  # what a device stream runs


@dataclass
class HostSamples:
    """A batch's `SampleOutput` on the host, as lists: what the scheduler folds into request state."""

    tokens: list[int]
    logprobs: list[float] | None = None
    top: list[list[tuple[int, float]]] | None = None  # per row: (token, logprob), most likely first
    prompt: list[PromptLogprob] | None = None  # per scored prompt position (gapless.sampling.logprobs)
    pooled: list[list[float]] | None = None  # per pooled request of the batch (gapless.engine.pooling)

    @classmethod
    def from_tensors(cls, out: SampleOutput, host: list[torch.Tensor] | None = None) -> HostSamples:
        """Convert, reading `host` (copies of `out.tensors()`, same order) when given."""
        tensors = host if host is not None else out.tensors()
        if out.pooled is not None:  # the last tensor, after the prompt scores
            pooled, tensors = tensors[-1].tolist(), tensors[:-1]
        else:
            pooled = None
        own = 1 if out.logprobs is None else 4
        prompt = host_scores(tensors[own:]) if out.prompt is not None else None
        tokens = tensors[0].tolist()
        if out.logprobs is None:
            return cls(tokens, prompt=prompt, pooled=pooled)
        logprobs, top_ids, top_lps = (t.tolist() for t in tensors[1:4])
        top = [list(zip(ids, lps)) for ids, lps in zip(top_ids, top_lps)]
        return cls(tokens, logprobs, top, prompt, pooled)


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
    weights: str = ""  # the weights' format and bytes, for the start-up line (gapless.model.quant)
    quantization: str | None = None  # the layers' quantized format(s), vLLM's names; None: float
    weight_formats: tuple[tuple[str, int], ...] = ()  # (format, layers holding it), for /v1/models, /metrics
    kv_cache: str = ""  # the KV cache's element type and bytes per token, for the start-up line
