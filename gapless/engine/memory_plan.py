"""How many tokens the KV pool holds, worked out from explicit figures; and the dummy batches that measure
the activations those figures include.

`kv_cache_tokens` decides when given. Otherwise, on the CPU, `plan_cpu_kv` gives the pool a fixed size:
`kv_cache_memory_gib`, 4 GiB by default (as vLLM's CPU backend, `VLLM_CPU_KVCACHE_SPACE`), so the same
command gets the same pool whatever else the machine is doing; never more than every request row can
use, nor more than the available RAM (`available_ram`). On CUDA, `plan_gpu_kv` takes the tighter of the
static share (`mem_fraction_static` of the GPU, less what gapless itself holds) and the free memory less
the activation peak, the CUDA graphs' pool and a reserve. The model runner measures the peak by running
`dummy_prefill` and `dummy_decode` (see `gapless.engine.runner.measure_activations`) before its real pool
exists. Each plan says in one line how it came to its size, for the start-up log.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gapless.config import EngineConfig, parse_limit_mm
from gapless.engine.batch import ForwardBatch
from gapless.model.vision.base import VisionEncoder
from gapless.sampling.rows import RowParams, SampleFlags
from gapless.sampling_params import MAX_LOGPROBS, SamplingParams

_GIB = 2**30
# the CPU pool's size when kv_cache_memory_gib is not given, as vLLM's CPU backend (VLLM_CPU_KVCACHE_SPACE)
DEFAULT_CPU_KV_GIB = 4.0
# the default may take at most this share of the available RAM (activations, the tokenizer and the other
# server processes need the rest); a size the user gave may take all of it
DEFAULT_CPU_KV_MAX_SHARE = 0.5
# GPU memory the measured peaks do not see: allocator fragmentation, the forward stream's cuBLAS
# workspace, the graphs' own kernel parameters
GPU_RESERVE_BYTES = 512 * 2**20


def available_ram() -> int:
    """Available RAM in bytes (MemAvailable), for checking that the CPU KV pool fits."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


@dataclass(frozen=True)
class CpuKVPlan:
    """The KV pool's size on the CPU, and why (for the start-up log line)."""

    tokens: int
    bytes_per_token: int
    requested_gib: float
    given: bool  # kv_cache_memory_gib was set (else the default)
    available: int  # bytes of available RAM when the plan was made
    capped_by: str | None  # None, "rows" (no more can ever be used) or "ram" (the default did not fit)

    def describe(self) -> str:
        size = f"kv_cache_memory_gib={self.requested_gib:g}" + ("" if self.given else " (the default)")
        if self.capped_by == "rows":
            return f"{size}, capped at what max_running_requests rows of the max context can use"
        if self.capped_by == "ram":
            return (
                f"{size} cut to {DEFAULT_CPU_KV_MAX_SHARE:.0%} of the {self.available / _GIB:.1f} GiB of "
                "available RAM; set kv_cache_memory_gib or kv_cache_tokens to choose"
            )
        return size


def plan_cpu_kv(
    *, memory_gib: float | None, available: int, most_tokens: int, bytes_per_token: int
) -> CpuKVPlan:
    """KV tokens for the CPU pool: `memory_gib` (None: `DEFAULT_CPU_KV_GIB`) worth of tokens, at most
    `most_tokens` (every request row full). The free RAM does not set the size, it only checks it: a
    size that was given and exceeds the `available` bytes is a ValueError; the default is cut to
    `DEFAULT_CPU_KV_MAX_SHARE` of them (`capped_by="ram"`, for a warning)."""
    given = memory_gib is not None
    gib = memory_gib if memory_gib is not None else DEFAULT_CPU_KV_GIB
    want = min(int(gib * _GIB), most_tokens * bytes_per_token)
    capped_by = "rows" if want < int(gib * _GIB) else None
    if given and want > available:
        raise ValueError(
            f"kv_cache_memory_gib={gib:g}: a KV cache of {want / _GIB:.2f} GiB does not fit in the "
            f"{available / _GIB:.2f} GiB of available RAM; lower it, or set kv_cache_tokens"
        )
    if not given and want > available * DEFAULT_CPU_KV_MAX_SHARE:
        want, capped_by = int(available * DEFAULT_CPU_KV_MAX_SHARE), "ram"
    return CpuKVPlan(want // bytes_per_token, bytes_per_token, gib, given, available, capped_by)


@dataclass(frozen=True)
class GpuKVPlan:
    """The KV pool's size on a GPU, and the figures (bytes) it was worked out from, for the log line."""

    tokens: int
    total: int
    free: int
    resident: int  # what gapless itself holds: the runner's own allocations
    foreign: int  # what else this process held when the runner started (not gapless's)
    activation_peak: int
    graph_bytes: int
    mem_fraction_static: float
    reserve: int
    encoder_bytes: int = 0  # a vision encoder's activations for the largest image batch (`encoder_images`)

    @property
    def static_limit(self) -> int:
        """Bytes the static share leaves the pool: mem_fraction_static of the GPU less what gapless holds."""
        return int(self.total * self.mem_fraction_static) - self.resident

    @property
    def free_limit(self) -> int:
        """Bytes the free memory leaves the pool once the activations, graphs and reserve are set aside."""
        return self.free - self.activation_peak - self.encoder_bytes - self.graph_bytes - self.reserve

    def describe(self) -> str:
        bound = "mem_fraction_static" if self.static_limit <= self.free_limit else "free memory"
        foreign = f" (not the {self.foreign / _GIB:.2f} GiB others hold)" if self.foreign else ""
        return (
            f"limited by {bound}: mem_fraction_static={self.mem_fraction_static} of {self.total / _GIB:.1f} "
            f"GiB less {self.resident / _GIB:.2f} GiB gapless holds{foreign} leaves "
            f"{self.static_limit / _GIB:.2f} GiB; {self.free / _GIB:.1f} GiB free less activation peak "
            f"{self.activation_peak / _GIB:.2f} GiB, "
            + (f"vision encoder {self.encoder_bytes / _GIB:.2f} GiB, " if self.encoder_bytes else "")
            + f"CUDA graphs {self.graph_bytes / _GIB:.2f} GiB and "
            f"reserve {self.reserve / _GIB:.2f} GiB leaves {self.free_limit / _GIB:.2f} GiB"
        )


def plan_gpu_kv(
    *,
    total: int,
    free: int,
    allocated: int,
    allocated_before: int = 0,
    activation_peak: int,
    graph_bytes: int,
    mem_fraction_static: float,
    bytes_per_token: int,
    reserve: int = GPU_RESERVE_BYTES,
    encoder_bytes: int = 0,
) -> GpuKVPlan:
    """KV tokens the pool may hold on a GPU: its bytes are the tighter of two limits.

    - The static share: what gapless itself keeps allocated for the runner's life (weights, request
      state, sampler state: `allocated` now less `allocated_before` the runner started, never the
      process's total) plus the KV pool fit in `mem_fraction_static` of the `total` memory.
    - What is `free` now must still hold the activation peak of the largest step, the CUDA graphs'
      memory pool and a `reserve`. Memory held by anything else (another process, or another tensor or
      engine of this process: `allocated_before`) is simply not free: it shrinks this limit, not the
      static share, so a foreign allocation costs the pool what it takes and no more. A vision-language
      model's encoder adds its activations for the largest image batch (`encoder_bytes`) beside them.
    """
    plan = GpuKVPlan(
        tokens=0,
        total=total,
        free=free,
        resident=allocated - allocated_before,
        foreign=allocated_before,
        activation_peak=activation_peak,
        graph_bytes=graph_bytes,
        mem_fraction_static=mem_fraction_static,
        reserve=reserve,
        encoder_bytes=encoder_bytes,
    )
    tokens = max(0, min(plan.static_limit, plan.free_limit)) // bytes_per_token
    return dataclasses.replace(plan, tokens=tokens)


def encoder_images(cfg: EngineConfig, tokens_per_image: int) -> int:
    """The most images the encoder takes in one call (`gapless.engine.vision.EncoderCache`): as many as a
    prefill chunk holds whole, plus one cut at each end, never more than every row's prompts may bring
    (`limit_mm_per_prompt`). A batch with more encodes them in several calls."""
    assert cfg.chunked_prefill_size is not None, "the device's prefill budget is set before this"
    most = cfg.max_running_requests * parse_limit_mm(cfg.limit_mm_per_prompt)
    return max(1, min(most, cfg.chunked_prefill_size // tokens_per_image + 2))


def encoder_bytes(encoder: VisionEncoder | None, cfg: EngineConfig, dtype: torch.dtype) -> int:
    """A vision encoder's activations (an estimate, `VisionEncoder.activation_bytes`) for the largest image
    batch it takes (`encoder_images`); 0 for a text model."""
    if encoder is None:
        return 0
    return encoder.activation_bytes(encoder_images(cfg, encoder.spec.tokens_per_image), dtype)


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


def _dummy_batch(
    lens: list[int], is_decode: bool, pad_row: int, max_rows: int, vocab_size: int, start: int = 0
) -> ForwardBatch:
    """Requests of `lens` token-0 tokens at positions `start`.. (after `start` cached ones: the row's
    table reads slot 0 there), all on `pad_row` and KV slot 0, each sampling its next token with every
    stage on."""
    n, num_tokens = len(lens), sum(lens)
    extend_lens = torch.tensor(lens)
    q_start = torch.cumsum(extend_lens, 0) - extend_lens
    rows = torch.full((n,), pad_row, dtype=torch.int64)
    sampler_rows = [i % max_rows for i in range(n)]  # sampler rows index its penalty state: real rows only
    values, stages, logprobs = RowParams.build([_ALL_STAGES] * n, sampler_rows, [0] * n, vocab_size)
    return ForwardBatch(
        input_ids=torch.zeros(0 if is_decode else num_tokens, dtype=torch.int64),  # decode: from the slots
        positions=torch.cat([torch.arange(start, start + length) for length in lens]),
        out_slots=torch.zeros(num_tokens, dtype=torch.int64),
        token_rows=torch.full((num_tokens,), pad_row, dtype=torch.int64),
        rows=rows,
        prefix_lens=torch.full((n,), start, dtype=torch.int64),
        extend_lens=extend_lens,
        q_start=q_start,
        max_extend_len=max(lens),
        max_seq_len=start + max(lens),
        is_decode=is_decode,
        sample_index=q_start + extend_lens - 1,
        sample_rows=values.rows,
        sample_steps=torch.zeros(n, dtype=torch.int64),
        sampling=SampleFlags.of(stages, logprobs),
        row_params=values,
    )


def dummy_prefill(
    num_tokens: int, max_len: int, pad_row: int, max_rows: int, vocab_size: int
) -> ForwardBatch:
    """An extend batch of `num_tokens` tokens in prompts of at most `max_len` tokens each (the request
    table's width), all on `pad_row` and KV slot 0, sampling with every stage on. For measuring memory."""
    lens = [min(max_len, num_tokens - i) for i in range(0, num_tokens, max_len)]
    return _dummy_batch(lens, False, pad_row, max_rows, vocab_size)


def dummy_decode(
    batch_size: int, pad_row: int, max_rows: int, vocab_size: int, position: int = 0
) -> ForwardBatch:
    """A decode batch of `batch_size` requests, all on `pad_row` at `position` and KV slot 0, sampling
    with every stage on. For measuring memory (and compiling: `gapless.engine.cpu_compile`)."""
    return _dummy_batch([1] * batch_size, True, pad_row, max_rows, vocab_size, position)


def allocated_bytes(device: torch.device) -> int:
    """Bytes of live tensors on `device` (CUDA's caching allocator), 0 off CUDA."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def peak_bytes(device: torch.device, fn: Callable[[], object]) -> int:
    """Peak bytes `fn` allocates above what was allocated before it (0 off CUDA, where `fn` just runs)."""
    if device.type != "cuda":
        fn()
        return 0
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return max(0, torch.cuda.max_memory_allocated(device) - base)
