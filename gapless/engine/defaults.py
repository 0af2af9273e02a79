"""Engine options whose best value depends on the device: chosen once, when the model runner knows its
device, from explicit figures (the device's kind and total memory), so the rule is tested with fake
numbers on any machine. An option the user set is never changed.

`chunked_prefill_size` (the token budget of one prefill batch) is the one such option. A larger budget
prefills more prompt tokens per forward, which a GPU runs in about the time of a small one, at the cost
of a larger activation peak (the KV planner measures that peak with the chosen value, so the pool shrinks
to make room for it). The rule follows SGLang's `ServerArgs._handle_gpu_memory_settings`, which scales
the budget with the GPU's memory (2,048 tokens under 35 GiB, 4,096 under 60 GiB); from 60 GiB up it
takes 16,384, where SGLang takes 8,192 up to 160 GiB: on an H100 80GB gapless measured 11,610 output
tok/s at 16,384 against 8,755 at 2,048 on the nano-vllm workload (Qwen3-0.6B's shape; the commands
and runs in docs/benchmarks.md, "On a GPU"). On the CPU 2,048 stays: a
CPU runs a forward in time proportional to its tokens, so a larger budget only delays the decode steps
that wait behind it.

`max_running_requests` (256) and `cuda_graph_max_bs` (256 on CUDA with a kernel backend) keep their
fixed defaults: the H100 measurements tried no other value of the first, and only 0 of the second (2.4x
slower), so nothing justifies a device rule for them yet.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from gapless.config import EngineConfig

log = logging.getLogger(__name__)

_GIB = 2**30
CPU_CHUNKED_PREFILL_SIZE = 2048
# (GPU memory below this many GiB, chunked_prefill_size), smallest first; past the last: GPU_LARGE
GPU_CHUNKED_PREFILL_TIERS: tuple[tuple[float, int], ...] = ((35, 2048), (60, 4096))
GPU_LARGE_CHUNKED_PREFILL_SIZE = 16384


def choose_chunked_prefill_size(device_type: str, total_memory: int | None) -> int:
    """The default token budget of one prefill batch on a device of `device_type` ("cpu", "cuda") with
    `total_memory` bytes (a GPU's; None or ignored on the CPU). See the module docstring for the rule."""
    if device_type != "cuda" or total_memory is None:
        return CPU_CHUNKED_PREFILL_SIZE
    for below_gib, size in GPU_CHUNKED_PREFILL_TIERS:
        if total_memory < below_gib * _GIB:
            return size
    return GPU_LARGE_CHUNKED_PREFILL_SIZE


def device_memory(device: torch.device) -> int | None:
    """Total bytes of a CUDA device's memory; None for any other device."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.get_device_properties(device).total_memory)


def apply_device_defaults(cfg: EngineConfig, device_type: str, total_memory: int | None) -> EngineConfig:
    """`cfg` with each device-dependent option it leaves unset (None) chosen for this device, and one log
    line saying what was chosen and from what; the options it sets are kept as they are."""
    if cfg.chunked_prefill_size is not None:
        return cfg
    size = choose_chunked_prefill_size(device_type, total_memory)
    memory = f", {total_memory / _GIB:.1f} GiB" if total_memory is not None and device_type == "cuda" else ""
    log.info(
        "device defaults: chunked_prefill_size=%d (chosen for %s%s; set it to override)",
        size,
        device_type,
        memory,
    )
    return dataclasses.replace(cfg, chunked_prefill_size=size)
