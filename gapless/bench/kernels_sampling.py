"""The sampler's part of `python -m gapless.bench.kernels`: each sampling mode on 1 to 256 rows of a
vocabulary (default Qwen3's 151,936 logits), through `Sampler.sample` as a decode step calls it.

Two kinds of row: each sampling mode a user picks (temperature, Qwen3's generation defaults, top-k +
top-p, top-p alone, min-p, penalties) on the sampler as the engine builds it (`engine_sampler`: the fused
kernels where they run), timed alone; and the older torch-against-kernel comparisons (the seeded draw, the
penalties, top-k + top-p by the full sort against the partial one, top-p by the full sort against the
nucleus kernel), whose "torch µs" is the same mode on torch ops. The memory floor of a row is reading its
logits once (`logits_read_us` beside each row, from the copy bandwidth of the same run)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from gapless.bench.timing import copy_tb_s, median_us

# each mode a user picks, by the `SamplingParams` fields that select it
MODES: dict[str, dict[str, Any]] = {
    "temperature 0.6 (nano-vllm's bench.py)": dict(temperature=0.6),
    "Qwen3 defaults (temperature 0.6, top-k 20, top-p 0.95)": dict(temperature=0.6, top_k=20, top_p=0.95),
    "top-k 50 + top-p 0.95": dict(top_k=50, top_p=0.95),
    "temperature 0.6 + top-p 0.9 (Llama 3's defaults)": dict(temperature=0.6, top_p=0.9),
    "min-p 0.05": dict(temperature=0.8, min_p=0.05),
    "penalties (repetition, frequency, presence)": dict(
        repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.5
    ),
}


def engine_sampler(vocab: int, rows: int, device: torch.device, kernels: bool) -> Any:
    """A `Sampler` of `rows` rows as the engine's runner builds one: with the fused kernels where they
    run (`kernels` and CUDA, or Triton's interpreter), else on torch ops."""
    from gapless.sampling import fused
    from gapless.sampling.sampler import Sampler

    s = Sampler(vocab, rows, device)
    if kernels and _kernels_run(device):
        s.draw_kernel = fused.draw_kernel("triton", vocab, device)
        s.penalty_kernel = fused.penalty_kernel("triton", vocab, device)
        s.nucleus_kernel = fused.nucleus_kernel("triton", vocab, device)
    # each row's prompt and a few outputs, as a running request's (the penalties read them)
    s.init_rows(
        list(range(rows)),
        [list(range(i, vocab, 7)) for i in range(rows)],
        [list(range(i, vocab, 13)) for i in range(rows)],
    )
    return s


def _kernels_run(device: torch.device) -> bool:
    """Whether the fused sampling kernels run on `device` (CUDA, or a CPU under Triton's interpreter)."""
    try:
        from gapless.attention import triton_kernels
    except ImportError:
        return False
    return device.type == "cuda" or triton_kernels.INTERPRET


def sampling_rows(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list[dict[str, Any]]:
    """`sampling_cases` at each `--sample-batch` count of rows."""
    return [row for rows in args.sample_batch for row in sampling_cases(args, rows, device, dtype)]


def _batch(params: dict[str, Any], rows: int, device: torch.device, vocab: int) -> Any:
    from gapless.sampling.sampler import SamplingBatch
    from gapless.sampling_params import SamplingParams

    p = SamplingParams(**params).resolved()
    return SamplingBatch.build([p] * rows, [0] * rows, list(range(rows)), list(range(rows)), device, vocab)


def sampling_cases(
    args: argparse.Namespace, rows: int, device: torch.device, dtype: torch.dtype
) -> list[dict[str, Any]]:
    """The sampler on `rows` rows of `--vocab` logits in `dtype`: each of `MODES` on the engine's sampler,
    then the torch-against-kernel comparisons (see the module's docstring)."""
    B, V = rows, args.vocab
    logits = (torch.randn(B, V, device=device) * 3).to(dtype)
    nbytes = logits.numel() * logits.element_size()
    read_us = nbytes / copy_tb_s(nbytes, device, args) / 1e6  # the copy's TB/s counts reads and writes
    fast, plain = engine_sampler(V, B, device, True), engine_sampler(V, B, device, False)
    cases: dict[str, tuple[str, Callable[[], object], Callable[[], object] | None]] = {}
    for mode, params in MODES.items():
        batch = _batch(params, B, device, V)
        if "penalties" in mode:
            cases[mode] = ("engine", lambda b=batch: fast.sample(fast.apply_penalties(logits, b), b), None)
        else:
            cases[mode] = ("engine", lambda b=batch: fast.sample(logits, b), None)
    draw = _batch(dict(temperature=0.8), B, device, V)
    nucleus = _batch(dict(top_k=50, top_p=0.95), B, device, V)
    penalised = _batch(MODES["penalties (repetition, frequency, presence)"], B, device, V)
    full = dataclasses.replace(nucleus, max_top_p_k=0)  # 0: unknown, the full sort
    top_p_only = _batch(dict(temperature=0.6, top_p=0.9), B, device, V)
    kernels = _kernels_run(device)
    cases |= {
        "seeded draw (temperature only)": (
            "triton draw",
            lambda: plain.sample(logits, draw),
            (lambda: fast.sample(logits, draw)) if kernels else None,
        ),
        "torch penalties vs triton": (
            "triton penalties",
            lambda: plain.apply_penalties(logits, penalised),
            (lambda: fast.apply_penalties(logits, penalised)) if kernels else None,
        ),
        "top-k 50 + top-p 0.95, full sort vs partial": (
            "partial sort",
            lambda: plain.sample(logits, full),
            lambda: plain.sample(logits, nucleus),
        ),
        "top-p 0.9, full sort vs nucleus": (
            "triton nucleus",
            lambda: plain.sample(logits, top_p_only),
            (lambda: fast.sample(logits, top_p_only)) if kernels else None,
        ),
    }
    out = []
    with torch.inference_mode():
        for name, (path, first, second) in cases.items():
            t_first = median_us(first, device, args)
            engine = path == "engine"
            out.append(
                {
                    "rows": B,
                    "case": name,
                    "torch_us": None if engine else t_first,
                    "path": path,
                    "path_us": t_first if engine else second and median_us(second, device, args),
                    "logits_read_us": read_us,
                }
            )
    return out
