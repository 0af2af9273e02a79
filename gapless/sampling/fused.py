"""Which implementation of the seeded draw a sampler runs: the fused Triton kernel or torch ops.

`draw_kernel` follows the engine's `fused_kernels` choice ("auto", "torch", "triton", as
`gapless.model.fused.use_fused_kernels` validates it): "auto" takes the kernel
(`gapless.sampling.triton_gumbel`) on CUDA only after it draws the same tokens as the torch path
(`gapless.sampling.sampler.gumbel_argmax`) on a fixed batch of this vocabulary's size, in both of its modes
(logits scaled by the kernel, and scaled and filtered before it) and with greedy rows among them; on any
error or disagreement it logs why and returns None (torch). Nothing here imports Triton before a choice
needs it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import torch

from gapless.config import FUSED_KERNELS
from gapless.sampling.sampler import _bits_as_int32, _column_hashes, _row_keys, gumbel_argmax

log = logging.getLogger(__name__)

DrawKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]


def draw_kernel(name: str, vocab_size: int, device: torch.device) -> DrawKernel | None:
    """The fused draw for `Sampler.draw_kernel` under `fused_kernels=name`, or None for torch ops."""
    if name not in FUSED_KERNELS:
        raise ValueError(f"fused_kernels={name!r}: must be one of {FUSED_KERNELS}")
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return None
    try:
        from gapless.sampling import triton_gumbel
    except ImportError as e:
        if name == "triton":
            raise RuntimeError(
                f"fused_kernels='triton' needs the triton package ({type(e).__name__}: {e})"
            ) from e
        log.warning("fused sampling: triton does not import (%s); using torch", e)
        return None
    kernel = partial(_fused_draw, triton_gumbel.gumbel_argmax)
    if name == "triton":
        if device.type == "cpu" and not triton_gumbel.INTERPRET:
            raise RuntimeError(
                "fused_kernels='triton' runs on CUDA devices; on CPU it needs Triton's interpreter (set "
                "TRITON_INTERPRET=1 before Triton is first imported, slow, meant for tests) - or use 'torch'"
            )
        return kernel
    why = disagreement(kernel, vocab_size, device)
    if why is not None:
        log.warning("fused sampling: %s; using torch", why)
        return None
    return kernel


def _fused_draw(
    kernel: Callable[..., torch.Tensor],
    logits: torch.Tensor,
    temperature: torch.Tensor,
    keys: torch.Tensor,
    scale: bool,
) -> torch.Tensor:
    """`Sampler.draw_kernel`'s signature over the kernel, which takes the keys' 32 bits as int32."""
    return kernel(logits, temperature, _bits_as_int32(keys), scale)


def disagreement(kernel: DrawKernel, vocab_size: int, device: torch.device) -> str | None:
    """None if `kernel` draws the torch path's tokens on a fixed bf16 batch of `vocab_size` columns (three
    sampled rows and a greedy one, several steps, both modes); else why not."""
    try:
        g = torch.Generator().manual_seed(0)
        logits = (torch.randn(4, vocab_size, generator=g) * 4).to(device=device, dtype=torch.bfloat16)
        temperature = torch.tensor([0.7, 1.0, 0.0, 1.6], device=device)
        hashes = _bits_as_int32(_column_hashes(vocab_size, device))
        seeds = torch.tensor([0, 1, 2, -(2**40)], device=device)
        scaled = logits / temperature.masked_fill(temperature == 0, 1.0)[:, None]
        for step in range(4):
            keys = _row_keys(seeds, torch.full((4,), step, device=device))
            for scale, x in ((True, logits), (False, scaled)):
                want = gumbel_argmax(x, temperature, keys, hashes, scale)
                got = kernel(x, temperature, keys, scale)
                if not torch.equal(got, want):
                    mode = "scaling" if scale else "on scaled logits"
                    return (
                        f"the Triton draw ({mode}) drew {got.tolist()}, torch {want.tolist()} at step {step}"
                    )
    except Exception as e:  # noqa: BLE001 - a compile or launch failure is the answer
        return f"the Triton draw failed: {type(e).__name__}: {e}"
    return None
