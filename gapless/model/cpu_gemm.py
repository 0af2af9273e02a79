"""The CPU's GEMMs with prepacked weights: each linear layer's weight (and the LM head's) reordered once,
after loading, into oneDNN's blocked layout, and every forward a single oneDNN inner-product call on it.

Why: on a CPU a small model's decode step is mostly its GEMMs, at 1-32 rows, reading every weight once per
step. `torch.mm(x, W.t())` on the row-major checkpoint layout is MKL's GEMM with a transposed B, which at
these row counts reads the weights far below the memory bandwidth; the LM head (49,152 x 576 for
SmolLM2) is the worst of them. oneDNN's packed weight (`torch.ops.mkldnn._reorder_linear_weight`, the op
inductor's CPU weight prepacking uses) is laid out for its own kernels. Measured on SmolLM2-135M's shapes
with `python -m gapless.bench.cpu_gemm` and the ad-hoc scripts it grew from (its 120 linear layers and
LM head, cold weights, interleaved with the plain path in one run; several runs on a loaded 2-core
machine, logs in `bench/results/cpu_gemm/`), packed/plain time with one thread: the layers 0.71-1.05x at
1 row, 0.49x at 4, 0.52-0.7x at 8, 0.65-0.8x at 32; the LM head 0.66-0.94x, 0.34x, 0.30-0.48x,
0.40-0.57x. With two
threads 0.42-0.51x (layers) and 0.29-0.35x (head) at 8 and 32 rows, but at one row the layers were 5-10x
slower: oneDNN splits every GEMV across the threads, and on a machine this loaded each such parallel
region waits for a descheduled thread (MKL runs these GEMVs on one; at 8 rows and more both libraries
split, and both suffer). That is the busy-machine case the README already answers with
`--device-threads 1`; one row is packed all the same, because the packed results hardly depend on how
many rows ride together (the same from two rows on, and at one for most shapes), so a speculative verify
(several rows) gives the logprobs plain decoding (one row) gives, which tests/spec checks to 1e-4 on
logits of ~150: with one row left on MKL's GEMV and more rows packed, that check failed. One packing
(for a batch of 8) serves every row count. A column-major weight (`W^T` contiguous) was faster at one
row (0.69x, head 0.56x) but slower at 4 rows and more (1.1-1.3x); MKL's packed SGEMM
(`torch.ops.mkl._mkl_linear`) was no faster than the plain path at 8 and 32 rows.

The result equals `F.linear` within float32 reassociation (oneDNN sums the products in another order), not
bit for bit. The packed copy replaces the checkpoint-layout weight, whose storage is freed (the parameter
stays, empty, so the module's structure is unchanged), except where another module reads the same tensor:
a tied LM head keeps the embedding table, and packs a copy of it (the one weight held twice). Packing
happens after loading (and after tensor-parallel sharding), so nothing reads the freed weights.
float32 is packed, and bfloat16 on a CPU that computes it (AVX512-BF16 or AMX: there the
same microbenchmark gave 0.59-0.69x the layers' time at 1 row, 0.58-0.68x at 8, 0.70-0.73x at 32, one
thread; the outputs equal to the plain path's in that run, once rounded to bfloat16); float16 is not
(not measured: no CPU here has its instructions). Where the ops are missing (a torch built without
oneDNN) or fail on a probe, nothing is packed and the reason is logged once.
`GAPLESS_CPU_GEMM=plain` turns the packing off (for comparisons: `gapless.bench.cpu_step --compare`).
"""

from __future__ import annotations

import logging
from typing import TypeVar

import torch
from torch import nn

from gapless import env
from gapless.model import opaque_gemm
from gapless.model.layers import ParallelLMHead, _Linear
from gapless.model.quant.base import UNQUANTIZED

log = logging.getLogger(__name__)
M = TypeVar("M", bound=nn.Module)

ENV = env.CPU_GEMM.name  # "plain": leave the weights unpacked (the default is "onednn")
PACK_FOR_ROWS = 8  # the batch oneDNN chooses the blocked layout for; the measured best for 1-32 rows
# a lone row is computed as this many copies of itself (a few hundred bytes copied), its first output
# row kept: see `PackedLinear`
ONE_ROW_AS = 4
_OPS = ("_reorder_linear_weight", "_linear_pointwise")  # in torch.ops.mkldnn


class PackedLinear:
    """y = x W^T + b through oneDNN's inner product on W reordered once into its blocked layout. Not a
    module: it holds no parameters of its own (the layer's `weight` stays the loaded one).

    A lone row (a one-request decode step) goes in as `ONE_ROW_AS` copies of itself, for two reasons:
    oneDNN's one-row kernel on the packed layout was slower than its kernel for four rows, though the
    weights are read once either way (SmolLM2-135M, one thread, interleaved on a loaded machine, two runs:
    0.61-0.96x the linear layers' time, 0.44-0.94x the LM head's, 0.78-0.81x the one-request decode
    step's; two threads unmeasured there; README, "Serving on a CPU"); and the row's result is then
    exactly the one it gets among other rows, for every shape (oneDNN's one-row kernel sums in another
    order for some, SmolLM2's down projection among them), so a one-row decode and a several-row
    speculative verify get the same GEMM results, bit for bit."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features = weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_FOR_ROWS)
        self.bias = None if bias is None else bias.detach()
        self.handle = opaque_gemm.register(self)  # (a compiled graph calls `gemm` through it)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] == 1 and ONE_ROW_AS > 1:
            # `cat` and `as_strided`: one op each, where an `expand` would be two plus the contiguous copy
            # oneDNN makes of it, and `[:1]` two (a visible cost at 121 GEMMs a step)
            out = self.direct(torch.cat([x] * ONE_ROW_AS))
            return out.as_strided((1, out.shape[1]), out.stride())
        return self.direct(x)

    def direct(self, x: torch.Tensor) -> torch.Tensor:
        """oneDNN's inner product on `x` as it is (a lone row too: `gapless.bench.cpu_gemm` compares)."""
        return opaque_gemm.call(self, x)

    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def native_bf16() -> bool:
    """The CPU has bfloat16 dot products (AVX512-BF16, or AMX tiles), which oneDNN's matmuls use."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the weights of a model on `device` in `dtype` are not packed; None: they are."""
    if device.type != "cpu":
        return f"device {device.type} (packing is for the CPU)"
    if dtype == torch.bfloat16 and not native_bf16():
        return "bfloat16 on a CPU without AVX512-BF16 or AMX"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {dtype} (only float32 and bfloat16 were measured faster)"
    if env.CPU_GEMM.get() == "plain":
        return f"{ENV}=plain"
    if not torch.backends.mkldnn.is_available():
        return "this torch is built without oneDNN"
    missing = [op for op in _OPS if not hasattr(torch.ops.mkldnn, op)]
    if missing:
        return f"this torch lacks torch.ops.mkldnn.{', '.join(missing)}"
    try:  # a tiny probe: the op exists and computes a linear layer
        w, x = torch.eye(3, dtype=dtype), torch.arange(6.0, dtype=dtype).view(2, 3)
        if not torch.equal(PackedLinear(w, None)(x), x):
            return "oneDNN's packed linear gave a wrong result on a probe"
    except RuntimeError as e:
        return f"oneDNN's packed linear failed on a probe: {e}"
    return None


def pack_cpu_gemms(model: M) -> M:
    """`model`, its linear layers and LM head given a packed weight (`cpu_gemm`) when on a CPU in float32
    or natively computed bfloat16 (see the module's docstring); unchanged elsewhere. Call once, after the
    weights are loaded."""
    layers = [
        m
        for m in model.modules()
        if isinstance(m, (_Linear, ParallelLMHead)) and m.linear_method is UNQUANTIZED  # fp8's keep theirs
    ]
    if not layers:
        return model
    why = unavailable_reason(layers[0].weight.device, layers[0].weight.dtype)
    if why is not None:
        if layers[0].weight.device.type == "cpu":
            log.info("CPU GEMMs: plain torch.mm, weights not prepacked: %s", why)
        return model
    # a weight another module also reads (a tied LM head's, the embedding table) keeps its storage
    shared = {
        id(p)
        for m in model.modules()
        if not isinstance(m, (_Linear, ParallelLMHead))
        for p in m.parameters(recurse=False)
    }
    freed = 0
    for layer in layers:
        layer.cpu_gemm = PackedLinear(layer.weight, getattr(layer, "bias", None))
        if id(layer.weight) not in shared:  # only the packed copy is read from now on: drop the loaded one
            freed += layer.weight.numel() * layer.weight.element_size()
            layer.weight.data = layer.weight.data.new_empty(0)
    log.info(
        "CPU GEMMs: %d weights prepacked for oneDNN (%.0f MB of checkpoint-layout copies freed)",
        len(layers),
        freed / 2**20,
    )
    return model
