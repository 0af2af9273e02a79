"""The repetition, frequency and presence penalties as one Triton kernel, writing the step's float32 copy.

The torch path (`gapless.sampling.sampler.apply_penalties`) gathers the batch's rows of the penalty state
(int32 counts and the bool prompt mask, [max_rows, vocab]) into [batch, vocab] copies, copies the logits to
float32 and changes that copy in several passes, with a float32 [batch, vocab] buffer for the factors.
`apply_penalties` here reads the logits once, in their own dtype, and each row's state where it lies (by
its request-table row), and writes the penalised float32 [batch, vocab] logits in one pass: the one float32
[batch, vocab] tensor a penalised step needs (the temperature then scales it in place, or the fused draw
reads it and scales in registers).

Bit for bit the torch path: every step is one IEEE-rounded fp32 operation in the same order, ``x * rep``
or ``x / rep`` (``div_rn``: Triton's plain ``/`` may be an approximate division on the GPU), then
``x - freq * count`` and ``x - pres * (count > 0)``, the products rounded before the subtractions: the
launch turns off the compiler's fusion of a multiply and an add into an FMA (``enable_fp_fusion``), which
would round once. `gapless.sampling.fused` checks the kernel against the torch path at start-up on CUDA.
The launcher reads sizes from host ints and never syncs the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gapless.attention.triton_kernels import INTERPRET

BLOCK_V = 1024


@triton.jit
def _penalties_kernel(
    Logits,
    stride_l,
    Out,
    Rows,
    Counts,
    stride_c,
    Prompt,
    stride_p,
    Repetition,
    Frequency,
    Presence,
    vocab,
    BLOCK: tl.constexpr,
):
    """Program (b, c) penalises columns [c * BLOCK, (c + 1) * BLOCK) of batch row b, whose state is that
    of request-table row Rows[b]."""
    b = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < vocab
    row = tl.load(Rows + b).to(tl.int64)
    x = tl.load(Logits + b.to(tl.int64) * stride_l + cols, mask=mask, other=0.0).to(tl.float32)
    count = tl.load(Counts + row * stride_c + cols, mask=mask, other=0)
    in_prompt = tl.load(Prompt + row * stride_p + cols, mask=mask, other=0)
    rep = tl.load(Repetition + b)
    freq = tl.load(Frequency + b)
    pres = tl.load(Presence + b)
    in_output = count > 0
    repeated = tl.where(x < 0.0, x * rep, tl.math.div_rn(x, rep))
    x = tl.where((in_prompt != 0) | in_output, repeated, x)
    x = x - freq * count.to(tl.float32)
    x = x - pres * tl.where(in_output, 1.0, 0.0)
    tl.store(Out + b.to(tl.int64) * vocab + cols, x, mask=mask)


def apply_penalties(
    logits: torch.Tensor,
    counts: torch.Tensor,
    prompt_mask: torch.Tensor,
    rows: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """`gapless.sampling.sampler.apply_penalties` in one kernel: the penalised logits, a new float32
    [B, V] tensor. `logits` [B, V] fp32/bf16/fp16; `counts` int32 and `prompt_mask` bool, [max_rows, V],
    indexed by `rows` ([B] int64); `repetition`, `frequency`, `presence` [B] float32."""
    batch, vocab = logits.shape
    out = torch.empty(batch, vocab, dtype=torch.float32, device=logits.device)
    if batch == 0:
        return out
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    block = BLOCK_V if not INTERPRET else min(BLOCK_V, triton.next_power_of_2(vocab))
    _penalties_kernel[(batch, triton.cdiv(vocab, block))](
        logits,
        logits.stride(0),
        out,
        rows.contiguous(),
        counts,
        counts.stride(0),
        prompt_mask.view(torch.uint8),  # bool as its bytes: a plain 8-bit load
        prompt_mask.stride(0),
        repetition.contiguous(),
        frequency.contiguous(),
        presence.contiguous(),
        vocab,
        BLOCK=block,
        num_warps=4,
        enable_fp_fusion=False,  # keep `x - f * c` two roundings, as torch computes it
    )
    return out
