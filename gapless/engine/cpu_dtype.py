"""Lower precision on the CPU: which CPUs compute bfloat16 and float16 natively, and the start-up warning
where they do not.

`--dtype auto` stays float32 on the CPU. `--dtype bfloat16` or `float16` is always accepted there (the
engine's results stay within that precision's tolerance of transformers'), but it pays only where the
CPU has the instructions: bfloat16 dot products with AVX512-BF16 or AMX, float16 with AMX-FP16 or
AVX512-FP16. Elsewhere every matmul converts its operands to float32 on the fly, which costs more than the
halved weight bytes save, so the runner logs a warning naming what the CPU lacks and what to use instead.
"""

from __future__ import annotations

from pathlib import Path

import torch

from gapless.model.cpu_gemm import native_bf16  # the one place that says whether oneDNN has bf16 here

_CPUINFO = Path("/proc/cpuinfo")


def _cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them (empty elsewhere)."""
    try:
        text = _CPUINFO.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def native_fp16() -> bool:
    """The CPU has float16 arithmetic (AMX-FP16 or AVX512-FP16)."""
    return torch.cpu._is_amx_fp16_supported() or "avx512_fp16" in _cpu_flags()


def slow_dtype_warning(dtype: torch.dtype) -> str | None:
    """Why `dtype` will be slow on this CPU, or None when it is float32 or the CPU computes it natively."""
    if dtype == torch.bfloat16 and not native_bf16():
        lacks = "AVX512-BF16 or AMX"
    elif dtype == torch.float16 and not native_fp16():
        lacks = "AMX-FP16 or AVX512-FP16"
    else:
        return None
    name = str(dtype).removeprefix("torch.")
    return (
        f"dtype {name} on a CPU without {lacks}: each matmul converts to float32 on the fly, so this is "
        f"likely slower than float32 here; use --dtype float32 (the CPU default)"
        + ("" if dtype == torch.bfloat16 or not native_bf16() else ", or bfloat16, which this CPU has")
    )
