"""How many tokens the KV pool holds, worked out from explicit figures; and the dummy batches that measure
the activations those figures include.

`kv_cache_tokens` decides when given. Otherwise, on the CPU, the pool gets `kv_memory_fraction` of the
available RAM (`available_ram`); on CUDA, `plan_gpu_kv` takes the tighter of the static share
(`mem_fraction_static` of the GPU, less what stays allocated) and the free memory less the activation
peak, the CUDA graphs' pool and a reserve. The model runner measures the peak by running `dummy_prefill`
and `dummy_decode` (see `gapless.engine.runner.measure_activations`) before its real pool exists.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from gapless.engine.batch import ForwardBatch
from gapless.sampling.sampler import SamplingBatch
from gapless.sampling_params import MAX_LOGPROBS, SamplingParams

CPU_KV_FRACTION = 0.3  # default kv_memory_fraction
# GPU memory the measured peaks do not see: allocator fragmentation, the forward stream's cuBLAS
# workspace, the graphs' own kernel parameters
GPU_RESERVE_BYTES = 512 * 2**20
_GIB = 2**30


def available_ram() -> int:
    """Available RAM in bytes, for sizing the KV cache on the CPU."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


@dataclass(frozen=True)
class GpuKVPlan:
    """The KV pool's size on a GPU, and the figures (bytes) it was worked out from, for the log line."""

    tokens: int
    total: int
    free: int
    resident: int
    activation_peak: int
    graph_bytes: int
    mem_fraction_static: float

    def describe(self) -> str:
        return (
            f"mem_fraction_static={self.mem_fraction_static} of {self.total / _GIB:.1f} GiB, "
            f"{self.free / _GIB:.1f} GiB free: {self.resident / _GIB:.2f} GiB resident, activation peak "
            f"{self.activation_peak / _GIB:.2f} GiB, CUDA graphs {self.graph_bytes / _GIB:.2f} GiB"
        )


def plan_gpu_kv(
    *,
    total: int,
    free: int,
    resident: int,
    activation_peak: int,
    graph_bytes: int,
    mem_fraction_static: float,
    bytes_per_token: int,
    reserve: int = GPU_RESERVE_BYTES,
) -> GpuKVPlan:
    """KV tokens the pool may hold on a GPU: its bytes are the tighter of two limits.

    - The static share: what stays allocated for the runner's life (`resident`: weights, request
      state, sampler state) plus the KV pool fit in `mem_fraction_static` of the `total` memory.
    - What is `free` now (other processes' use included) must still hold the activation peak of the
      largest step, the CUDA graphs' memory pool and a `reserve`.
    """
    static = int(total * mem_fraction_static) - resident
    dynamic = free - activation_peak - graph_bytes - reserve
    tokens = max(0, min(static, dynamic)) // bytes_per_token
    return GpuKVPlan(tokens, total, free, resident, activation_peak, graph_bytes, mem_fraction_static)


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
    lens: list[int], is_decode: bool, pad_row: int, max_rows: int, vocab_size: int
) -> ForwardBatch:
    """Requests of `lens` token-0 tokens at positions 0.., all on `pad_row` and KV slot 0, each sampling
    its next token with every stage on."""
    n, num_tokens = len(lens), sum(lens)
    extend_lens = torch.tensor(lens)
    q_start = torch.cumsum(extend_lens, 0) - extend_lens
    rows = torch.full((n,), pad_row, dtype=torch.int64)
    sampler_rows = [i % max_rows for i in range(n)]  # sampler rows index its penalty state: real rows only
    return ForwardBatch(
        input_ids=torch.zeros(0 if is_decode else num_tokens, dtype=torch.int64),  # decode: from the slots
        positions=torch.cat([torch.arange(length) for length in lens]),
        out_slots=torch.zeros(num_tokens, dtype=torch.int64),
        token_rows=torch.full((num_tokens,), pad_row, dtype=torch.int64),
        rows=rows,
        prefix_lens=torch.zeros(n, dtype=torch.int64),
        extend_lens=extend_lens,
        q_start=q_start,
        max_extend_len=max(lens),
        max_seq_len=max(lens),
        is_decode=is_decode,
        sample_index=q_start + extend_lens - 1,
        sample_rows=rows,
        sampling=SamplingBatch.build(
            [_ALL_STAGES] * n, [0] * n, sampler_rows, [0] * n, "cpu", vocab_size=vocab_size
        ),
    )


def dummy_prefill(
    num_tokens: int, max_len: int, pad_row: int, max_rows: int, vocab_size: int
) -> ForwardBatch:
    """An extend batch of `num_tokens` tokens in prompts of at most `max_len` tokens each (the request
    table's width), all on `pad_row` and KV slot 0, sampling with every stage on. For measuring memory."""
    lens = [min(max_len, num_tokens - i) for i in range(0, num_tokens, max_len)]
    return _dummy_batch(lens, False, pad_row, max_rows, vocab_size)


def dummy_decode(batch_size: int, pad_row: int, max_rows: int, vocab_size: int) -> ForwardBatch:
    """A decode batch of `batch_size` requests, all on `pad_row` at position 0 and KV slot 0, sampling
    with every stage on. For measuring memory."""
    return _dummy_batch([1] * batch_size, True, pad_row, max_rows, vocab_size)
