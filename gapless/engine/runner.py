"""The device side of a step: owns the weights, the KV pool, the device request table and the sampler.

`ModelRunner.run(batch)` is the one job the scheduler submits to the device stream per step: apply the batch's
request-table writes, run the model, sample. Everything it touches is device state; the scheduler only ever
hands it a `ForwardBatch` built from host state. Decodes run through CUDA graphs (`gapless.engine.cuda_graph`)
when on, small prefills through piecewise ones (`gapless.engine.piecewise_graph`).

The KV pool's size comes from `gapless.engine.memory_plan`; on CUDA the runner first measures its own
activation peak (`measure_activations`) on a one-page pool, which is dropped before the real one is made.
"""

from __future__ import annotations

import copy
import dataclasses
import logging

import torch

from gapless.attention import AttentionBackend, Probe, TorchRefBackend, make_backend
from gapless.attention.base import AttentionMetadata
from gapless.config import EngineConfig
from gapless.engine.batch import DeviceJob, ForwardBatch, RunnerInfo, SampleJob
from gapless.engine.cpu_dtype import slow_dtype_warning
from gapless.engine.cuda_graph import DEFAULT_MAX_BS, SAMPLED_MAX_BS, GraphRunner, SampleTokens
from gapless.engine.defaults import apply_device_defaults, device_memory
from gapless.engine.memory_plan import (
    CpuKVPlan,
    GpuKVPlan,
    allocated_bytes,
    available_ram,
    dummy_decode,
    dummy_prefill,
    encoder_bytes,
    encoder_images,
    peak_bytes,
    plan_cpu_kv,
    plan_gpu_kv,
)
from gapless.engine.piecewise_graph import PiecewiseGraphs
from gapless.engine.pooling import pool_hidden
from gapless.engine.spec.device import SpecState
from gapless.engine.spec.draft import load_draft
from gapless.engine.vision import EncoderCache
from gapless.lora.table import make_lora_table
from gapless.memory.kv_pool import KVPool, kv_cache_dtype
from gapless.memory.req_table import ReqTable
from gapless.model import parallel
from gapless.model.config import load_model_config
from gapless.model.decoder import CausalLM, ForwardContext, ImageRows
from gapless.model.fused import use_fused_kernels
from gapless.model.loader import load_model, resolve_dtype
from gapless.model.quant import quantization, weights_held, weights_summary
from gapless.sampling.fused import draw_kernel, nucleus_kernel, penalty_kernel
from gapless.sampling.logprobs import PromptScores, score_prompt
from gapless.sampling.mask import TokenMask
from gapless.sampling.rows import RowParams, SampleFlags
from gapless.sampling.sampler import SampleOutput, Sampler, compute_logprobs
from gapless.sampling_params import SamplingParams
from gapless.tensors import dataclass_to_device

log = logging.getLogger(__name__)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but CUDA is not available")
    return torch.device(name)


class ModelRunner:
    """The weights, KV pool, device request table, future-token slots and sampler of one device, and the
    job that runs a batch on them (`run`)."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.device = pick_device(cfg.device)
        # options left unset get their device's default here, before anything is sized from them
        cfg = apply_device_defaults(cfg, self.device.type, device_memory(self.device))
        assert cfg.chunked_prefill_size is not None
        self.chunked_prefill_size: int = cfg.chunked_prefill_size
        # what the process held before this runner: other tensors, other engines. The KV plan counts only
        # what the runner adds on top as its own (see `plan_gpu_kv`)
        allocated_before = allocated_bytes(self.device)
        if self.device.type == "cuda" and cfg.kv_cache_memory_gib is not None:
            raise ValueError(
                "kv_cache_memory_gib sizes the KV cache on the CPU; on CUDA set mem_fraction_static "
                "(share of GPU memory for weights + KV) or kv_cache_tokens"
            )
        # this rank's attention and KV heads under tensor parallelism (gapless.engine.tp); the whole model's
        mcfg = parallel.rank_view(load_model_config(cfg.model), parallel.current())
        # EngineConfig refused a max_model_len past the model's own unless told to allow it
        max_context = cfg.max_model_len or mcfg.max_position_embeddings
        self.dtype = resolve_dtype(cfg.dtype, mcfg, self.device, cfg.model, cfg.quantization)
        if self.device.type == "cpu" and (why := slow_dtype_warning(self.dtype)):
            log.warning(why)
        self.model: CausalLM = load_model(
            cfg.model,
            self.dtype,
            self.device,
            max_positions=max_context,
            quantization=cfg.quantization,
            dummy=cfg.load_format == "dummy",
        )
        self.kv_dtype = kv_cache_dtype(cfg.kv_cache_dtype, self.dtype, self.model.kv_cache_format)
        self.model_config = mcfg
        vision = self.model.vision  # a vision-language model's encoder, and the images it keeps per row
        per_call = encoder_images(cfg, vision.spec.tokens_per_image) if vision is not None else 0
        self.encoder_cache = EncoderCache(vision, per_call) if vision is not None else None
        self.page_size = cfg.page_size
        self.max_running_requests = max_rows = cfg.max_running_requests
        probe = Probe(
            mcfg.num_heads,
            mcfg.num_kv_heads,
            mcfg.head_dim,
            self.dtype,
            mcfg.sliding_window,
            mcfg.attn_logit_softcapping,
            self.kv_dtype,
        )
        self.backend: AttentionBackend = make_backend(cfg.attention_backend, self.device, probe)
        self.fused_kernels = use_fused_kernels(self.model, cfg.fused_kernels, self.device, self.kv_dtype)

        # (a state row for the reserved row too, which the padded columns of a sampled graph read)
        self.sampler = Sampler(mcfg.vocab_size, max_rows + 1, self.device)
        self.sampler.draw_kernel = draw_kernel(cfg.fused_kernels, mcfg.vocab_size, self.device)
        self.sampler.penalty_kernel = penalty_kernel(cfg.fused_kernels, mcfg.vocab_size, self.device)
        self.sampler.nucleus_kernel = nucleus_kernel(cfg.fused_kernels, mcfg.vocab_size, self.device)
        # One request-table row and token slot past the scheduler's rows, never handed out: padded decode
        # rows (CUDA graphs) and memory-measuring dummies use it. Its token slot always holds a valid id.
        self.pad_row = max_rows
        # future-token slots: the last sampled token of the request in each row (-1: none yet; under
        # chaos_seed also read already, see stream/chaos.py)
        self.token_buf = torch.full((max_rows + 1,), -1, dtype=torch.int64, device=self.device)
        self.token_buf[self.pad_row] = 0
        # an M-RoPE model's (Qwen2.5-VL) per row: what its decode positions add (`gapless.model.vision.mrope`)
        self.rope_deltas: torch.Tensor | None = None
        if mcfg.mrope_section is not None:
            self.rope_deltas = torch.zeros(max_rows + 1, dtype=torch.int64, device=self.device)
        self.graphs: GraphRunner | None = None
        self.piecewise: PiecewiseGraphs | None = None  # small prefills' pieces, when on
        # a `defer_sampling` batch and its logits, until its `SampleJob` (the next job) samples them
        self._deferred: tuple[ForwardBatch, torch.Tensor, PromptScores | None, torch.Tensor | None] | None = (
            None
        )
        self.spec: SpecState | None = None  # speculative decoding's per-row state (made with the table)
        # the resident LoRA adapters, when on: made before the KV plan, which counts them as weights
        self.lora = make_lora_table(cfg, self.model, self.dtype, self.device)
        graph_bs = self._graph_max_bs(cfg)

        per_token = KVPool.bytes_per_token(mcfg.num_layers, mcfg.num_kv_heads, mcfg.head_dim, self.kv_dtype)
        # a draft model's weights are loaded before the plan, and its KV counted in it (spec.draft)
        draft = load_draft(cfg, self.device, max_context, mcfg.vocab_size)
        per_token += draft.bytes_per_token if draft is not None else 0
        kv_tokens, plan = self._kv_tokens(cfg, max_context, per_token, graph_bs, allocated_before)
        kv_tokens = parallel.current().min_over_ranks(kv_tokens)  # every rank's pool holds the same slots
        num_pages = -(-kv_tokens // cfg.page_size) + 1  # +1: page 0 is reserved for padding
        self.kv_pool = self._new_kv_pool(num_pages)
        self.kv_tokens = (num_pages - 1) * cfg.page_size
        # no request can outgrow what the pool holds by itself
        self.max_context = min(max_context, self.kv_tokens)
        self.req_table = ReqTable(max_rows + 1, self.max_context, self.device)
        if draft is not None:
            draft.make_pool(num_pages, cfg.page_size, self.device)
        if cfg.speculative_algorithm is not None:
            self.spec = SpecState(
                max_rows + 1, self.max_context, cfg.speculative_num_draft_tokens, self.device, draft
            )
        log.info(
            "KV cache: %d tokens (%s), %.3g GiB, max context %d (%s)",
            self.kv_tokens,
            self.kv_pool.summary(parallel.current().size),
            self.kv_tokens * per_token / 2**30,
            self.max_context,
            plan.describe() if plan is not None else f"kv_cache_tokens={cfg.kv_cache_tokens}",
        )
        if graph_bs:
            self.graphs = GraphRunner(
                graph_bs,
                req_table=self.req_table,
                token_buf=self.token_buf,
                pad_row=self.pad_row,
                hidden_size=mcfg.hidden_size,
                dtype=self.dtype,
                verify_width=cfg.speculative_num_draft_tokens + 1 if self.spec is not None else 0,
            )
            # padded columns of a sampled graph draw as the reserved row: a greedy row's neutral values
            pad_values, _, _ = RowParams.build(
                [SamplingParams(temperature=0.0).resolved()], [self.pad_row], [0], mcfg.vocab_size
            )
            self.sampler.write_rows(dataclass_to_device(pad_values, self.device))
            self.graphs.capture(self.forward_tokens, self.sample_tokens)
        if cfg.piecewise_cuda_graph_max_tokens:
            self.piecewise = PiecewiseGraphs(
                cfg.piecewise_cuda_graph_max_tokens, self.model, self.kv_pool, self.backend, self.dtype
            )
            self.piecewise.capture()

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

    def _new_kv_pool(self, num_pages: int) -> KVPool:
        scales = self.model.kv_cache_scales
        return KVPool.for_model(
            self.model_config, num_pages, self.page_size, self.kv_dtype, self.device, scales
        )

    def _kv_tokens(
        self, cfg: EngineConfig, max_context: int, per_token: int, graph_bs: int, allocated_before: int
    ) -> tuple[int, CpuKVPlan | GpuKVPlan | None]:
        """Tokens for the KV pool (see `gapless.engine.memory_plan`), and the plan behind them (None when
        `kv_cache_tokens` gave them)."""
        if cfg.kv_cache_tokens is not None:
            return cfg.kv_cache_tokens, None
        most = self.max_running_requests * max_context  # every row full: more could never be used
        if self.device.type != "cuda":
            cpu_plan = plan_cpu_kv(
                memory_gib=cfg.kv_cache_memory_gib,
                available=available_ram(),
                most_tokens=most,
                bytes_per_token=per_token,
            )
            if cpu_plan.capped_by == "ram":
                log.warning("KV cache: %s", cpu_plan.describe())
            return cpu_plan.tokens, cpu_plan
        # the activation peak, measured on a one-page pool and a table as wide as one prefill chunk; both
        # are gone (and their memory back in the allocator) before the free memory is read
        peak, graph_bytes = measure_activations(
            self,
            self._new_kv_pool(1),
            ReqTable(self.max_running_requests + 1, min(max_context, self.chunked_prefill_size), self.device),
            self.chunked_prefill_size,
            graph_bs,
            verify_width=cfg.speculative_num_draft_tokens + 1 if cfg.speculative_algorithm else 0,
            piecewise_tokens=cfg.piecewise_cuda_graph_max_tokens,
        )
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        plan = plan_gpu_kv(
            total=total,
            free=free,
            allocated=allocated_bytes(self.device),
            allocated_before=allocated_before,
            activation_peak=peak,
            graph_bytes=graph_bytes,
            mem_fraction_static=cfg.mem_fraction_static,
            bytes_per_token=per_token,
            encoder_bytes=encoder_bytes(self.model.vision, cfg, self.dtype),
        )
        if plan.tokens < cfg.page_size:
            raise RuntimeError(
                f"no GPU memory left for the KV cache ({plan.describe()}); raise mem_fraction_static, lower "
                "chunked_prefill_size or max_running_requests, or set kv_cache_tokens"
            )
        return min(plan.tokens, most), plan

    def with_memory(self, kv_pool: KVPool, req_table: ReqTable) -> ModelRunner:
        """A runner sharing this one's weights, backend, sampler and future-token slots, but storing KV in
        `kv_pool` and reading `req_table`, without graphs: for measuring memory before the real pool
        exists. This runner is left as it is."""
        other = copy.copy(self)
        other.kv_pool, other.req_table, other.graphs, other.piecewise = kv_pool, req_table, None, None
        return other

    @property
    def info(self) -> RunnerInfo:
        mc = self.model_config
        return RunnerInfo(
            device=str(self.device),
            num_pages=self.kv_pool.num_pages,
            kv_tokens=self.kv_tokens,
            max_context=self.max_context,
            max_running_requests=self.max_running_requests,
            chunked_prefill_size=self.chunked_prefill_size,
            vocab_size=mc.vocab_size,
            max_position_embeddings=mc.max_position_embeddings,
            eos_token_ids=mc.eos_token_ids,
            sliding_window=mc.sliding_window,
            window_layers=mc.window_layers,
            weights=weights_summary(self.model, parallel.current().size),  # (a rank's share, said so)
            quantization=quantization(self.model),
            weight_formats=tuple(sorted(weights_held(self.model)[0].items())),
            kv_cache=self.kv_pool.summary(parallel.current().size),
        )

    def forward_tokens(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        out_slots: torch.Tensor,
        meta: AttentionMetadata,
        images: ImageRows | None = None,
    ) -> torch.Tensor:
        """The decoder over a flat batch whose slots are already in the request table; hidden [T, hidden].
        `images`: encoder rows that replace the embeddings of image tokens."""
        if self.rope_deltas is not None and meta.is_decode:  # one token a row: its M-RoPE delta added
            positions = positions + self.rope_deltas[meta.rows]
        ctx = ForwardContext.prepared(positions, out_slots, self.kv_pool, self.backend, meta)
        ctx.images = images
        return self.model(input_ids, ctx)

    def _eager_inputs(self, batch: ForwardBatch) -> tuple[torch.Tensor, AttentionMetadata]:
        """The input ids of `batch` outside a decode graph (a decode's are its rows' future-token slots)
        and its attention metadata over the device's request table."""
        table = self.req_table.device_table
        assert table is not None, "the runner's request table lives on its device"
        input_ids = self.token_buf[batch.rows] if batch.is_decode else batch.input_ids
        return input_ids, batch.attention_metadata(table)

    @torch.inference_mode()
    def forward_hidden(self, batch: ForwardBatch) -> torch.Tensor:
        """Apply the batch's table writes and run the decoder (through the decode graphs or the prefill
        pieces when they take the batch); returns hidden states [T, hidden]. `batch` must already be on
        this device. A decode whose sampling its graph takes (`_graph_sampling`) runs its sampled graph,
        which draws its tokens too: `run` takes them (`GraphRunner.take_sampled`) instead of sampling."""
        table = self.req_table
        if batch.table_writes is not None:
            table.apply_writes(*batch.table_writes)
        draft = self.spec.draft if self.spec is not None else None
        graphs = self.graphs if self.graphs is not None and self.graphs.can_run(batch) else None
        if self.lora is not None:  # (a verify graph's tokens sit in its padded columns: so do their slots)
            slots = batch.lora_slots
            if graphs is not None and slots is not None and not batch.is_decode:
                slots = graphs.verify_layout(batch, slots, -1)
            self.lora.prepare(batch.lora_loads, slots)
        if graphs is not None:
            hidden = graphs.run(batch, self.forward_tokens, self._graph_sampling(batch))
            if draft is None:
                return hidden
            input_ids, meta = self._eager_inputs(batch)
        else:
            table.apply_writes(batch.token_rows, batch.positions, batch.out_slots)
            input_ids, meta = self._eager_inputs(batch)
            # rotary positions: an M-RoPE extend's over time, height and width, eagerly
            rope = batch.rope.positions.to(self.device) if batch.rope is not None else batch.positions
            if batch.images is not None:  # the encoder's rows go in (gapless.engine.vision), eagerly
                assert self.encoder_cache is not None, "image tokens for a model without a vision encoder"
                images = self.encoder_cache.rows(batch.images, self.device)
                hidden = self.forward_tokens(input_ids, rope, batch.out_slots, meta, images)
            elif batch.rope is None and self.piecewise is not None and self.piecewise.can_run(batch):
                hidden = self.piecewise.run(batch, meta)
            else:
                hidden = self.forward_tokens(input_ids, rope, batch.out_slots, meta)
        if draft is not None:  # the draft sees what the target sees (eagerly, after a graph too)
            draft.mirror(input_ids, batch.positions, batch.out_slots, meta)
        return hidden

    @torch.inference_mode()
    def run(self, batch: DeviceJob) -> SampleOutput:
        """The step's device job: forward, then sample the next token of every request in `sample_index`
        and keep it in its row's future-token slot. Returns the sampled tokens (on the device), with
        logprobs when a request in the batch asked for them, and the prompt logprobs of the positions it
        scores. A batch with `defer_sampling` stops after the logits (nothing sampled, nothing returned);
        the `SampleJob` after it samples them and returns the batch's results, prompt logprobs included."""
        batch = dataclass_to_device(batch, self.device)
        if isinstance(batch, SampleJob):
            assert self._deferred is not None, "a SampleJob without a deferred batch before it"
            (forward, logits, prompt, pooled), self._deferred = self._deferred, None
            out = self._sample(forward, logits, batch.mask)
            out.prompt, out.pooled = prompt, pooled
            return out
        if self.spec is not None:  # a verify's inputs come from what the previous step accepted
            batch = self.spec.prepare(batch, self.token_buf, self.req_table)
        # before any early return: a first chunk samples nothing but must set its rows up
        if batch.row_params is not None:
            self.sampler.write_rows(batch.row_params)
        if batch.penalty_inits:
            rows, prompts, outputs = zip(*batch.penalty_inits)
            self.sampler.init_rows(list(rows), list(prompts), list(outputs))
        if self.rope_deltas is not None and not batch.reads_future_tokens:  # an extend: its rows' deltas
            deltas = batch.rope.deltas.to(self.device) if batch.rope is not None else 0  # (built on the host)
            self.rope_deltas[batch.rows] = deltas
        hidden = self.forward_hidden(batch)
        prompt = None
        if batch.prompt_scores is not None:  # prompt logprobs: in bounded pieces (gapless.sampling.logprobs)
            prompt = score_prompt(hidden, self.model.logits, batch.prompt_scores, self.sampler.vocab_size)
        pooled = pool_hidden(hidden, batch.pool, self.model.logits) if batch.pool is not None else None
        sampled = self.graphs.take_sampled() if self.graphs is not None else None
        if sampled is not None:  # its graph sampled it
            self.token_buf[batch.sample_rows] = sampled
            out = SampleOutput(sampled)
        elif batch.sampling is None:
            out = SampleOutput(torch.empty(0, dtype=torch.int64, device=self.device))
        else:
            logits = self.model.logits(hidden[batch.sample_index])
            if batch.defer_sampling:
                self._deferred = (batch, logits, prompt, pooled)
                return SampleOutput(torch.empty(0, dtype=torch.int64, device=self.device))
            out = self._sample(batch, logits, batch.token_mask)
        out.prompt, out.pooled = prompt, pooled
        return out

    def _graph_sampling(self, batch: ForwardBatch) -> tuple[SampleFlags, SampleTokens] | None:
        """For a decode whose sampling its graph can take (`GraphRunner.sampling_shape`, `has_sampled`):
        its flags and the LM head and draw for the graph to run; None for any other batch, and under
        speculative decoding, which verifies what it samples."""
        graphs = self.graphs
        if graphs is None or self.spec is not None or not graphs.can_run(batch):
            return None
        flags = graphs.sampling_shape(batch)
        if flags is None or not graphs.has_sampled(batch, flags, self.forward_tokens, self.sample_tokens):
            return None
        return flags, self.sample_tokens

    def sample_tokens(
        self, hidden: torch.Tensor, rows: torch.Tensor, steps: torch.Tensor, flags: SampleFlags
    ) -> torch.Tensor:
        """The LM head and draw of decode rows whose sampling needs no mask, bias, penalties or logprobs:
        what a sampled decode graph records after the decoder (`GraphRunner.SampleTokens`)."""
        logits = self.model.logits(hidden)
        return self.sampler.sample(logits, self.sampler.batch(rows, steps, flags))

    def _sample(self, batch: ForwardBatch, logits: torch.Tensor, mask: TokenMask | None) -> SampleOutput:
        """Sample `batch`'s next tokens from its `logits` under `mask` and keep them in the token slots."""
        flags = batch.sampling
        assert flags is not None
        if self.spec is not None:  # a verify's mask holds only below each position's true step
            mask = self.spec.verify_mask(batch, mask)
        sampling = self.sampler.batch(batch.sample_rows, batch.sample_steps, flags)
        logits = self.sampler.constrain(logits, sampling, mask)
        tokens = self.sampler.sample(logits, sampling)
        if self.spec is None:
            self.token_buf[batch.sample_rows] = tokens
            out = tokens
        else:  # (a verify also returns how many drafts each request accepted)
            out = self.spec.keep(batch, tokens, self.token_buf)
        if flags.num_logprobs >= 0:
            lp = compute_logprobs(logits[:, : self.sampler.vocab_size], tokens, flags.num_logprobs)
            return dataclasses.replace(lp, tokens=out)
        return SampleOutput(out)


@torch.inference_mode()
def measure_activations(
    runner: ModelRunner,
    kv_pool: KVPool,
    req_table: ReqTable,
    prefill_tokens: int,
    graph_bs: int,
    verify_width: int = 0,
    piecewise_tokens: int = 0,
) -> tuple[int, int]:
    """Bytes above what stays allocated: (the peak of a dummy prefill of `prefill_tokens` tokens and a
    dummy decode of `max_running_requests` rows, sampling with every stage on; the peak of a decode
    forward of `graph_bs` rows, or of a decode of the largest sampled graph's rows with its sampling
    (every stage on), or with speculation (`verify_width` tokens per request) of an extend
    forward of `graph_bs * verify_width` tokens if larger, which is about what the graphs' shared memory
    pool keeps, plus with piecewise prefill graphs of up to `piecewise_tokens` tokens their static
    buffers and the peak of their pieces on the largest bucket, which their own pool keeps).

    Runs `runner`'s weights and sampler on `kv_pool` and `req_table` (writing only the padding row and KV
    slot 0), and leaves its token slots and sampler state as new. Each dummy runs once unmeasured first,
    so what it allocates for good (the sampler's penalty state, kernels, library handles) counts as
    resident, not as peak. On the CPU the dummies run and both numbers are 0."""
    scratch = runner.with_memory(kv_pool, req_table)
    vocab, max_rows, pad = runner.model_config.vocab_size, runner.max_running_requests, runner.pad_row
    prefill = dummy_prefill(prefill_tokens, req_table.max_context, pad, max_rows, vocab)
    decode = dummy_decode(max_rows, pad, max_rows, vocab)

    def step() -> None:
        scratch.run(prefill)
        scratch.run(decode)

    step()
    peak = peak_bytes(runner.device, step)
    graph_bytes = 0
    if graph_bs:
        fwd = dataclass_to_device(dummy_decode(graph_bs, pad, max_rows, vocab), runner.device)
        graph_bytes = peak_bytes(runner.device, lambda: scratch.forward_hidden(fwd))
        # a sampled graph keeps its LM head's and sampler's buffers too: bounded by a decode of its size
        # sampling with every stage on
        sampled = dummy_decode(min(graph_bs, SAMPLED_MAX_BS), pad, max_rows, vocab)
        graph_bytes = max(graph_bytes, peak_bytes(runner.device, lambda: scratch.run(sampled)))
    if graph_bs and verify_width:  # the largest verify graph: graph_bs requests of verify_width tokens
        tokens = graph_bs * verify_width
        ext = dataclass_to_device(
            dummy_prefill(tokens, req_table.max_context, pad, max_rows, vocab), runner.device
        )
        graph_bytes = max(graph_bytes, peak_bytes(runner.device, lambda: scratch.forward_hidden(ext)))
    if piecewise_tokens:

        def pieces() -> None:
            graphs = PiecewiseGraphs(piecewise_tokens, runner.model, kv_pool, runner.backend, runner.dtype)
            for i in range(graphs.num_pieces):  # on padding: token 0 at position 0, into KV slot 0
                graphs.piece(graphs.max_tokens, i)

        graph_bytes += peak_bytes(runner.device, pieces)
    runner.token_buf.fill_(-1)
    runner.token_buf[runner.pad_row] = 0
    runner.sampler.reset()
    return peak, graph_bytes
