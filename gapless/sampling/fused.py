"""Which implementations of the sampler's fused stages run: the Triton kernels or torch ops.

`draw_kernel` (the seeded draw), `penalty_kernel` (the penalties) and `nucleus_kernel` (top-p without a
sort) follow the engine's `fused_kernels` choice ("auto", "torch", "triton", as
`gapless.model.fused.use_fused_kernels` validates it), through one chooser (`_choose`): "auto" takes a
kernel on CUDA only after it agrees with its torch path on a fixed batch of this vocabulary's size
(`disagreement`: the draw (`gapless.sampling.triton_sample`) draws the torch Sampler's tokens on rows
whose kept sets lie clear of rounding, in every filter mode and with greedy rows among them;
`penalty_disagreement`: the penalties (`gapless.sampling.triton_penalties`) are bit for bit those of
`gapless.sampling.sampler.apply_penalties`; `nucleus_disagreement`: the nucleus floors
(`gapless.sampling.triton_nucleus`, for the torch draw) are the sort's on rows whose boundaries lie clear
of rounding); on any error or disagreement it logs why and returns None
(torch). Nothing here imports Triton before a choice needs it.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from functools import partial
from types import ModuleType
from typing import TypeVar

import torch

from gapless.config import FUSED_KERNELS
from gapless.sampling.filters import NucleusKernel, _nucleus_floor
from gapless.sampling.sampler import DrawKernel, PenaltyKernel, Sampler, SamplingBatch, apply_penalties
from gapless.sampling_params import SamplingParams

log = logging.getLogger(__name__)

K = TypeVar("K")
# `nucleus_rows`' six rows under filters whose kept sets lie clear of rounding (and a greedy row)
FILTERED = [
    SamplingParams(top_p=0.6),
    SamplingParams(top_k=3, temperature=0.5),
    SamplingParams(top_k=5, top_p=0.8),
    SamplingParams(min_p=0.1),
    SamplingParams(top_p=0.999, temperature=1.0),
    SamplingParams(temperature=0),
]


def _choose(
    name: str,
    device: torch.device,
    module: str,
    make: Callable[[ModuleType], K],
    check: Callable[[K], str | None],
) -> K | None:
    """The kernel `make` builds from the Triton module `module` under `fused_kernels=name`, or None for
    torch ops: "torch" never, "triton" always (on CPU only under Triton's interpreter), "auto" on CUDA once
    `check` (None: agrees with torch; else why not) passes it."""
    if name not in FUSED_KERNELS:
        raise ValueError(f"fused_kernels={name!r}: must be one of {FUSED_KERNELS}")
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return None
    try:
        kernels = importlib.import_module(module)
    except ImportError as e:
        if name == "triton":
            raise RuntimeError(
                f"fused_kernels='triton' needs the triton package ({type(e).__name__}: {e})"
            ) from e
        log.warning("fused sampling: triton does not import (%s); using torch", e)
        return None
    kernel = make(kernels)
    if name == "triton":
        if device.type == "cpu" and not kernels.INTERPRET:
            raise RuntimeError(
                "fused_kernels='triton' runs on CUDA devices; on CPU it needs Triton's interpreter (set "
                "TRITON_INTERPRET=1 before Triton is first imported, slow, meant for tests) - or use 'torch'"
            )
        return kernel
    why = check(kernel)
    if why is not None:
        log.warning("fused sampling: %s; using torch", why)
        return None
    return kernel


def draw_kernel(name: str, vocab_size: int, device: torch.device) -> DrawKernel | None:
    """The sort-free draw for `Sampler.draw_kernel` under `fused_kernels=name`, or None for torch ops."""
    return _choose(
        name,
        device,
        "gapless.sampling.triton_sample",
        lambda kernels: partial(_fused_draw, kernels.draw),
        lambda kernel: disagreement(kernel, vocab_size, device),
    )


def penalty_kernel(name: str, vocab_size: int, device: torch.device) -> PenaltyKernel | None:
    """The fused penalties for `Sampler.penalty_kernel` under `fused_kernels=name`, or None for torch."""
    return _choose(
        name,
        device,
        "gapless.sampling.triton_penalties",
        lambda kernels: kernels.apply_penalties,
        lambda kernel: penalty_disagreement(kernel, vocab_size, device),
    )


def nucleus_kernel(name: str, vocab_size: int, device: torch.device) -> NucleusKernel | None:
    """The sort-free top-p floor for `Sampler.nucleus_kernel` under `fused_kernels=name`, or None (the
    sort)."""
    return _choose(
        name,
        device,
        "gapless.sampling.triton_nucleus",
        lambda kernels: kernels.nucleus_floor,
        lambda kernel: nucleus_disagreement(kernel, vocab_size, device),
    )


def _fused_draw(
    kernel: Callable[..., torch.Tensor], logits: torch.Tensor, batch: SamplingBatch
) -> torch.Tensor:
    """`Sampler.draw_kernel`'s signature over `gapless.sampling.triton_sample.draw`."""
    need = (batch.need_top_k, batch.need_top_p, batch.need_min_p)
    args = (batch.temperature, batch.top_k, batch.top_p, batch.min_p, batch.seeds, batch.steps)
    return kernel(logits, *args, need, largest_k=(batch.max_top_k, batch.max_top_p_k))


def disagreement(kernel: DrawKernel, vocab_size: int, device: torch.device) -> str | None:
    """None if `kernel` draws the torch path's tokens over several steps on two fixed batches of
    `vocab_size` columns: bf16 logits at several temperatures with a greedy row (the same noise, so the
    same tokens), and `nucleus_rows` (float32, and in bf16) under top-p, top-k, both, min-p, and greedy
    (their kept sets clear of rounding, so the same tokens); else why not."""
    try:
        g = torch.Generator().manual_seed(0)
        plain = (torch.randn(4, vocab_size, generator=g) * 4).to(device=device, dtype=torch.bfloat16)
        temperatures = [0.7, 1.0, 0.0, 1.6]
        filtered = nucleus_rows(vocab_size, device)[0]
        cases = {
            "temperature": (plain, [SamplingParams(temperature=t) for t in temperatures]),
            "filters": (filtered, FILTERED),
            # half-precision logits, as models give them: small top-k takes the window, not the search
            "filters, bf16": (filtered.to(torch.bfloat16), FILTERED),
        }
        torch_sampler = Sampler(vocab_size, 6, device)
        for mode, (logits, params) in cases.items():
            n = len(params)
            seeds = [0, 1, 2, -(2**40), 5, 6][:n]
            for step in range(3):
                resolved = [p.resolved() for p in params]
                batch = SamplingBatch.build(resolved, [step] * n, list(range(n)), seeds, device, vocab_size)
                want = torch_sampler.sample(logits, batch)
                got = kernel(logits, batch)
                if not torch.equal(got, want):
                    return (
                        f"the Triton draw ({mode}) drew {got.tolist()}, torch {want.tolist()} at step {step}"
                    )
    except Exception as e:  # noqa: BLE001 - a compile or launch failure is the answer
        return f"the Triton draw failed: {type(e).__name__}: {e}"
    return None


def penalty_disagreement(kernel: PenaltyKernel, vocab_size: int, device: torch.device) -> str | None:
    """None if `kernel` gives the torch path's penalised logits bit for bit on a fixed bf16 batch of
    `vocab_size` columns (rows out of order in the state; repetition alone, frequency and presence alone,
    all three, and a neutral row); else why not."""
    try:
        g = torch.Generator().manual_seed(0)
        logits = (torch.randn(4, vocab_size, generator=g) * 4).to(device=device, dtype=torch.bfloat16)
        counts = torch.randint(0, 3, (6, vocab_size), generator=g, dtype=torch.int32).to(device)
        prompt_mask = (torch.rand(6, vocab_size, generator=g) < 0.3).to(device)
        rows = torch.tensor([5, 0, 3, 2], device=device)
        repetition = torch.tensor([1.3, 1.0, 0.8, 1.0], device=device)
        frequency = torch.tensor([0.0, 0.4, -0.3, 0.0], device=device)
        presence = torch.tensor([0.0, 0.7, 0.25, 0.0], device=device)
        args = (counts, prompt_mask, rows, repetition, frequency, presence)
        want = apply_penalties(logits, *args)
        got = kernel(logits, *args)
        if got.dtype != torch.float32 or got.shape != want.shape:
            return f"the Triton penalties gave {got.dtype} {tuple(got.shape)}, torch {tuple(want.shape)}"
        if not torch.equal(got, want):
            differ = (got != want).nonzero()[0].tolist()
            return (
                f"the Triton penalties differ from torch's at {differ}: "
                f"{got[tuple(differ)].item()!r} vs {want[tuple(differ)].item()!r}"
            )
    except Exception as e:  # noqa: BLE001 - a compile or launch failure is the answer
        return f"the Triton penalties failed: {type(e).__name__}: {e}"
    return None


def nucleus_rows(vocab_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [6, vocab_size] and top_p [6] whose nuclei lie clear of rounding: each row's ten likeliest
    tokens (at columns of its own) hold 0.99 x 1/2, 1/4, ... of the mass, the rest share what is left
    (tied; every seventh masked to -inf), and each top_p falls mid-way between two cumulative sums, or past
    the ten (the tied rest kept whole), or is 1 (no nucleus)."""
    g = torch.Generator().manual_seed(0)
    head = 0.99 * 0.5 ** torch.arange(1, 11, dtype=torch.float64)
    rows = []
    for _ in range(6):
        probs = torch.full((vocab_size,), (1 - head.sum().item()) / (vocab_size - 10), dtype=torch.float64)
        cols = torch.randperm(vocab_size, generator=g)
        probs[cols[:10]] = head
        logits = probs.log().float() + 3.0  # any shift: the rule reads probabilities
        logits[cols[10::7]] = float("-inf")
        rows.append(logits)
    top_p = torch.tensor([0.3, 0.6, 0.8, 0.95, 0.999, 1.0])
    return torch.stack(rows).to(device), top_p.to(device)


def nucleus_disagreement(kernel: NucleusKernel, vocab_size: int, device: torch.device) -> str | None:
    """None if `kernel` finds the sort's nucleus floor on `nucleus_rows`; else why not."""
    try:
        logits, top_p = nucleus_rows(vocab_size, device)
        want = _nucleus_floor(logits.sort(dim=-1).values, top_p)
        got = kernel(logits, top_p)
        if not torch.equal(got, want):
            got_list, want_list = got.flatten().tolist(), want.flatten().tolist()
            return f"the Triton nucleus floors {got_list} differ from the sort's {want_list}"
    except Exception as e:  # noqa: BLE001 - a compile or launch failure is the answer
        return f"the Triton nucleus failed: {type(e).__name__}: {e}"
    return None
