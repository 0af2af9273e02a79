"""The device side of a step: owns the weights, the KV pool, the device request table and the sampler.

`ModelRunner.run(batch)` is the one job the scheduler submits to the device stream per step: apply the
batch's request-table writes, run the model, sample. Everything it touches is device state; the
scheduler only ever hands it a `ForwardBatch` built from host state. Decode batches go through CUDA
graphs (`gapless.engine.cuda_graph`) when they are on.

KV cache size: `kv_cache_tokens` when given. Otherwise, on the CPU, `kv_memory_fraction` of the available
RAM; on CUDA, what `mem_fraction_static` of the GPU leaves beside the weights, and no more than the free
memory minus the activation peak (measured by a dummy prefill and decode at the largest shapes) and the
CUDA graphs' memory (`gpu_kv_tokens`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

from gapless.attention import AttentionBackend, Probe, TorchRefBackend, make_backend
from gapless.attention.base import AttentionMetadata
from gapless.config import EngineConfig
from gapless.engine.batch import ForwardBatch, RunnerInfo
from gapless.engine.cuda_graph import DEFAULT_MAX_BS, GraphRunner
from gapless.memory.kv_pool import KVPool
from gapless.memory.req_table import ReqTable
from gapless.model.decoder import CausalLM, ForwardContext
from gapless.model.loader import load_model, resolve_dtype
from gapless.sampling.sampler import SampleOutput, Sampler, SamplingBatch, compute_logprobs
from gapless.sampling_params import MAX_LOGPROBS, SamplingParams
from gapless.tensors import dataclass_to_device

log = logging.getLogger(__name__)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but CUDA is not available")
    return torch.device(name)


def _available_memory(device: torch.device) -> int:
    """Available RAM, for sizing the KV cache on the CPU."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


CPU_KV_FRACTION = 0.3  # default kv_memory_fraction
# GPU memory the measured peaks do not see: allocator fragmentation, the forward stream's cuBLAS
# workspace, the graphs' own kernel parameters
GPU_RESERVE_BYTES = 512 * 2**20


def gpu_kv_tokens(
    *,
    total: int,
    free: int,
    resident: int,
    activation_peak: int,
    graph_bytes: int,
    mem_fraction_static: float,
    bytes_per_token: int,
    reserve: int = GPU_RESERVE_BYTES,
) -> int:
    """KV tokens the pool may hold on a GPU: its bytes are the tighter of two limits.

    - The static share: what stays allocated for the runner's life (`resident`: weights, request
      state, sampler state) plus the KV pool fit in `mem_fraction_static` of the `total` memory.
    - What is `free` now (other processes' use included) must still hold the activation peak of the
      largest step, the CUDA graphs' memory pool and a `reserve`.
    """
    static = int(total * mem_fraction_static) - resident
    dynamic = free - activation_peak - graph_bytes - reserve
    return max(0, min(static, dynamic)) // bytes_per_token


# every sampling stage on, and logprobs, so a dummy step allocates what the largest real one does
_ALL_STAGES = SamplingParams(
    max_tokens=1,
    temperature=0.7,
    top_k=20,
    top_p=0.9,
    min_p=0.05,
    repetition_penalty=1.1,
    presence_penalty=0.1,
    frequency_penalty=0.1,
    logprobs=MAX_LOGPROBS,
)


def _dummy_sampling(n: int, max_rows: int, vocab_size: int) -> SamplingBatch:
    rows = [i % max_rows for i in range(n)]  # sampler rows index its penalty state: real rows only
    return SamplingBatch.build([_ALL_STAGES] * n, [0] * n, rows, [0] * n, "cpu", vocab_size=vocab_size)


def dummy_prefill(
    num_tokens: int, max_len: int, pad_row: int, max_rows: int, vocab_size: int
) -> ForwardBatch:
    """An extend batch of `num_tokens` token-0 prompts of at most `max_len` tokens each, all on `pad_row`
    and KV slot 0, each sampling its next token with every stage on. For measuring memory."""
    lens = torch.tensor([min(max_len, num_tokens - i) for i in range(0, num_tokens, max_len)])
    q_start = torch.cumsum(lens, 0) - lens
    rows = torch.full((len(lens),), pad_row, dtype=torch.int64)
    return ForwardBatch(
        input_ids=torch.zeros(num_tokens, dtype=torch.int64),
        positions=torch.cat([torch.arange(n) for n in lens.tolist()]),
        out_slots=torch.zeros(num_tokens, dtype=torch.int64),
        token_rows=torch.full((num_tokens,), pad_row, dtype=torch.int64),
        rows=rows,
        prefix_lens=torch.zeros(len(lens), dtype=torch.int64),
        extend_lens=lens,
        q_start=q_start,
        max_extend_len=int(lens.max()),
        max_seq_len=int(lens.max()),
        is_decode=False,
        sample_index=q_start + lens - 1,
        sample_rows=rows,
        sampling=_dummy_sampling(len(lens), max_rows, vocab_size),
    )


def dummy_decode(batch_size: int, pad_row: int, max_rows: int, vocab_size: int) -> ForwardBatch:
    """A decode batch of `batch_size` requests, all on `pad_row` at position 0 and KV slot 0, sampling
    with every stage on. For measuring memory."""
    rows = torch.full((batch_size,), pad_row, dtype=torch.int64)
    zeros = torch.zeros(batch_size, dtype=torch.int64)
    return ForwardBatch(
        input_ids=torch.empty(0, dtype=torch.int64),
        positions=zeros,
        out_slots=zeros,
        token_rows=rows,
        rows=rows,
        prefix_lens=zeros,
        extend_lens=torch.ones(batch_size, dtype=torch.int64),
        q_start=torch.arange(batch_size),
        max_extend_len=1,
        max_seq_len=1,
        is_decode=True,
        sample_index=torch.arange(batch_size),
        sample_rows=rows,
        sampling=_dummy_sampling(batch_size, max_rows, vocab_size),
    )


class ModelRunner:
    def __init__(self, cfg: EngineConfig) -> None:
        self.device = pick_device(cfg.device)
        from gapless.model.config import load_model_config

        mcfg = load_model_config(cfg.model)
        self.dtype = resolve_dtype(cfg.dtype, mcfg, self.device)
        self.model: CausalLM = load_model(cfg.model, self.dtype, self.device)
        self.model_config = mcfg
        self.page_size = cfg.page_size
        self.max_running_requests = max_rows = cfg.max_running_requests
        probe = Probe(mcfg.num_heads, mcfg.num_kv_heads, mcfg.head_dim, self.dtype)
        self.backend: AttentionBackend = make_backend(cfg.attention_backend, self.device, probe)
        if self.device.type == "cuda" and cfg.kv_memory_fraction is not None:
            raise ValueError(
                "kv_memory_fraction sizes the KV cache on the CPU; on CUDA set mem_fraction_static "
                "(share of GPU memory for weights + KV) or kv_cache_tokens"
            )

        max_context = mcfg.max_position_embeddings
        if cfg.max_model_len is not None:
            max_context = min(max_context, cfg.max_model_len)
        self.sampler = Sampler(mcfg.vocab_size, max_rows, self.device)
        # One request-table row and token slot past the scheduler's rows, never handed out: padded decode
        # rows (CUDA graphs) and memory-measuring dummies use it. Its token slot always holds a valid id.
        self.pad_row = max_rows
        # future-token slots: the last sampled token of the request in each row (-1: none yet / consumed)
        self.token_buf = torch.full((max_rows + 1,), -1, dtype=torch.int64, device=self.device)
        self.token_buf[self.pad_row] = 0
        self.check_future_reads = False  # tests/chaos: consume slots and fail loudly on an unwritten one
        self.graphs: GraphRunner | None = None
        graph_bs = self._graph_max_bs(cfg)

        per_token = KVPool.bytes_per_token(mcfg.num_layers, mcfg.num_kv_heads, mcfg.head_dim, self.dtype)
        sizing = ""
        if cfg.kv_cache_tokens is not None:
            kv_tokens = cfg.kv_cache_tokens
        else:
            if self.device.type == "cuda":
                kv_tokens, sizing = self._gpu_kv_tokens(cfg, max_context, per_token, graph_bs)
            else:
                frac = cfg.kv_memory_fraction or CPU_KV_FRACTION
                kv_tokens = int(_available_memory(self.device) * frac) // per_token
            kv_tokens = min(kv_tokens, max_rows * max_context)
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
        self.req_table = ReqTable(max_rows + 1, self.max_context, self.device)
        log.info(
            "KV cache: %d tokens (%.1f MiB), max context %d%s",
            self.kv_tokens,
            self.kv_tokens * per_token / 2**20,
            self.max_context,
            sizing,
        )
        if graph_bs:
            self.graphs = GraphRunner(
                graph_bs,
                forward_tokens=self.forward_tokens,
                req_table=self.req_table,
                token_buf=self.token_buf,
                pad_row=self.pad_row,
                max_context=self.max_context,
                hidden_size=mcfg.hidden_size,
                dtype=self.dtype,
            )
            self.graphs.capture()

    def _graph_max_bs(self, cfg: EngineConfig) -> int:
        """Largest decode batch run through the graph runner; 0: none. By default graphs are on for CUDA
        with a kernel backend: the torch reference would attend over the whole max context in a graph."""
        if cfg.cuda_graph_max_bs is not None:
            n = cfg.cuda_graph_max_bs
        elif self.device.type == "cuda" and not isinstance(self.backend, TorchRefBackend):
            n = DEFAULT_MAX_BS
        else:
            n = 0
        return min(n, cfg.max_running_requests)

    def _gpu_kv_tokens(
        self, cfg: EngineConfig, max_context: int, per_token: int, graph_bs: int
    ) -> tuple[int, str]:
        """KV tokens that fit the GPU (see `gpu_kv_tokens`), and a note for the log line. Measures the
        activation peak with dummy steps on a one-page pool, before the real pool exists."""
        mcfg, dev = self.model_config, self.device
        width = min(max_context, cfg.chunked_prefill_size)
        self.kv_pool = KVPool(
            mcfg.num_layers, 1, cfg.page_size, mcfg.num_kv_heads, mcfg.head_dim, self.dtype, dev
        )
        self.req_table = ReqTable(self.max_running_requests + 1, width, dev)
        peak, graph_bytes = self.measure_activations(cfg.chunked_prefill_size, graph_bs)
        del self.kv_pool, self.req_table
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        resident = torch.cuda.memory_allocated(dev)
        tokens = gpu_kv_tokens(
            total=total,
            free=free,
            resident=resident,
            activation_peak=peak,
            graph_bytes=graph_bytes,
            mem_fraction_static=cfg.mem_fraction_static,
            bytes_per_token=per_token,
        )
        gib = 2**30
        note = (
            f" (mem_fraction_static={cfg.mem_fraction_static} of {total / gib:.1f} GiB, {free / gib:.1f} GiB "
            f"free: {resident / gib:.2f} GiB resident, activation peak {peak / gib:.2f} GiB, "
            f"CUDA graphs {graph_bytes / gib:.2f} GiB)"
        )
        if tokens < cfg.page_size:
            raise RuntimeError(
                f"no GPU memory left for the KV cache{note}; raise mem_fraction_static, lower "
                "chunked_prefill_size or max_running_requests, or set kv_cache_tokens"
            )
        return tokens, note

    @torch.inference_mode()
    def measure_activations(self, prefill_tokens: int, graph_bs: int) -> tuple[int, int]:
        """Bytes above what stays allocated: (the peak of a dummy prefill of `prefill_tokens` tokens and a
        dummy decode of `max_running_requests` rows, sampling with every stage on; the peak of a decode
        forward of `graph_bs` rows, which is about what the graphs' shared memory pool keeps).

        Runs on the current pool and table, writing only the padding row and KV slot 0, and leaves the
        token slots and penalty state as new. Each dummy runs once unmeasured first, so what it allocates
        for good (the sampler's penalty state, kernels, library handles) counts as resident, not as peak.
        On the CPU the dummies run and both numbers are 0."""
        vocab, max_rows, pad = self.model_config.vocab_size, self.max_running_requests, self.pad_row
        prefill = dummy_prefill(prefill_tokens, self.req_table.max_context, pad, max_rows, vocab)
        decode = dummy_decode(max_rows, pad, max_rows, vocab)

        def step() -> None:
            self.run(prefill)
            self.run(decode)

        step()
        peak = self._peak_bytes(step)
        graph_bytes = 0
        if graph_bs:
            fwd = dataclass_to_device(dummy_decode(graph_bs, pad, max_rows, vocab), self.device)
            graph_bytes = self._peak_bytes(lambda: self.forward_hidden(fwd))
        self.token_buf.fill_(-1)
        self.token_buf[self.pad_row] = 0
        for state in (self.sampler.output_counts, self.sampler.prompt_mask):
            if state is not None:
                state.zero_()
        return peak, graph_bytes

    def _peak_bytes(self, fn: Callable[[], object]) -> int:
        if self.device.type != "cuda":
            fn()
            return 0
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        fn()
        torch.cuda.synchronize(self.device)
        return max(0, torch.cuda.max_memory_allocated(self.device) - base)

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

    def _check_future_slots(self, rows: torch.Tensor) -> None:
        if bool((self.token_buf[rows] < 0).any()):  # a host sync, only in tests and chaos mode
            raise RuntimeError(f"decode read an unwritten future-token slot (rows {rows.tolist()})")

    def forward_tokens(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        out_slots: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The decoder over a flat batch whose slots are already in the request table; hidden [T, hidden]."""
        ctx = ForwardContext(
            positions=positions,
            out_slots=out_slots,
            kv_pool=self.kv_pool,
            backend=self.backend,
            attn_state=self.backend.prepare(meta),
        )
        return self.model(input_ids, ctx)

    @torch.inference_mode()
    def forward_hidden(self, batch: ForwardBatch) -> torch.Tensor:
        """Apply the batch's table writes and run the decoder (through the graph runner when it takes the
        batch); returns hidden states [T, hidden]. `batch` must already be on this device."""
        table = self.req_table
        if batch.table_writes is not None:
            table.apply_writes(*batch.table_writes)
        consume = batch.is_decode and self.check_future_reads
        if consume:
            self._check_future_slots(batch.rows)
        if self.graphs is not None and self.graphs.can_run(batch):
            hidden = self.graphs.run(batch)
        else:
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
            # a decode's inputs are its rows' future-token slots
            input_ids = self.token_buf[batch.rows] if batch.is_decode else batch.input_ids
            hidden = self.forward_tokens(input_ids, batch.positions, batch.out_slots, meta)
        if consume:  # the forward has read the slots (stream order): mark them consumed
            self.token_buf[batch.rows] = -1
        return hidden

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
