"""The device side of a step: owns the weights, the KV pool, the device request table and the sampler.

`ModelRunner.run(batch)` is the one job the scheduler submits to the device stream per step: apply the
batch's request-table writes, run the model, sample. Everything it touches is device state; the
scheduler only ever hands it a `ForwardBatch` built from host state.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch

from gapless.attention.base import AttentionMetadata
from gapless.attention.torch_ref import TorchRefBackend
from gapless.config import EngineConfig
from gapless.memory.kv_pool import KVPool
from gapless.memory.req_table import ReqTable
from gapless.model.decoder import CausalLM, ForwardContext
from gapless.model.loader import load_model, resolve_dtype
from gapless.sampling.sampler import SampleOutput, Sampler, SamplingBatch, compute_logprobs
from gapless.tensors import dataclass_to_device

log = logging.getLogger(__name__)


@dataclass
class ForwardBatch:
    """Inputs of one forward, built on the host as CPU tensors; the device stream moves them over.

    Requests are contiguous in the flat token dimension, in `rows` order. A decode batch carries no
    input ids: each request's input is the token its previous batch sampled, which the device keeps in
    `ModelRunner.token_buf[row]` (the future-token slot). So a decode can be launched before that token
    ever reaches the host, and stream order guarantees the sampler wrote it first.
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
    sampling: SamplingBatch | None
    # (rows, positions, slots) request-table entries the batch needs besides its own new tokens:
    # prefixes matched in the radix cache
    table_writes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # (row, prompt_ids, output_ids) whose sampler penalty state is (re)built before sampling
    penalty_inits: list[tuple[int, list[int], list[int]]] = field(default_factory=list)


@dataclass(frozen=True)
class RunnerInfo:
    """What the host-side scheduler needs to know of the device side (which may live in another process)."""

    device: str
    num_pages: int
    kv_tokens: int
    max_context: int
    max_running_requests: int
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but CUDA is not available")
    return torch.device(name)


def _available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


class ModelRunner:
    def __init__(self, cfg: EngineConfig) -> None:
        self.device = pick_device(cfg.device)
        from gapless.model.config import load_model_config

        mcfg = load_model_config(cfg.model)
        self.dtype = resolve_dtype(cfg.dtype, mcfg, self.device)
        self.model: CausalLM = load_model(cfg.model, self.dtype, self.device)
        self.model_config = mcfg
        self.page_size = cfg.page_size

        max_context = mcfg.max_position_embeddings
        if cfg.max_model_len is not None:
            max_context = min(max_context, cfg.max_model_len)
        per_token = KVPool.bytes_per_token(mcfg.num_layers, mcfg.num_kv_heads, mcfg.head_dim, self.dtype)
        if cfg.kv_cache_tokens is not None:
            kv_tokens = cfg.kv_cache_tokens
        else:
            frac = cfg.kv_memory_fraction or (0.85 if self.device.type == "cuda" else 0.3)
            kv_tokens = int(_available_memory(self.device) * frac) // per_token
            kv_tokens = min(kv_tokens, cfg.max_running_requests * max_context)
        num_pages = -(-kv_tokens // cfg.page_size) + 1  # +1: page 0 is reserved for padding
        self.kv_pool = KVPool(
            mcfg.num_layers,
            num_pages,
            cfg.page_size,
            mcfg.num_kv_heads,
            mcfg.head_dim,
            self.dtype,
            self.device,
        )
        self.kv_tokens = (num_pages - 1) * cfg.page_size
        # no request can outgrow what the pool holds by itself
        self.max_context = min(max_context, self.kv_tokens)
        self.req_table = ReqTable(cfg.max_running_requests, self.max_context, self.device)
        self.sampler = Sampler(mcfg.vocab_size, cfg.max_running_requests, self.device)
        self.backend = TorchRefBackend()
        # future-token slots: the last sampled token of the request in each row (-1: none yet / consumed)
        self.token_buf = torch.full((cfg.max_running_requests,), -1, dtype=torch.int64, device=self.device)
        self.check_future_reads = False  # tests/chaos: consume slots and fail loudly on an unwritten one
        self.max_running_requests = cfg.max_running_requests
        log.info(
            "KV cache: %d tokens (%.1f MiB), max context %d",
            self.kv_tokens,
            self.kv_tokens * per_token / 2**20,
            self.max_context,
        )

    @property
    def info(self) -> RunnerInfo:
        mc = self.model_config
        return RunnerInfo(
            device=str(self.device),
            num_pages=self.kv_pool.num_pages,
            kv_tokens=self.kv_tokens,
            max_context=self.max_context,
            max_running_requests=self.max_running_requests,
            vocab_size=mc.vocab_size,
            max_position_embeddings=mc.max_position_embeddings,
            eos_token_ids=mc.eos_token_ids,
        )

    def _input_ids(self, batch: ForwardBatch) -> torch.Tensor:
        if not batch.is_decode:
            return batch.input_ids
        ids = self.token_buf[batch.rows]
        if self.check_future_reads:
            if bool((ids < 0).any()):  # a host sync, only in tests and chaos mode
                raise RuntimeError(f"decode read an unwritten future-token slot (rows {batch.rows.tolist()})")
            self.token_buf[batch.rows] = -1
        return ids

    @torch.inference_mode()
    def forward_hidden(self, batch: ForwardBatch) -> torch.Tensor:
        """Apply the batch's table writes and run the decoder; returns hidden states [T, hidden].
        `batch` must already be on this device."""
        table = self.req_table
        if batch.table_writes is not None:
            table.apply_writes(*batch.table_writes)
        table.apply_writes(batch.token_rows, batch.positions, batch.out_slots)
        meta = AttentionMetadata(
            rows=batch.rows,
            prefix_lens=batch.prefix_lens,
            extend_lens=batch.extend_lens,
            q_start=batch.q_start,
            req_table=table.device_table,
            max_extend_len=batch.max_extend_len,
            max_seq_len=batch.max_seq_len,
            is_decode=batch.is_decode,
        )
        ctx = ForwardContext(
            positions=batch.positions,
            out_slots=batch.out_slots,
            kv_pool=self.kv_pool,
            backend=self.backend,
            attn_state=self.backend.prepare(meta),
        )
        return self.model(self._input_ids(batch), ctx)

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> SampleOutput:
        """The step's device job: forward, then sample the next token of every request in `sample_index`
        and keep it in its row's future-token slot. Returns the sampled tokens (on the device), with
        logprobs when a request in the batch asked for them."""
        batch = dataclass_to_device(batch, self.device)
        if batch.penalty_inits:  # before any early return: a first chunk samples nothing but must init
            rows, prompts, outputs = zip(*batch.penalty_inits)
            self.sampler.init_rows(list(rows), list(prompts), list(outputs))
        hidden = self.forward_hidden(batch)
        if batch.sampling is None:
            return SampleOutput(torch.empty(0, dtype=torch.int64, device=self.device))
        logits = self.model.logits(hidden[batch.sample_index])
        tokens = self.sampler.sample(logits, batch.sampling)
        self.token_buf[batch.sample_rows] = tokens
        if batch.sampling.num_logprobs >= 0:
            return compute_logprobs(logits[:, : self.sampler.vocab_size], tokens, batch.sampling.num_logprobs)
        return SampleOutput(tokens)
